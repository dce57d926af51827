"""A Scheduler without a model, for exact scheduling tests.

``FakeRunner`` keeps a model of what every KV slot holds: (namespace, every token up to
and including that position), which is what real K/V depend on. Each step it applies the
step's block copies in the runner's order (swap out, copy-on-write, swap in),
writes the new slots (never one slot twice in a step), asserts that every slot each
scheduled sequence attends to holds that sequence's own history, and samples a token that is a
deterministic function of the sequence's tokens and sample index. So a wrong prefix hit,
a missed or misordered copy, or a lost swap fails the step, and every sequence's output
must equal ``reference_tokens``.

With a ``window`` W the runner reads, as windowed attention does, only the slots of keys
p - W < k <= p for each query p; a slot outside it may hold anything, and no slot read or
written may be the manager's null block.

Per tenant it records the served tokens (``served``: a request's prompt when it is first
admitted, each generated token as it is reported: what fair share charges before weights)
and checks the scheduler's per-tenant counts against a recount after every step.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from loraplex.config import EngineConfig
from loraplex.kv_cache import KVCacheManager, namespace_key
from loraplex.worker.model_runner import RunnerOutput
from loraplex.engine.request import Request, SamplingParams, Sequence, SeqStatus
from loraplex.sched.static_batch import make_scheduler
from loraplex.tenancy.tenants import Tenant

EOS = 2


def next_token(tokens: list[int], index: int) -> int:
    """The fake model: a deterministic token (never EOS) from the history and the sample index."""
    h = index * 7919
    for t in tokens[-8:]:
        h = (h * 131 + t) % 1_000_003
    return 3 + (h + len(tokens)) % 97


def reference_tokens(prompt: list[int], max_tokens: int, index: int = 0) -> list[int]:
    """What sample `index` of a prompt must generate."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, index))
    return tokens[len(prompt):]


class FakeAdapters:
    """Device slots with pins and LRU eviction of unpinned adapters (AdapterManager's acquire/release contract)."""

    def __init__(self, num_slots: int = 2) -> None:
        self.num_slots = num_slots
        self.resident: OrderedDict[str, list[int]] = OrderedDict()  # name -> [slot, pins]
        self.loads: list[str] = []
        self.broken: set[str] = set()  # acquire() raises for these (re-read from disk and found broken)
        self.unread: set[str] = set()  # needs_read() names a folder for these (neither in host memory nor a slot)

    def acquire(self, name: str) -> int | None:
        if name in self.broken:
            raise ValueError(f"adapter {name!r} is broken on disk")
        rec = self.resident.get(name)
        if rec is not None:
            rec[1] += 1
            self.resident.move_to_end(name)
            return rec[0]
        used = {r[0] for r in self.resident.values()}
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((n for n, r in self.resident.items() if r[1] == 0), None)
            if victim is None:
                return None
            slot = self.resident.pop(victim)[0]
        self.resident[name] = [slot, 1]
        self.loads.append(name)
        return slot

    def would_evict(self, name: str) -> bool:
        return name not in self.resident and len(self.resident) >= self.num_slots

    def needs_read(self, name: str) -> str | None:
        return f"/adapters/{name}" if name in self.unread else None

    def release(self, name: str, slot: int | None = None) -> None:
        rec = self.resident[name]
        assert rec[1] > 0 and (slot is None or slot == rec[0]), (name, slot, rec)
        rec[1] -= 1

    def total_pins(self) -> int:
        return sum(r[1] for r in self.resident.values())


class FakeRunner:
    """Block copies and KV writes on a model of slot contents; checks what each sequence reads."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int, window: int | None = None,
                 null_block: int | None = None) -> None:
        self.bs = block_size
        self.window, self.null_block = window, null_block
        self.content = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]

    def execute(self, batch) -> RunnerOutput:
        bs = self.bs
        for dev, host in batch.swap_out:
            self.host[host] = list(self.content[dev])
        for src, dst in batch.copy_pairs:
            self.content[dst] = list(self.content[src])
        for host, dev in batch.swap_in:
            self.content[dev] = list(self.host[host])
        written = set()
        rows = len(batch.seqs) + len(batch.forks)
        out = RunnerOutput([None] * rows, [None] * rows, [None] * rows)
        for i, (seq, n, table) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.block_tables)):
            start = seq.num_computed_tokens
            for p in range(start, start + n):
                slot = (table[p // bs], p % bs)
                assert slot[0] != self.null_block, f"seq {seq.seq_id} writes position {p} into the null block"
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.content[slot[0]][slot[1]] = (seq.namespace, tuple(seq.token_ids[: p + 1]))
        for i, (seq, n, table) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.block_tables)):
            start = seq.num_computed_tokens
            assert len(table) * bs >= start + n, "block table too short"
            first = max(0, start - self.window + 1) if self.window else 0  # the first query's first key
            for p in range(first, start + n):  # what attention reads, after every write of the step
                assert table[p // bs] != self.null_block, f"seq {seq.seq_id} reads position {p} from the null block"
                held = self.content[table[p // bs]][p % bs]
                assert held == (seq.namespace, tuple(seq.token_ids[: p + 1])), f"seq {seq.seq_id} reads wrong KV at {p}"
            if start + n == len(seq.token_ids):
                out.token_ids[i], out.logprobs[i] = next_token(seq.token_ids, seq.index), -1.0
        for j, (i, child) in enumerate(batch.forks):
            parent = batch.seqs[i]
            assert out.token_ids[i] is not None, "fork from a sequence that did not finish its prefill"
            out.token_ids[len(batch.seqs) + j] = next_token(parent.token_ids, child.index)
            out.logprobs[len(batch.seqs) + j] = -1.0
        return out


class Harness:
    """Scheduler + KV manager + fake adapters + fake runner + a settable clock."""

    def __init__(self, num_blocks: int = 16, block_size: int = 4, num_host_blocks: int = 0, adapter_slots: int = 2,
                 window: int | None = None, **config) -> None:
        config.setdefault("max_num_batched_tokens", 64)
        self.config = EngineConfig(block_size=block_size, **config)
        self.kv = KVCacheManager(num_blocks, block_size, self.config.enable_prefix_caching, window)
        self.adapters = FakeAdapters(adapter_slots)
        self.now = 0.0
        self.sched = make_scheduler(self.config, self.kv, self.adapters, {EOS}, 100_000,
                                    num_host_blocks=num_host_blocks, clock=lambda: self.now)
        self.runner = FakeRunner(num_blocks, block_size, num_host_blocks, window, self.kv.null_block)
        self._ids = itertools.count()
        self._tokens = itertools.count(1000)
        self.requests: dict[str, list[Sequence]] = {}
        self.streamed: dict[tuple[str, int], list[int]] = {}  # (request, index) -> tokens as reported
        self.finals: dict[tuple[str, int], int] = {}
        self.reasons: dict[tuple[str, int], str] = {}
        self.batches = []
        self.tenants: dict[str, Tenant] = {}  # limits given with add(weight=..., max_concurrent=...)
        self.served: dict[str, int] = {}  # tenant -> prompt tokens at first admission + generated tokens
        self.started: list[str] = []  # request ids in the order they were first admitted
        self._started: set[str] = set()

    def add(self, rid: str, prompt: int | list[int] = 6, max_tokens: int = 4, n: int = 1, priority: int = 0,
            lora: str | None = None, tenant: str = "t", arrival: float | None = None, timeout: float | None = None,
            weight: float | None = None, max_concurrent: int | None = None) -> list[Sequence]:
        """Queue a request; an int prompt becomes that many fresh tokens (no accidental prefix hits).

        ``weight`` / ``max_concurrent`` give the tenant limits (kept for its later requests);
        a tenant never given any has none (``Request.limits`` None: weight 1, no quotas).
        """
        if weight is not None or max_concurrent is not None:
            old = self.tenants.get(tenant)
            self.tenants[tenant] = Tenant(
                tenant, b"", weight=weight if weight is not None else (old.weight if old else 1),
                max_concurrent_requests=max_concurrent if max_concurrent is not None else
                (old.max_concurrent_requests if old else 0))
        tokens = [next(self._tokens) for _ in range(prompt)] if isinstance(prompt, int) else list(prompt)
        params = SamplingParams(max_tokens=max_tokens, n=n, priority=priority, lora_name=lora, timeout=timeout,
                                ignore_eos=True)
        req = Request(rid, "", tokens, params, tenant, arrival_time=self.now if arrival is None else arrival,
                      adapter_key=lora, limits=self.tenants.get(tenant), metric_label=tenant)
        seqs = []
        for index in range(n):
            seq = Sequence(next(self._ids), req, index, list(tokens), len(tokens))
            seq.namespace = namespace_key(tenant, lora)
            seqs.append(seq)
        seqs[0].forks = seqs[1:]
        self.sched.add(seqs[0])
        self.requests[rid] = seqs
        return seqs

    def step(self):
        """One engine step; records what would be streamed; returns the SchedulerOutput."""
        batch = self.sched.schedule()
        self.batches.append(batch)
        if self.kv.window is not None:
            self._check_window(batch)
        for seq in batch.admitted:
            rid = seq.request.request_id
            if seq.index == 0 and rid not in self._started:
                self._started.add(rid)
                self.started.append(rid)
                tenant = seq.request.tenant
                self.served[tenant] = self.served.get(tenant, 0) + seq.num_prompt_tokens
        for seq in batch.finished:
            self._report(seq)
        if not batch.empty:
            result = self.runner.execute(batch)
            for seq in self.sched.update(batch, result):
                self._report(seq)
        self.kv.check_invariants()
        self.sched.swap_space.check()
        self.sched.check_tenants()
        return batch

    def _check_window(self, batch) -> None:
        """Each sequence the step runs gave back every block its queries cannot read, and holds no more than
        ``max_blocks_held`` allows for its request (what the engine admits it by)."""
        kv, padding = self.kv, set(map(id, getattr(self.sched, "padding", ())))
        for seq in batch.seqs:
            if id(seq) in padding:
                continue
            table, skipped = kv.block_table(seq.seq_id), kv._skipped[seq.seq_id]
            assert skipped == kv.skipped_blocks(seq.num_computed_tokens), (seq.seq_id, skipped)
            bound = kv.max_blocks_held(seq.num_prompt_tokens + seq.request.params.max_tokens,
                                       self.config.max_num_batched_tokens)
            assert len(table) - skipped <= bound, f"seq {seq.seq_id} holds {len(table) - skipped} > {bound} blocks"

    def run(self, max_steps: int = 10_000) -> int:
        """Step until idle; returns the number of steps."""
        for steps in range(max_steps):
            if not self.sched.has_work():
                return steps
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def _report(self, seq: Sequence) -> None:
        key = (seq.request.request_id, seq.index)
        streamed = self.streamed.setdefault(key, [])
        new = seq.output_token_ids[len(streamed):]
        tenant = seq.request.tenant
        self.served[tenant] = self.served.get(tenant, 0) + len(new)
        streamed.extend(new)
        if seq.status is SeqStatus.FINISHED:
            self.finals[key] = self.finals.get(key, 0) + 1
            self.reasons[key] = seq.finish_reason.value

    def expected(self, rid: str, index: int = 0) -> list[int]:
        """The reference output of one sample."""
        seq = self.requests[rid][index]
        return reference_tokens(seq.request.prompt_token_ids, seq.request.params.max_tokens, index)

    def assert_idle_and_clean(self) -> None:
        """Everything finished once, every block and host block free, no adapter pinned."""
        assert not self.sched.has_work()
        assert self.kv.usage()["used"] == 0 and self.kv.num_free_blocks == self.kv.num_usable_blocks
        self.sched.swap_space.flush()
        assert self.sched.swap_space.num_free == self.sched.swap_space.num_blocks
        assert self.adapters.total_pins() == 0
        assert self.sched.num_new_waiting == 0
        assert not self.sched.active.counts
        for rid, seqs in self.requests.items():
            for seq in seqs:
                assert seq.status is SeqStatus.FINISHED, (rid, seq.index, seq.status)
                assert self.finals.get((rid, seq.index)) == 1, (rid, seq.index)
