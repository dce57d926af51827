"""Builds one step's tensors from the scheduler's decisions, runs the model, samples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from . import kernels
from .models.llama import AttentionBatch, LlamaModel, LoraBatch
from .sampler import sample_tokens, token_logprobs


@dataclass(slots=True)
class RunnerOutput:
    """Per scheduled sequence, then per fork child: sampled token (None mid-prefill), its logprob, top candidates."""

    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> why that row could not be sampled


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits for one sequence: that request fails alone."""


class ModelRunner:
    """Owns the model, the KV tensor, the host swap tensor and the LoRA stacks; never decides policy."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, lora_slots,
                 num_host_blocks: int = 0):
        self.model, self.kv_cache, self.block_size, self.lora_slots = model, kv_cache, block_size, lora_slots
        self.device = model.device
        self._on_cpu = torch.device(self.device).type == "cpu"  # then a step array is used in place, not copied
        self.host_cache = allocate_host_cache(kv_cache, num_host_blocks)

    def execute(self, batch, copies: bool = True) -> RunnerOutput:
        """Run one step for a SchedulerOutput: block copies (swap out, copy-on-write, swap in), then the model.

        ``copies=False`` skips the copies (a retry of a step whose copies already ran).
        """
        if copies:
            self.copy_blocks(batch)
        if not batch.seqs:
            return RunnerOutput([], [], [])
        step = StepArrays.build(batch, self.block_size)
        attn = AttentionBatch(
            positions=self._tensor(step.positions),
            slot_mapping=self._tensor(step.slot_mapping),
            block_tables=self._tensor(step.block_tables),
            context_lens=self._tensor(step.context_lens),
            cu_query_lens=self._tensor(step.cu),
            is_decode=step.is_decode,
        )
        lora = self._lora_batch(batch, step.cu, step.is_decode)
        num = len(batch.seqs)
        sample_seqs = step.sample_seqs.tolist()
        every_seq = len(sample_seqs) == num  # then sample j is batch row j (forks follow)
        seqs, sample_rows = batch.seqs, step.sample_rows
        if not every_seq or batch.forks:
            seqs, sample_rows = [batch.seqs[i] for i in sample_seqs], sample_rows.tolist()
            for j, (i, child) in enumerate(batch.forks):  # n > 1: the other samples share the parent's last row
                sample_rows.append(int(step.cu[i + 1]) - 1)
                sample_seqs.append(num + j)
                seqs.append(child)
        rows = num + len(batch.forks)
        errors: dict[int, Exception] = {}
        with torch.inference_mode():
            hidden = self.model.forward(self._tensor(step.input_ids), attn, self.kv_cache, lora)
            if not sample_seqs:
                return RunnerOutput([None] * rows, [None] * rows, [None] * rows, errors)
            if seqs is batch.seqs and step.is_decode and hidden.is_contiguous():
                picked = hidden  # every row sampled once, in order: the index would copy it unchanged
            else:
                picked = hidden[self._tensor(sample_rows)]
            logits = self.model.logits(picked)
            if not math.isfinite(logits.sum().item()):  # one reduction; a NaN or inf anywhere shows in the sum
                logits = self._contain_non_finite(logits, torch.isfinite(logits).all(dim=-1), sample_seqs, errors)
            params = [s.request.params for s in seqs]
            tokens = sample_tokens(logits, params, [s.generator for s in seqs])
            if any(s.request.wants_logprobs for s in seqs):
                chosen, tops = token_logprobs(logits, tokens, [p.logprobs for p in params])
            else:  # nobody reads them: skip a logsumexp over the vocabulary per row
                chosen, tops = [0.0] * len(seqs), [None] * len(seqs)
            tokens = tokens.tolist()
        if every_seq:  # sample j is row j
            return RunnerOutput(tokens, chosen, tops, errors)
        out = RunnerOutput([None] * rows, [None] * rows, [None] * rows, errors)
        for j, i in enumerate(sample_seqs):
            out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = tokens[j], chosen[j], tops[j]
        return out

    def copy_blocks(self, batch) -> None:
        """The step's block copies, in order: swap out, copy-on-write, swap in."""
        if batch.swap_out:
            self.swap_out(batch.swap_out)
        if batch.copy_pairs:
            src, dst = zip(*batch.copy_pairs)
            kernels.copy_blocks(self.kv_cache, self._tensor(src), self._tensor(dst))
        if batch.swap_in:
            self.swap_in(batch.swap_in)

    @staticmethod
    def _contain_non_finite(logits: torch.Tensor, finite: torch.Tensor, sample_seqs: list[int],
                            errors: dict[int, Exception]) -> torch.Tensor:
        """Record an error for each row with NaN/inf logits and zero those rows so the others still sample."""
        bad = (~finite).nonzero().flatten().tolist()
        for j in bad:
            errors[sample_seqs[j]] = NonFiniteLogits("the model produced NaN or infinite logits for this request")
        logits = logits.clone()
        logits[bad] = 0.0
        return logits

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device KV blocks to host blocks: (device, host) pairs."""
        dev, host = zip(*pairs)
        data = self.kv_cache.index_select(2, self._tensor(dev))
        self.host_cache.index_copy_(2, torch.tensor(host, dtype=torch.int64), data.to(self.host_cache.device))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host KV blocks back to device blocks: (host, device) pairs."""
        host, dev = zip(*pairs)
        data = self.host_cache.index_select(2, torch.tensor(host, dtype=torch.int64))
        self.kv_cache.index_copy_(2, self._tensor(dev), data.to(self.device, non_blocking=True))

    def _lora_batch(self, batch, cu: np.ndarray, is_decode: bool) -> LoraBatch | None:
        """Per-row slots for a decode step (one token per sequence), segments for a step with prefill."""
        if self.lora_slots is None:
            return None
        slot_list = [seq.adapter_slot for seq in batch.seqs]
        if max(slot_list) < 0:
            return None
        slots = np.fromiter(slot_list, np.int32, len(slot_list))
        if is_decode:
            return LoraBatch(self.lora_slots, self._tensor(slots), None, None, True)
        change = np.flatnonzero(slots[1:] != slots[:-1]) + 1  # neighbours that share an adapter are one segment
        seg_starts = np.concatenate(([0], cu[change], cu[-1:])).astype(np.int32)
        seg_slots = slots[np.concatenate(([0], change))]
        return LoraBatch(self.lora_slots, None, self._tensor(seg_starts), self._tensor(seg_slots), False)

    def _tensor(self, values) -> torch.Tensor:
        """A step array (numpy) or an id list (int64) as a tensor on the model's device."""
        array = values if isinstance(values, np.ndarray) else np.asarray(values, np.int64)
        tensor = torch.from_numpy(array)
        return tensor if self._on_cpu else tensor.to(self.device)


@dataclass(slots=True)
class StepArrays:
    """One step's model inputs as numpy arrays, built without a Python loop per token."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [B, max blocks], padded with block 0
    context_lens: np.ndarray  # int32 [B]
    cu: np.ndarray  # int32 [B+1]: prefix sums of new tokens
    sample_rows: np.ndarray  # int64: the row of each sequence whose last prompt/output token is in this step
    sample_seqs: np.ndarray  # int64: those sequences' indices in the batch
    is_decode: bool  # one new token per sequence

    @classmethod
    def build(cls, batch, block_size: int) -> "StepArrays":
        """From a SchedulerOutput: each sequence's new tokens start at its num_computed_tokens."""
        seqs, num = batch.seqs, len(batch.seqs)
        if sum(batch.num_new_tokens) == num:
            return cls._build_decode(seqs, batch.block_tables, block_size)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num)
        counts = np.asarray(batch.num_new_tokens, np.int64)
        cu = np.zeros(num + 1, np.int64)
        np.cumsum(counts, out=cu[1:])
        ends, total = starts + counts, int(cu[-1])
        input_ids = np.fromiter(chain.from_iterable(s.token_ids[a:b] for s, a, b in
                                                    zip(seqs, starts.tolist(), ends.tolist())), np.int64, total)
        owner = np.repeat(np.arange(num), counts)  # the sequence of each token
        positions = np.arange(total) - (cu[:-1] - starts)[owner]
        block_tables = _padded(batch.block_tables)
        slot_mapping = block_tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
        done = ends == np.fromiter((len(s.token_ids) for s in seqs), np.int64, num)  # sampled this step
        sample_seqs = np.flatnonzero(done)
        return cls(input_ids, positions, slot_mapping, block_tables, ends.astype(np.int32), cu.astype(np.int32),
                   cu[1:][sample_seqs] - 1, sample_seqs, False)

    @classmethod
    def _build_decode(cls, seqs, tables, block_size: int) -> "StepArrays":
        """One new token per sequence: one pass over the sequences for its token and position."""
        num = len(seqs)
        ids, starts, unsampled = [], [], []
        add_id, add_start = ids.append, starts.append
        for i, s in enumerate(seqs):
            p, tokens = s.num_computed_tokens, s.token_ids
            add_id(tokens[p])
            add_start(p)
            if len(tokens) != p + 1:
                unsampled.append(i)  # not its last token: a one-token prompt chunk
        positions = np.fromiter(starts, np.int64, num)
        block_tables = _padded(tables)
        block, offset = np.divmod(positions, block_size)
        slot_mapping = block_tables[np.arange(num), block].astype(np.int64)
        slot_mapping *= block_size
        slot_mapping += offset
        sample_seqs = np.delete(np.arange(num), unsampled) if unsampled else np.arange(num)
        return cls(np.fromiter(ids, np.int64, num), positions, slot_mapping, block_tables,
                   np.add(positions, 1, dtype=np.int32), np.arange(num + 1, dtype=np.int32), sample_seqs, sample_seqs,
                   True)


def _padded(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int32 [B, longest] array, shorter rows padded with block 0."""
    lens = list(map(len, tables))
    width, total = max(lens), sum(lens)
    flat = np.fromiter(chain.from_iterable(tables), np.int32, total)
    if total == width * len(tables):  # all the same length: no padding
        return flat.reshape(len(tables), width)
    block_tables = np.zeros((len(tables), width), np.int32)
    block_tables[np.arange(width) < np.array(lens)[:, None]] = flat  # row-major, so each row's ids in order
    return block_tables


def allocate_host_cache(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """Host swap tensor shaped like the device cache with num_blocks blocks (pinned on CUDA); None if 0."""
    if num_blocks <= 0:
        return None
    shape = list(kv_cache.shape)
    shape[2] = num_blocks
    return torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=kv_cache.is_cuda)
