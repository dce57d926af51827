"""Iteration-level scheduler: token budget, chunked prefill, prefix-cache hits, forks, preemption.

Each step (``schedule``): expire timed-out requests; give every running sequence its next
tokens within the step's token budget, decodes first, then prefill chunks, preempting a
victim when a block cannot be had; then, unless that step preempted, swap sequences back
in and admit waiting ones (policy order, KV watermark, adapter slots, admission cap).
``update`` applies the runner's tokens, forks n > 1 samples after their prefill, and
frees finished sequences' blocks before the next step admits. No tensors here.

The static-batching baseline the benchmarks compare against is a subclass
(``sched/static_batch.py``) over five hooks: ``_may_admit``, ``_release_ended_batch``, ``_end_schedule``,
``_make_room`` and ``_free_ended``; ``static_batch.make_scheduler`` picks the class for ``config.batching``.

Tenants (backend/sched/fair_share.py): with ``fair_share="vtc"`` the waiting queue admits the
backlogged tenant with the least virtual token counter; a tenant is charged its prompt at
a request's first admission (never again when a preempted sequence resumes) and each
generated token in ``update``. ``max_concurrent_requests`` counts sequences: a request's n
samples from its first admission until each ends (``_finish``, the one place sequences
end). A request starts only if all its samples fit under its tenant's limit; a tenant at
its limit, or whose next request does not fit, is blocked in the waiting queue.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from loraplex.sched.fair_share import ActiveRequests, VirtualTokenCounter
from loraplex.kv_cache.manager import KVCacheManager
from loraplex.kv_cache.swap_space import SwapSpace
from loraplex.sched.policies import VICTIM_POLICIES, admission_key
from loraplex.sched.preemption import AdmissionCap
from loraplex.engine.request import FinishReason, Sequence, SeqStatus
from loraplex.sched.waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerOutput:
    """Who runs this step, how many new tokens each, their block tables, and the block copies to make first.

    The runner copies in this order: ``swap_out`` (device -> host), ``copy_pairs``
    (copy-on-write), ``swap_in`` (host -> device), then runs the model. ``forks`` are
    (index in ``seqs``, child): the child is sampled from that sequence's last row.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended while scheduling (timeout; seq.error: failed)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue this step
    allocated: list[int] = field(default_factory=list)  # rows of seqs whose block table allocate may have changed
    num_padding: int = 0  # rows of ended sequences that a static batch still runs (static batching; never sampled)
    num_updates: int = 0  # the scheduler's updates applied before this step (one per step that ran)

    @property
    def empty(self) -> bool:
        """Nothing for the runner to do."""
        return not (self.seqs or self.swap_out or self.swap_in or self.copy_pairs)


class Scheduler:
    """Decides each step's batch; updates sequences with the runner's tokens. Touches no tensors."""

    def __init__(self, config, kv: KVCacheManager, adapters, eos_token_ids: set[int], max_model_len: int,
                 num_host_blocks: int = 0, clock: Callable[[], float] = time.monotonic):
        self.config, self.kv, self.adapters = config, kv, adapters
        self.eos_token_ids, self.max_model_len = frozenset(eos_token_ids), max_model_len
        self.clock = clock
        self.vtc = VirtualTokenCounter() if config.fair_share == "vtc" else None
        self.active = ActiveRequests()  # started requests per tenant (max_concurrent_requests)
        self.limits: dict[str, int] = {}  # tenant with work -> max_concurrent_requests its latest request carried
        self.waiting = WaitingQueue(admission_key(config.admission_policy, config.sjf_aging_rate), self.vtc)
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.swap_space = SwapSpace(num_host_blocks if config.preemption_mode == "swap" else 0)
        self.pick_victim = VICTIM_POLICIES[config.victim_policy]
        self.cap = AdmissionCap(config.max_num_seqs, config.preemption_window_steps, config.preemption_threshold)
        self.watermark_blocks = max(1, int(kv.num_blocks * config.kv_watermark))
        self.prefix_query_tokens: dict[str, int] = {}  # per tenant metric label
        self.prefix_hit_tokens: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_new_waiting = 0  # requests queued and never started (max_waiting_requests counts these)
        self._deadlines: list = []  # heap of (deadline, tie, sequences of one request)
        self._tie = itertools.count()
        self._preempted_now = 0
        self._fork_parents: list[Sequence] = []
        self.num_updates = 0  # update() calls completed: a runner knows whether the last step's tokens were applied
        # read_adapter(request) -> True when the engine reads the request's adapter off the loop thread (the
        # sequence waits meanwhile); None or False: acquire() reads it here (a caller stepping the engine itself)
        self.read_adapter: Callable | None = None

    def carry_counters(self, old: "Scheduler") -> None:
        """Continue the monotonic counters (metrics) of a scheduler this one replaces."""
        self.prefix_query_tokens, self.prefix_hit_tokens = old.prefix_query_tokens, old.prefix_hit_tokens
        self.num_preemptions, self.num_swapped_out = old.num_preemptions, old.num_swapped_out
        self.num_updates = old.num_updates

    # ---- admission and removal -------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request's first sequence (its other samples ride along in seq.forks)."""
        seq.status = SeqStatus.WAITING
        params = seq.request.params
        stop_length = min(seq.num_prompt_tokens + params.max_tokens, self.max_model_len)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        charge_key = (seq.request.tenant, _weight(seq.request))
        for s in (seq, *seq.forks):
            s.stop_length, s.stop_ids = stop_length, stop_ids  # update's cheap test for _finish_reason
            s.charge_key = charge_key
        for child in seq.forks:
            child.status, child.fork_parent = SeqStatus.FORK_PENDING, seq
        self.waiting.push(seq)
        self.num_new_waiting += 1
        limits, tenant = seq.request.limits, seq.request.tenant
        if limits is not None and limits.max_concurrent_requests:  # the latest request's limit applies
            self.limits[tenant] = limits.max_concurrent_requests
        else:
            self.limits.pop(tenant, None)
        self._apply_limit(tenant, self.active.counts.get(tenant, 0))
        timeout = seq.request.params.timeout or self.config.default_timeout
        if timeout:
            group = [seq, *seq.forks]
            heapq.heappush(self._deadlines, (seq.request.arrival_time + timeout, next(self._tie), group))

    def has_work(self) -> bool:
        """Any sequence waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence, reason: FinishReason) -> list[Sequence]:
        """End a sequence (and its unforked samples) from any state, freeing blocks and pins; returns those ended."""
        status = seq.status
        if status is SeqStatus.FINISHED:
            return []
        if status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
            self._release_ended_batch()
        elif status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            if seq.first_scheduled_time is None:
                self.num_new_waiting -= 1
        elif status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_space.release_later(seq.host_blocks)
            seq.host_blocks = []
        elif status is SeqStatus.FORK_PENDING:
            seq.fork_parent.forks.remove(seq)
        ended = [seq, *seq.forks]
        self._release_adapter(seq)  # its own pin and those of unforked samples
        self._finish(ended, reason)
        seq.forks = []
        if status is SeqStatus.WAITING:
            self._retire(seq.request.tenant)
        return ended

    def _finish(self, seqs: list[Sequence], reason: FinishReason) -> None:
        """Mark samples of one request FINISHED; its tenant's count of sequences drops by as many."""
        for s in seqs:
            s.status, s.finish_reason = SeqStatus.FINISHED, reason
        request = seqs[0].request
        left = self.active.finish(request, len(seqs))
        if left is not None:
            self._apply_limit(request.tenant, left)
            if not left:
                self._retire(request.tenant)

    def _fits_tenant(self, seq: Sequence) -> bool:
        """A new request's samples fit under its tenant's max_concurrent_requests (a tenant with none running: always)."""
        limit = self.limits.get(seq.request.tenant, 0)
        count = self.active.counts.get(seq.request.tenant, 0)
        return not limit or not count or count + 1 + len(seq.forks) <= limit

    def _apply_limit(self, tenant: str, count: int) -> None:
        """Block the tenant in the waiting queue while `count` is at its max_concurrent_requests."""
        limit = self.limits.get(tenant, 0)
        if limit and count >= limit:
            self.waiting.block(tenant)
        else:
            self.waiting.unblock(tenant)

    def _retire(self, tenant: str) -> None:
        """A tenant with nothing waiting and nothing started is idle: forget its limit; fair share may drop its counter."""
        if tenant not in self.active.counts and not self.waiting.has_tenant(tenant):
            self.limits.pop(tenant, None)
            if self.vtc is not None:
                self.vtc.retire(tenant, self.waiting.level())

    def check_tenants(self) -> None:
        """Raise unless per-tenant state equals what the sequences held imply, recomputed from scratch (tests)."""
        samples: dict[int, list] = {}
        for seq in [*self.running, *self.swapped, *(s for s in self.waiting if s.num_preemptions)]:
            record = samples.setdefault(id(seq.request), [seq.request, 0])
            record[1] += 1 + len(seq.forks)
        self.active.check(samples)
        self.waiting.check()
        if self.vtc is not None:
            waiting = {s.request.tenant for s in self.waiting}
            for tenant in self.vtc.counters:
                busy = tenant in self.active.counts or tenant in waiting
                assert busy != self.vtc.is_idle(tenant), (tenant, busy)
            assert waiting <= set(self.vtc.counters) and set(self.active.counts) <= set(self.vtc.counters)
        assert set(self.limits) <= set(self.active.counts) | {s.request.tenant for s in self.waiting}

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step: expire, run (preempting if needed), then swap in and admit unless that preempted."""
        out = SchedulerOutput(num_updates=self.num_updates)
        self.swap_space.flush()
        self._release_ended_batch()  # one that ended without an update (its last sequence preempted)
        if self._deadlines:
            out.finished = self._expire()
        self._preempted_now = 0
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not self._preempted_now:
            budget = self._swap_in(out, budget)
            if not self.swapped and self._may_admit():
                self._admit(out, budget)
        self._end_schedule(out)
        self.cap.record(self._preempted_now, len(self.running))
        if self._fork_parents:
            index = {s.seq_id: i for i, s in enumerate(out.seqs)}
            out.forks = [(index[p.seq_id], child) for p in self._fork_parents for child in p.forks]
            self._fork_parents = []
        out.copy_pairs = self.kv.take_copy_pairs()
        return out

    # ---- hooks (continuous batching; sched/static_batch.py overrides them) ---------------
    def _release_ended_batch(self) -> None:
        """A batch's last running sequence ended: free what it still holds (static batching's padding)."""

    def _may_admit(self) -> bool:
        """Whether waiting sequences may join the batch this step."""
        return True

    def _end_schedule(self, out: SchedulerOutput) -> None:
        """After the step's sequences are planned: add what else it runs."""

    def _make_room(self) -> bool:
        """Free blocks without preempting anyone; True if some were freed."""
        return False

    def _free_ended(self, seq: Sequence) -> None:
        """A sequence ended: free its blocks and its adapter pin."""
        self.kv.free(seq.seq_id)
        self._release_adapter_of(seq)

    def _expire(self) -> list[Sequence]:
        now = self.clock()
        ended: list[Sequence] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            for seq in heapq.heappop(self._deadlines)[2]:
                ended += self.remove(seq, FinishReason.TIMEOUT)
        return ended

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first, then prefill chunks, each in running order; a block shortage preempts a victim.

        One pass over the running sequences: a decode whose token lands in a block it holds
        alone (most of them) is emitted right there, without an allocation.
        """
        running_status, held = SeqStatus.RUNNING, self.kv.held_table
        seqs, counts, tables = out.seqs, out.num_new_tokens, out.block_tables
        windowed = self.kv.window is not None
        prefills = []
        for seq in tuple(self.running):  # preemption changes the list
            computed = seq.num_computed_tokens
            # window: blocks its next queries cannot read go back before anything is allocated
            freed = windowed and seq.status is running_status and self.kv.free_skipped(seq.seq_id, computed)
            if len(seq.token_ids) - computed != 1:
                prefills.append(seq)
            elif budget > 0 and seq.status is running_status:
                table = None if seq.forks else held(seq.seq_id, computed)
                if table is None:
                    budget = self._run(out, seq, 1, budget)
                else:
                    seqs.append(seq)
                    counts.append(1)
                    tables.append(table)
                    if freed:  # the runner reads its table row again (a repeated decode keeps the old one)
                        out.allocated.append(len(seqs) - 1)
                    budget -= 1
        for seq in prefills:
            if budget <= 0:
                break
            if seq.status is running_status:
                budget = self._run(out, seq, min(len(seq.token_ids) - seq.num_computed_tokens, budget), budget)
        return budget

    def _run(self, out: SchedulerOutput, seq: Sequence, n: int, budget: int) -> int:
        """Blocks for the seq's n new tokens, preempting victims while short, then emit it; returns the budget left."""
        while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens, n):
            if self._make_room():
                continue
            victim = self.pick_victim(self.running)
            budget += self._preempt(victim, out)
            if victim is seq:
                return budget
        self._emit(out, seq, n)
        out.allocated.append(len(out.seqs) - 1)
        return budget - n

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped-out sequences back, oldest first, while blocks, budget, slots and the cap allow."""
        kv = self.kv
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            if not self._fits_cap(seq):
                break
            n = min(seq.num_tokens_to_compute, budget)
            if kv.num_free_blocks - kv.blocks_to_resume(seq.num_computed_tokens, n) < self.watermark_blocks:
                break
            if self._awaiting_read(seq):
                break
            if not self._acquire_adapter(seq):
                if seq.error is None:
                    break
                out.finished += self.remove(seq, FinishReason.ABORT)  # its adapter broke: fail it alone
                continue
            self.swapped.popleft()
            out.swap_in += zip(seq.host_blocks, kv.resume(seq.seq_id, seq.num_computed_tokens), strict=True)
            self.swap_space.release_later(seq.host_blocks)
            seq.host_blocks = []
            if not kv.allocate(seq.seq_id, seq.num_computed_tokens, n):
                raise AssertionError("swap-in allocation failed after the free-block check")
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, n)
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in queue order; stop at the first that does not fit (KV, cap, budget).

        With ``adapter_admission="resident_first"`` a sequence whose adapter would take another
        adapter's slot (not resident, no slot free) is passed over in a first pass, so that those
        whose adapters are resident go first; the passed-over ones are tried in order after it
        (they may evict then). A sequence is passed over at most ``max_adapter_wait_steps``
        steps or ``max_adapter_wait_seconds`` after its arrival; then it goes in policy order.
        """
        popped: list[Sequence] = []  # taken from the queue and not admitted: put back, whatever happens
        deferred: list[Sequence] = []
        aware = self.config.adapter_admission == "resident_first"
        try:
            stopped = False
            while budget > 0:
                seq = self.waiting.take()
                if seq is None:
                    break
                popped.append(seq)
                if aware and self._defer(seq):
                    seq.adapter_skips += 1
                    deferred.append(seq)
                    if len(deferred) >= max(64, 2 * self.config.max_num_seqs):
                        break  # bounded work per step: the rest wait where they are
                    continue
                admitted, budget = self._admit_one(seq, out, budget, popped)
                if admitted is None:
                    stopped = True
                    break
            for seq in deferred if not stopped else ():
                if budget <= 0:
                    break
                admitted, budget = self._admit_one(seq, out, budget, popped, counted=True)
                if admitted is None:
                    break
        finally:
            if popped:
                self.waiting.unpop(popped)

    def _defer(self, seq: Sequence) -> bool:
        """Pass the sequence over this pass: its adapter would evict another's, and it has not waited too long."""
        name = seq.request.adapter_key
        if not name or seq.num_preemptions or seq.adapter_skips >= self.config.max_adapter_wait_steps:
            return False
        if self.clock() - seq.request.arrival_time >= self.config.max_adapter_wait_seconds:
            return False
        return self.adapters.would_evict(name)

    def _admit_one(self, seq: Sequence, out: SchedulerOutput, budget: int, popped: list[Sequence],
                   counted: bool = False) -> tuple[bool | None, int]:
        """Try to admit one popped sequence: (True admitted, False passed over, None stop admitting; budget left).

        ``counted``: its adapter_skips already counts this step.
        """
        if not self._fits_cap(seq) or (seq.suspect and out.admitted):
            return None, budget  # a suspect runs as the only newcomer of its step, so a failure convicts it alone
        if not seq.num_preemptions and not self._fits_tenant(seq):
            self.waiting.block(seq.request.tenant)  # put back by unpop; unblocked as its samples end
            return False, budget
        if self._awaiting_read(seq):
            return False, budget  # its adapter is being read off the loop: it waits, others go
        if not self._acquire_adapter(seq):
            if seq.error is not None:  # its adapter broke since it was queued: fail it alone
                self._fail_popped(seq, popped, out)
                return False, budget
            if not counted:
                seq.adapter_skips += 1  # every slot pinned by other adapters: let others go, up to a bound
            if seq.adapter_skips > self.config.max_adapter_wait_steps:
                return None, budget  # waited long enough: nothing behind it is admitted until it gets a slot
            return False, budget
        kv = self.kv
        try:
            fits, num_cached, n = self._allocate_prefill(seq, budget)
        except Exception as exc:  # noqa: BLE001 - a lookup that raises fails this request, not the step
            kv.free(seq.seq_id)
            seq.error = exc
            self._fail_popped(seq, popped, out)
            return False, budget
        if not fits:
            self._release_adapter(seq)
            return None, budget
        popped.remove(seq)
        out.admitted.append(seq)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
            self.num_new_waiting -= 1
            self._count_prefix(seq, num_cached)
            if self.vtc is not None:  # the prompt is charged once: a resumed or retried one is not
                self.vtc.admit(seq.request.tenant, len(seq.token_ids), _weight(seq.request))
        if not seq.num_preemptions:  # from the new-sequence heaps: a request starts counting
            self._apply_limit(seq.request.tenant, self.active.start(seq.request, 1 + len(seq.forks)))
        seq.num_computed_tokens = num_cached
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._emit(out, seq, n)
        budget -= n
        return (None if seq.suspect else True), budget

    def _awaiting_read(self, seq: Sequence) -> bool:
        """The adapter is neither in host memory nor in a slot and ``read_adapter`` reads it off the loop thread."""
        name = seq.request.adapter_key
        if not name or self.read_adapter is None or self.adapters.needs_read(name) is None:
            return False
        return self.read_adapter(seq.request)

    def _fail_popped(self, seq: Sequence, popped: list[Sequence], out: SchedulerOutput) -> None:
        """End a sequence popped for admission (seq.error says why), its pins released."""
        popped.remove(seq)
        self.waiting.unpop([seq])  # remove() takes it out of the queue, as from any waiting state
        out.finished += self.remove(seq, FinishReason.ABORT)

    def _allocate_prefill(self, seq: Sequence, budget: int) -> tuple[bool, int, int]:
        """Prefix-cache lookup and blocks for the first chunk: (fits, cached tokens, new tokens)."""
        kv = self.kv
        cached, num_cached = kv.find_cached_prefix(seq.token_ids, seq.namespace)
        n = min(len(seq.token_ids) - num_cached, budget)
        need = kv.blocks_needed(seq.seq_id, num_cached, n, cached)
        fits = kv.num_free_blocks - need >= self.watermark_blocks and kv.allocate(seq.seq_id, num_cached, n, cached)
        return fits, num_cached, n

    def withdraw(self, out: SchedulerOutput, seqs: list[Sequence]) -> None:
        """Take sequences admitted this step back out of its batch, to the waiting queue, marked suspect."""
        gone = {s.seq_id for s in seqs}
        parents = [(out.seqs[i], child) for i, child in out.forks]
        for seq in seqs:
            self._unemit(out, seq)
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
            self._release_adapter(seq)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            seq.suspect = True
            if not seq.num_preemptions:  # back among new sequences: it counts again when admitted again
                self._apply_limit(seq.request.tenant, self.active.cancel(seq.request))
        self.waiting.unpop(seqs)
        index = {s.seq_id: i for i, s in enumerate(out.seqs)}
        out.forks = [(index[p.seq_id], child) for p, child in parents if p.seq_id not in gone]
        out.admitted = [s for s in out.admitted if s.seq_id not in gone]

    def _fits_cap(self, seq: Sequence) -> bool:
        """Room under max_num_seqs and the admission cap for the seq and its unforked samples (an empty batch has room)."""
        if not self.running:
            return True
        return len(self.running) + 1 + len(seq.forks) <= min(self.config.max_num_seqs, self.cap.value)

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        out.block_tables.append(self.kv.block_table(seq.seq_id))
        if seq.forks and n == seq.num_tokens_to_compute:
            self._fork_parents.append(seq)  # prefill ends this step: sample the others from its logits

    def _unemit(self, out: SchedulerOutput, seq: Sequence) -> int:
        """Take a sequence back out of this step's batch; returns the tokens it had been given."""
        for i, s in enumerate(out.seqs):
            if s is seq:
                del out.seqs[i], out.block_tables[i]
                if seq in self._fork_parents:
                    self._fork_parents.remove(seq)
                return out.num_new_tokens.pop(i)
        return 0

    def _count_prefix(self, seq: Sequence, num_cached: int) -> None:
        label = seq.request.metric_label  # bounded: not one key per tenant name a client invents
        self.prefix_query_tokens[label] = self.prefix_query_tokens.get(label, 0) + len(seq.token_ids)
        self.prefix_hit_tokens[label] = self.prefix_hit_tokens.get(label, 0) + num_cached

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """Pin the adapter once for the seq and once for each unforked sample; all or nothing.

        False when every slot is pinned by other adapters, or when loading the adapter
        failed (it changed or broke on disk since the request was queued): then seq.error says why.
        """
        name = seq.request.adapter_key
        if not name:
            return True
        group = [seq, *seq.forks]
        for i, s in enumerate(group):
            try:
                slot = self.adapters.acquire(name)
            except Exception as exc:  # noqa: BLE001 - any load failure fails this request, not the step
                seq.error, slot = exc, None
            if slot is None:
                for t in group[:i]:
                    self._release_adapter_of(t)
                return False
            s.adapter_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        self._release_adapter_of(seq)
        for child in seq.forks:
            self._release_adapter_of(child)

    def _release_adapter_of(self, seq: Sequence) -> None:
        if seq.request.adapter_key and seq.adapter_slot >= 0:
            self.adapters.release(seq.request.adapter_key, slot=seq.adapter_slot)
        seq.adapter_slot = -1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Swap the seq out (swap mode, if the host pool has room) or drop its KV; returns budget it gave back."""
        refund = self._unemit(out, seq)
        self.running.remove(seq)
        kv = self.kv
        computed = seq.num_computed_tokens
        blocks = -(-computed // kv.block_size) - kv.skipped_blocks(computed)  # with a window: those it still reads
        if self.swap_space.num_blocks and computed and blocks <= self.swap_space.num_free:
            host = self.swap_space.take(blocks)
            out.swap_out += zip(kv.source_blocks(seq.seq_id, computed), host, strict=True)
            seq.host_blocks = host
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swapped_out += 1
        else:
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            self.waiting.push_front(seq)
        kv.free(seq.seq_id)
        self._release_adapter(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_now += 1
        return refund

    # ---- after the model ran ---------------------------------------------------------
    def update(self, batch: SchedulerOutput, result) -> list[Sequence]:
        """Append sampled tokens, fork samples, check completion, free finished sequences; returns the changed ones.

        The hot loop of a step: per sequence a few list and attribute operations; a block's
        prefix hash only when the step filled it, a finish reason only when the sequence's
        length or token says it may have one; fair-share charges counted in C (a Counter
        over each sequence's charge key) and charged once per tenant.
        """
        changed: list[Sequence] = []
        kv, bs = self.kv, self.kv.block_size
        caching = kv.enable_prefix_caching
        tokens, logprobs, tops = result.token_ids, result.logprobs, result.top_logprobs
        maybe_done: list[tuple[Sequence, int]] = []  # (seq, token) that may have finished: ended after the charges
        finished_status, counts, seqs = SeqStatus.FINISHED, batch.num_new_tokens, batch.seqs
        # A decode step without forks (most steps) takes every row's token in the one loop below; any other
        # step first advances each sequence here and lists its samples (sample, row), fork children first.
        decode = not batch.forks and len(seqs) == len(tokens) and sum(counts) == len(seqs) and None not in tokens
        sampled = zip(seqs, range(len(seqs))) if decode else self._advance(batch, tokens)
        for seq, row in sampled:  # append each token, count it, note whether it may end the sequence
            if decode:
                if seq.status is finished_status:  # its request failed after the forward (e.g. bad logits)
                    continue
                computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
                if caching and computed % bs == 0:  # this step filled a block
                    kv.cache_full_blocks(seq.seq_id, seq.token_ids, computed, seq.namespace)
            token, ids = tokens[row], seq.token_ids
            ids.append(token)
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[row]
                if tops[row] is not None:
                    seq.pending_logprobs.append(tops[row])
            if len(ids) >= seq.stop_length or token in seq.stop_ids:
                maybe_done.append((seq, token))
            changed.append(seq)
        if self.vtc is not None:  # before any end: a tenant's last request retiring it must see its tokens charged
            for (tenant, weight), count in Counter(map(_CHARGE_KEY, changed)).items():
                self.vtc.charge(tenant, count, weight)
        finished = False
        for seq, token in maybe_done:
            try:
                finished |= seq.error is None and self._end_if_finished(seq, token)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the step
                seq.error = exc
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
            self._release_ended_batch()
        self.num_updates += 1
        return changed

    def _advance(self, batch: SchedulerOutput, tokens: list) -> list[tuple[Sequence, int]]:
        """Count each sequence's computed tokens (caching the blocks it filled) and fork samples after a prefill;
        returns the samples that got a token, (sample, its row of the result), fork children first."""
        forks_at: dict[int, list] = {}
        base = len(batch.seqs)
        for j, (i, child) in enumerate(batch.forks):
            forks_at.setdefault(i, []).append((base + j, child))
        kv, bs = self.kv, self.kv.block_size
        caching = kv.enable_prefix_caching
        sampled: list[tuple[Sequence, int]] = []
        for i, seq in enumerate(batch.seqs):
            if seq.status is SeqStatus.FINISHED:  # its request failed after the forward (e.g. bad logits)
                continue
            n = batch.num_new_tokens[i]
            computed = seq.num_computed_tokens + n
            seq.num_computed_tokens = computed
            if caching and computed % bs < n:  # this step filled a block
                kv.cache_full_blocks(seq.seq_id, seq.token_ids, computed, seq.namespace)
            if tokens[i] is None:
                continue
            if forks_at and i in forks_at:
                try:
                    for row, child in forks_at[i]:
                        self._fork(seq, child)
                        sampled.append((child, row))
                    seq.forks = []
                except Exception as exc:  # noqa: BLE001 - a fork failed: fail this request, not the step
                    seq.error = exc
            sampled.append((seq, i))
        return sampled

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks (the partly filled last one too) and takes its pin already held."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.fork_parent = None
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def _end_if_finished(self, seq: Sequence, token: int) -> bool:
        """End the sequence if the token finished it (freeing its blocks and pin); True if it did."""
        reason = self._finish_reason(seq, token)
        if reason is None:
            return False
        self._free_ended(seq)
        self._finish([seq], reason)
        return True

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """EOS, stop tokens and lengths; stop strings are the output processor's (it ends the sequence)."""
        params = seq.request.params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None


_CHARGE_KEY = attrgetter("charge_key")


def _weight(request) -> float:
    """The tenant's fair-share weight (1 without limits)."""
    limits = request.limits
    return limits.weight if limits is not None else 1.0
