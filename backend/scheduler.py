"""Iteration-level scheduler: token budget, chunked prefill, prefix-cache hits, preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache.manager import KVCacheManager
from .request import FinishReason, Sequence, SeqStatus


@dataclass(slots=True)
class SchedulerOutput:
    """Who runs this step, how many new tokens each, their block tables, and COW copies."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to run."""
        return not self.seqs


class Scheduler:
    """Decides each step's batch; updates sequences with the runner's tokens. Touches no tensors."""

    def __init__(self, config, kv: KVCacheManager, adapters, eos_token_ids: set[int], max_model_len: int):
        self.config, self.kv, self.adapters = config, kv, adapters
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.watermark_blocks = max(1, kv.num_blocks // 100)
        self.prefix_query_tokens: dict[str, int] = {}  # per tenant
        self.prefix_hit_tokens: dict[str, int] = {}
        self.num_preemptions = 0

    # ---- admission and removal -------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Any sequence waiting or running."""
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence: free its blocks and adapter pin at once."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        self._release_adapter(seq)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running sequences first (decode or next prefill chunk), then admit waiting ones."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens_to_compute, budget)
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._emit(out, seq, n)
                budget -= n
                i += 1
        if not preempted:
            budget = self._admit(out, budget)
        out.copy_pairs = self.kv.take_copy_pairs()
        return out

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        out.block_tables.append(self.kv.block_table(seq.seq_id))

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            if not self._acquire_adapter(seq):
                skipped.append(seq)  # its adapter cannot get a slot yet; others may go
                continue
            cached, num_cached = self.kv.find_cached_prefix(seq.token_ids, seq.namespace)
            n = min(len(seq.token_ids) - num_cached, budget)
            need = self.kv.blocks_needed(seq.seq_id, num_cached, n, cached)
            if self.kv.num_free_blocks - need < self.watermark_blocks or not self.kv.allocate(
                seq.seq_id, num_cached, n, cached
            ):
                self._release_adapter(seq)
                self.waiting.appendleft(seq)
                break
            self._count_prefix(seq, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _count_prefix(self, seq: Sequence, num_cached: int) -> None:
        tenant = seq.request.tenant
        self.prefix_query_tokens[tenant] = self.prefix_query_tokens.get(tenant, 0) + len(seq.token_ids)
        self.prefix_hit_tokens[tenant] = self.prefix_hit_tokens.get(tenant, 0) + num_cached

    def _acquire_adapter(self, seq: Sequence) -> bool:
        name = seq.request.params.lora_name
        if not name:
            return True
        slot = self.adapters.acquire(name)
        if slot is None:
            return False
        seq.adapter_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.request.params.lora_name and seq.adapter_slot >= 0:
            self.adapters.release(seq.request.params.lora_name, slot=seq.adapter_slot)
        seq.adapter_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-mode preemption: drop its KV, back to the front of the queue."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the model ran ---------------------------------------------------------
    def update(self, batch: SchedulerOutput, result) -> list[Sequence]:
        """Append sampled tokens, check completion, free finished sequences; returns those that changed."""
        changed = []
        for i, seq in enumerate(batch.seqs):
            seq.num_computed_tokens += batch.num_new_tokens[i]
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.namespace)
            token = result.token_ids[i]
            if token is None:
                continue
            seq.token_ids.append(token)
            seq.cumulative_logprob += result.logprobs[i]
            if result.top_logprobs[i] is not None:
                seq.pending_logprobs.append(result.top_logprobs[i])
            reason = self._check_finished(seq, token)
            if reason is not None:
                self.remove(seq, reason)
            changed.append(seq)
        return changed

    def _check_finished(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.request.params
        stop = seq.detok.update(seq.token_ids)
        if seq.num_output_tokens >= params.min_tokens:
            if stop is not None or token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None
