"""Decode steps replayed from CUDA graphs: one captured forward per batch size, its inputs in static buffers.

A decode step launches hundreds of small kernels (a 32-layer model: ~20 a layer); replaying
them as one graph removes their launch cost from the host's critical path. Capture happens
once, at engine start, for each size in ``capture_sizes``; a step of n sequences replays the
smallest graph of at least n rows, its extra rows padding (slot -1: no K/V written; context
1; no adapter), as vLLM does. Steps with prefill, and decode batches above the largest size,
run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from loraplex.models.llama import AttentionBatch

log = logging.getLogger("loraplex.graphs")

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """CAPTURE_SIZES up to max_num_seqs, and max_num_seqs itself (a full batch never runs eagerly)."""
    return sorted({s for s in CAPTURE_SIZES if s < max_num_seqs} | {max_num_seqs})


def cuda_graph_capture(pool=None) -> Callable:
    """capture(fn) -> (replay, output): fn run once eagerly (kernels compiled and loaded outside the capture),
    then captured into a CUDA graph that shares one memory pool with the other sizes."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]):
        warm_up = torch.cuda.Stream()  # torch's recipe: the eager run on a side stream, then the capture
        warm_up.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm_up):
            fn()
        torch.cuda.current_stream().wait_stream(warm_up)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = fn()
        torch.cuda.synchronize()
        return graph.replay, output

    return capture


class DecodeGraphs:
    """The captured decode forwards of one model, KV cache and LoRA stacks, and their static inputs."""

    def __init__(self, model, kv_cache: torch.Tensor, sizes: list[int], max_blocks_per_seq: int, lora=None,
                 capture: Callable | None = None):
        """lora: the LoRA backend (loraplex.lora.backends) whose per-row plans the adapter graphs replay."""
        self.sizes = sorted(sizes)
        rows, device = self.sizes[-1], model.device
        pinned = torch.device(device).type == "cuda"

        self._padding: list[tuple[torch.Tensor, int]] = []  # each static input and the value of a padding row

        def buffer(value: int, *shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
            """A static device input and its pinned host twin: a step's array goes host -> twin -> device."""
            host = torch.full(shape, value, dtype=dtype, pin_memory=pinned)
            on_device = host.to(device, copy=True)
            self._padding.append((on_device, value))
            return on_device, host

        self.input_ids, self._input_ids = buffer(0, rows, dtype=torch.int64)
        self.positions, self._positions = buffer(0, rows, dtype=torch.int64)
        self.slot_mapping, self._slot_mapping = buffer(-1, rows, dtype=torch.int64)  # -1: no K/V written
        self.block_tables, self._block_tables = buffer(0, rows, max(max_blocks_per_seq, 1), dtype=torch.int32)
        self.context_lens, self._context_lens = buffer(1, rows, dtype=torch.int32)
        self.token_slots, self._token_slots = buffer(-1, rows, dtype=torch.int32) if lora is not None \
            else (None, None)
        self.cu = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.lora = lora
        self.replays = 0
        capture = capture or cuda_graph_capture()
        # (size, with adapters) -> (replay, output); a batch without adapters skips the LoRA kernels altogether
        self.graphs: dict[tuple[int, bool], tuple[Callable, torch.Tensor]] = {}
        for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its pool memory
            for adapters in (False, True) if lora is not None else (False,):
                self.graphs[size, adapters] = capture(self._forward_of(model, kv_cache, size, adapters))
        self._check_replay(model, kv_cache)
        log.info("captured decode graphs for batch sizes %s", self.sizes)

    def _check_replay(self, model, kv_cache: torch.Tensor) -> None:
        """The largest graph replayed on inputs it was not captured with equals the eager forward on them: a
        step-dependent value computed at capture instead of inside the graph (a memo, a host read) would be
        replayed as a constant. Row r sits at position r % block_size of its own block, so it writes its K/V,
        rotates by a position of its own and attends to the keys its block holds so far (rows past the cache's
        slots write nothing). Raises RuntimeError on a difference. The buffers are reset after."""
        size, (num_blocks, block_size) = self.sizes[-1], kv_cache.shape[2:4]
        rows = torch.arange(size, device=self.input_ids.device)
        fits = rows < num_blocks * block_size
        self.input_ids[:size].copy_(rows % model.vocab_size)
        self.positions[:size].copy_(rows % block_size)
        self.slot_mapping[:size].copy_(torch.where(fits, rows, -1))
        self.block_tables[:size, 0].copy_(torch.where(fits, rows // block_size, 0))
        self.context_lens[:size].copy_(torch.where(fits, rows % block_size + 1, 1))
        replay, output = self.graphs[size, False]
        replay()
        want = self._forward_of(model, kv_cache, size, False)()
        same = torch.allclose(output.float(), want.float(), rtol=1e-3, atol=1e-3)
        for buffer, value in self._padding:
            buffer.fill_(value)
        if not same:
            raise RuntimeError("a decode graph's replay differs from the eager forward")

    def _forward_of(self, model, kv_cache: torch.Tensor, size: int, adapters: bool) -> Callable[[], torch.Tensor]:
        attn = AttentionBatch(self.positions[:size], self.slot_mapping[:size], self.block_tables[:size],
                              self.context_lens[:size], self.cu[:size + 1], True)
        lora = self.lora.rows(self.token_slots[:size]) if adapters else None
        return lambda: model.forward(self.input_ids[:size], attn, kv_cache, lora)

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size of at least num_seqs rows; None above the largest."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def serves(self, step) -> bool:
        """Whether this step can replay a graph: a decode step within the sizes."""
        return step.is_decode and self.size_for(len(step.context_lens)) is not None \
            and step.block_tables.shape[1] <= self.block_tables.shape[1]

    def run(self, step, adapter_slots) -> torch.Tensor:
        """Hidden states [n, hidden] of a step that serves(): its inputs (and each row's adapter slot; None when
        no row has one) staged, the padding rows reset, one copy each to the device, the replay.

        The result is the graph's own output: read it before the next run."""
        n = len(step.context_lens)
        size = self.size_for(n)
        width = step.block_tables.shape[1]
        staged = [(self.input_ids, self._input_ids, step.input_ids, 0),
                  (self.positions, self._positions, step.positions, 0),
                  (self.slot_mapping, self._slot_mapping, step.slot_mapping, -1),
                  (self.context_lens, self._context_lens, step.context_lens, 1)]
        if adapter_slots is not None:
            staged.append((self.token_slots, self._token_slots, adapter_slots, -1))
        for device_buffer, host, values, padding in staged:
            host[:n].numpy()[:] = values
            host[n:size].fill_(padding)  # padding rows: write nothing, attend to one key, no adapter
            device_buffer[:size].copy_(host[:size], non_blocking=True)
        self._block_tables[:n, :width].numpy()[:] = step.block_tables
        self.block_tables[:n].copy_(self._block_tables[:n], non_blocking=True)
        replay, output = self.graphs[size, adapter_slots is not None]
        replay()
        self.replays += 1
        return output[:n]


def build_decode_graphs(model, kv_cache: torch.Tensor, max_num_seqs: int, max_model_len: int, block_size: int,
                        lora=None) -> DecodeGraphs | None:
    """The engine's decode graphs on CUDA; None (eager decode, with a warning) if capture fails."""
    try:
        return DecodeGraphs(model, kv_cache, capture_sizes(max_num_seqs), -(-max_model_len // block_size),
                            lora)
    except Exception:  # eager decode is slower, never wrong
        log.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None


__all__ = ["DecodeGraphs", "build_decode_graphs", "capture_sizes", "cuda_graph_capture", "CAPTURE_SIZES"]
