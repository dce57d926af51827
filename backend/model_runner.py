"""Builds one step's tensors from the scheduler's decisions, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kernels
from .models.llama import AttentionBatch, LlamaModel, LoraBatch
from .sampler import sample, token_logprobs


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
        self.host_cache = allocate_host_cache(kv_cache, num_host_blocks)

    def execute(self, batch, copies: bool = True) -> RunnerOutput:
        """Run one step for a SchedulerOutput: block copies (swap out, copy-on-write, swap in), then the model.

        ``copies=False`` skips the copies (a retry of a step whose copies already ran).
        """
        if copies:
            self.copy_blocks(batch)
        if not batch.seqs:
            return RunnerOutput([], [], [])
        input_ids, positions, slot_mapping = [], [], []
        cu, context_lens, sample_rows, sample_seqs = [0], [], [], []
        bs = self.block_size
        for seq, n, table in zip(batch.seqs, batch.num_new_tokens, batch.block_tables):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            span = range(start, start + n)
            positions += span
            slot_mapping += [table[p // bs] * bs + p % bs for p in span]
            cu.append(cu[-1] + n)
            context_lens.append(start + n)
            if start + n == len(seq.token_ids):
                sample_rows.append(cu[-1] - 1)
                sample_seqs.append(len(context_lens) - 1)
        width = max(len(t) for t in batch.block_tables)
        tables = [t + [0] * (width - len(t)) for t in batch.block_tables]
        is_decode = cu[-1] == len(batch.seqs)
        attn = AttentionBatch(
            positions=self._tensor(positions, torch.int64),
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_query_lens=self._tensor(cu, torch.int32),
            is_decode=is_decode,
        )
        lora = self._lora_batch(batch, cu, is_decode)
        seqs = [batch.seqs[i] for i in sample_seqs]
        for j, (i, child) in enumerate(batch.forks):  # n > 1: the other samples share the parent's last row
            sample_rows.append(cu[i + 1] - 1)
            sample_seqs.append(len(batch.seqs) + j)
            seqs.append(child)
        rows = len(batch.seqs) + len(batch.forks)
        out = RunnerOutput([None] * rows, [None] * rows, [None] * rows)
        with torch.inference_mode():
            hidden = self.model.forward(self._tensor(input_ids, torch.int64), attn, self.kv_cache, lora)
            if not sample_rows:
                return out
            logits = self.model.logits(hidden[self._tensor(sample_rows, torch.int64)])
            finite = torch.isfinite(logits).all(dim=-1)
            if not bool(finite.all()):
                logits = self._contain_non_finite(logits, finite, sample_seqs, out)
            tokens = sample(logits, [s.request.params for s in seqs], [s.generator for s in seqs])
            chosen, tops = token_logprobs(logits, tokens, [s.request.params.logprobs for s in seqs])
        for j, i in enumerate(sample_seqs):
            out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = tokens[j], chosen[j], tops[j]
        return out

    def copy_blocks(self, batch) -> None:
        """The step's block copies, in order: swap out, copy-on-write, swap in."""
        if batch.swap_out:
            self.swap_out(batch.swap_out)
        if batch.copy_pairs:
            src, dst = zip(*batch.copy_pairs)
            kernels.copy_blocks(self.kv_cache, self._tensor(src, torch.int64), self._tensor(dst, torch.int64))
        if batch.swap_in:
            self.swap_in(batch.swap_in)

    @staticmethod
    def _contain_non_finite(logits: torch.Tensor, finite: torch.Tensor, sample_seqs: list[int],
                            out: RunnerOutput) -> torch.Tensor:
        """Record an error for each row with NaN/inf logits and zero those rows so the others still sample."""
        bad = (~finite).nonzero().flatten().tolist()
        for j in bad:
            out.errors[sample_seqs[j]] = NonFiniteLogits("the model produced NaN or infinite logits for this request")
        logits = logits.clone()
        logits[bad] = 0.0
        return logits

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device KV blocks to host blocks: (device, host) pairs."""
        dev, host = zip(*pairs)
        data = self.kv_cache.index_select(2, self._tensor(dev, torch.int64))
        self.host_cache.index_copy_(2, torch.tensor(host, dtype=torch.int64), data.to(self.host_cache.device))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host KV blocks back to device blocks: (host, device) pairs."""
        host, dev = zip(*pairs)
        data = self.host_cache.index_select(2, torch.tensor(host, dtype=torch.int64))
        self.kv_cache.index_copy_(2, self._tensor(dev, torch.int64), data.to(self.device, non_blocking=True))

    def _lora_batch(self, batch, cu, is_decode) -> LoraBatch | None:
        """Per-row slots for a decode step (one token per sequence), segments for a step with prefill."""
        slots = [seq.adapter_slot for seq in batch.seqs]
        if self.lora_slots is None or max(slots) < 0:
            return None
        if is_decode:
            return LoraBatch(self.lora_slots, self._tensor(slots, torch.int32), None, None, True)
        seg_starts, seg_slots = [0], []
        for b, slot in enumerate(slots):  # merge neighbours that share an adapter
            if seg_slots and seg_slots[-1] == slot:
                seg_starts[-1] = cu[b + 1]
            else:
                seg_slots.append(slot)
                seg_starts.append(cu[b + 1])
        seg_tensors = self._tensor(seg_starts, torch.int32), self._tensor(seg_slots, torch.int32)
        return LoraBatch(self.lora_slots, None, *seg_tensors, False)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


def allocate_host_cache(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """Host swap tensor shaped like the device cache with num_blocks blocks (pinned on CUDA); None if 0."""
    if num_blocks <= 0:
        return None
    shape = list(kv_cache.shape)
    shape[2] = num_blocks
    return torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=kv_cache.is_cuda)
