"""Routing N replicas x M adapters, simulated on measured costs: round robin, ring hash, the inference extension's picker.

    python benchmarks/routing_sim.py [--costs benchmarks/data/routing_costs.json] [--replicas 8] [--adapters 2000]
        [--alpha 1.0] [--rate R | --knee] [--json PATH]

A discrete-event simulation of a fleet of Loraplex replicas behind one router. Its costs are
not constants here: they are read from the file routing_costs.py writes from the engine
(step seconds by batch size and distinct adapters, prefill seconds per token, slot-load and
disk-read seconds by rank) and so is each replica's shape (device slots, host tier, running
sequences, token budget, KV blocks).

Requests arrive as a Poisson process (prompt lengths uniform within +-50% of the mean, output
lengths exponential around theirs); each names one of M adapters drawn by Zipf(alpha)
popularity over a seeded shuffle (ranks 8/16/32/64 mixed), and each adapter belongs to one
of T tenants (seeded, uniform). A replica is the engine's scheduler in small: a FCFS waiting
queue; each step admits in order while sequences, token budget and KV allow; a request whose
adapter is in neither host memory nor a slot waits for the replica's one reader thread
(disk-read seconds) and lets the others pass; a request whose adapter has no slot (every
slot pinned) is passed over up to max_adapter_wait_steps, then blocks the queue; a slot load
adds its seconds to the step that makes it; KV blocks run out -> the newest sequence is
preempted (recompute). A step lasts step(batch, distinct adapters) + prefill tokens x
seconds per token + its slot loads; the step that ends a prompt's prefill gives its first token.

Policies (the router in front of the replicas):
- round_robin: each request to the next replica;
- least_request: Envoy's LEAST_REQUEST (two random replicas, the one with fewer active requests);
- ring_tenant: Envoy's RING_HASH on the tenant (today's deploy/k8s), with bounded loads
  (hash_balance_factor 200: a host holding more than 2x the average of active requests
  passes the request on, probing hosts in an order seeded by the hash, as Envoy does);
- ring_adapter: the same ring, hashed on the adapter's name; `ring_tenant:125` (any ring policy with
  `:<factor>`) runs it with that hash_balance_factor instead of --balance-factor's;
- epp_default: the endpoint picker's default scorers that read model-server metrics
  (queue-scorer weight 2, kv-cache-utilization-scorer weight 2; the prefix-cache scorer's
  weight 3 is left out: the simulated prompts share no prefixes, so it scores 0 everywhere);
- lora_affinity: epp_default plus lora-affinity-scorer (weight 1, the loader's default):
  1.0 where the adapter is running, 0.8 where running + waiting adapters < max_lora, 0.6
  where it is waiting, else 0. The picker sees each replica's metrics as of the last
  snapshot, taken every --scrape-interval (100 ms: the picker's refresh-metrics-interval of
  50 ms after the replica's publisher, which hands over values at most every 50 ms under
  load); max-score picker, ties broken at random.

Figures per policy: TTFT p50/p99 (requests after the first 10% of arrivals), throughput
(output tokens / seconds from the first arrival to the last token), device-slot loads and
disk reads per request. --knee finds the rate at which ring_tenant's TTFT p99 is 2 s
(bisection) and runs every policy there.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import hashlib
import heapq
import itertools
import json
import math
import random
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COSTS = ROOT / "benchmarks" / "data" / "routing_costs.json"
POLICIES = ("round_robin", "least_request", "ring_tenant", "ring_adapter", "epp_default", "lora_affinity")
RANKS = (8, 16, 32, 64)
WARMUP_SHARE = 0.1  # requests arriving first that the percentiles leave out


# ---- costs ----------------------------------------------------------------------------------

class Costs:
    """The measured costs: step seconds interpolated over (batch, distinct adapters), loads by rank."""

    def __init__(self, data: dict):
        rows: dict[int, dict[int, float]] = {}
        for cell in data["step_seconds"]:
            rows.setdefault(int(cell["batch"]), {})[int(cell["adapters"])] = float(cell["seconds"])
        if not rows:
            raise ValueError("routing costs: no step_seconds")
        self.batches = sorted(rows)
        # A step is never cheaper with more sequences or more adapters: medians of a noisy machine are
        # made monotone (running maximum) along both axes before interpolating.
        previous: dict[int, float] = {}
        self.rows: dict[int, list[tuple[int, float]]] = {}
        for b in self.batches:
            cells, best = [], 0.0
            for a in sorted(rows[b]):
                best = max(best, rows[b][a], previous.get(a, 0.0))
                cells.append((a, best))
            self.rows[b] = cells
            previous = dict(cells)
        self.prefill_per_token = float(data.get("prefill_seconds_per_token", 0.0))
        self.slot_load = {int(r): float(s) for r, s in data["slot_load_seconds"].items()}
        self.disk_read = {int(r): float(s) for r, s in data["disk_read_seconds"].items()}
        if not self.slot_load or not self.disk_read:
            raise ValueError("routing costs: slot_load_seconds and disk_read_seconds need at least one rank")
        self.engine = dict(data.get("engine", {}))
        self._cache: dict[tuple[int, int], float] = {}

    @classmethod
    def load(cls, path: str | Path) -> "Costs":
        return cls(json.loads(Path(path).read_text()))

    def scaled(self, factor: float) -> "Costs":
        """A what-if: step and prefill seconds times ``factor`` (slot loads and disk reads as measured)."""
        if factor != 1.0:
            self.rows = {b: [(a, s * factor) for a, s in cells] for b, cells in self.rows.items()}
            self.prefill_per_token *= factor
            self._cache.clear()
        return self

    def _row(self, b: int, adapters: int) -> float:
        cells = self.rows[b]
        adapters = min(adapters, cells[-1][0])
        i = bisect.bisect_left([a for a, _ in cells], adapters)
        if cells[i][0] == adapters or i == 0:
            return cells[i][1]
        (a0, s0), (a1, s1) = cells[i - 1], cells[i]
        return s0 + (s1 - s0) * (adapters - a0) / (a1 - a0)

    def step(self, batch: int, adapters: int) -> float:
        """Seconds of a decode step of ``batch`` sequences over ``adapters`` distinct adapters."""
        key = (batch, adapters)
        if key in self._cache:
            return self._cache[key]
        bs = self.batches
        if batch <= bs[0]:
            value = self._row(bs[0], adapters)
        elif batch >= bs[-1]:  # past the grid: the last two batch sizes' slope
            hi = self._row(bs[-1], adapters)
            lo = self._row(bs[-2], adapters) if len(bs) > 1 else hi
            slope = (hi - lo) / (bs[-1] - bs[-2]) if len(bs) > 1 else 0.0
            value = hi + slope * (batch - bs[-1])
        else:
            i = bisect.bisect_left(bs, batch)
            if bs[i] == batch:
                value = self._row(batch, adapters)
            else:
                b0, b1 = bs[i - 1], bs[i]
                s0, s1 = self._row(b0, adapters), self._row(b1, adapters)
                value = s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        self._cache[key] = value
        return value

    @staticmethod
    def _by_rank(table: dict[int, float], rank: int) -> float:
        return table[min(table, key=lambda r: (abs(r - rank), r))]

    def slot_seconds(self, rank: int) -> float:
        return self._by_rank(self.slot_load, rank)

    def read_seconds(self, rank: int) -> float:
        return self._by_rank(self.disk_read, rank)


# ---- workload ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Request:
    rid: int
    arrival: float
    adapter: int
    tenant: int
    prompt: int
    output: int  # output tokens still to generate (less after a preemption: recompute keeps what was generated)
    wanted: int = 0  # output tokens asked for
    replica: int = -1
    computed: int = 0  # prompt tokens prefilled
    generated: int = 0
    first_token: float | None = None
    finished: float | None = None
    skips: int = 0
    pinned: bool = False
    blocks: int = 0


@dataclass
class Workload:
    adapters: int = 2000
    alpha: float = 1.0
    tenants: int = 100
    prompt_tokens: int = 64
    output_tokens: int = 32
    seed: int = 0
    fixed_lengths: bool = False

    def catalog(self) -> tuple[list[int], list[int]]:
        """Per adapter: its rank and its tenant."""
        rng = random.Random(f"{self.seed}-catalog")
        ranks = [rng.choice(RANKS) for _ in range(self.adapters)]
        tenants = [rng.randrange(self.tenants) for _ in range(self.adapters)]
        return ranks, tenants

    def lengths(self, rng: random.Random) -> tuple[int, int]:
        """A request's prompt and output tokens: uniform within +-50% of the prompt mean, exponential around the
        output mean (at most 8x); both the means with fixed_lengths."""
        if self.fixed_lengths:
            return self.prompt_tokens, self.output_tokens
        half = self.prompt_tokens // 2
        prompt = rng.randint(max(1, self.prompt_tokens - half), self.prompt_tokens + half)
        output = min(8 * self.output_tokens, max(1, round(rng.expovariate(1.0 / self.output_tokens))))
        return prompt, output

    def requests(self, n: int, rate: float) -> tuple[list[Request], list[int]]:
        """n requests at Poisson arrivals of ``rate`` per second, and each adapter's rank."""
        rng = random.Random(f"{self.seed}-requests")
        ranks, tenants = self.catalog()
        order = list(range(self.adapters))
        random.Random(f"{self.seed}-popularity").shuffle(order)  # popularity rank k -> adapter order[k]
        cumulative, total = [], 0.0
        for k in range(1, self.adapters + 1):
            total += k ** -self.alpha
            cumulative.append(total)
        out, t = [], 0.0
        for i in range(n):
            t += rng.expovariate(rate)
            k = min(bisect.bisect_left(cumulative, rng.random() * total), self.adapters - 1)
            adapter = order[k]
            prompt, output = self.lengths(rng)
            out.append(Request(i, t, adapter, tenants[adapter], prompt, output, output))
        return out, ranks


# ---- one replica --------------------------------------------------------------------------------

@dataclass
class Shape:
    """A replica's engine knobs (routing_costs.json's `engine`, overridable)."""
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_blocks: int = 4096
    max_adapter_wait_steps: int = 32

    @classmethod
    def from_costs(cls, costs: Costs, **overrides) -> "Shape":
        known = {k: v for k, v in costs.engine.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class Replica:
    index: int
    shape: Shape
    costs: Costs
    ranks: list[int]
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    pins: dict = field(default_factory=dict)  # adapter -> pinned sequences (resident in a slot)
    lru: OrderedDict = field(default_factory=OrderedDict)  # slot-resident adapters, least recently used first
    host: OrderedDict = field(default_factory=OrderedDict)  # host tier, LRU
    reads: deque = field(default_factory=deque)  # adapters queued for the reader thread
    reading: set = field(default_factory=set)  # queued or being read
    reader_busy: bool = False
    stepping: bool = False
    free_blocks: int = 0
    slot_loads: int = 0
    disk_reads: int = 0
    active: int = 0  # requests routed here and not finished (what Envoy counts)

    def __post_init__(self):
        self.free_blocks = self.shape.kv_blocks

    # metrics the picker scrapes
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.shape.kv_blocks

    def lora_info(self) -> tuple[set, set]:
        """vLLM's layout: adapters of running sequences, adapters of waiting requests."""
        return {r.adapter for r in self.running}, {r.adapter for r in self.waiting}

    def resident(self, adapter: int) -> bool:
        return adapter in self.lru

    def in_host(self, adapter: int) -> bool:
        return adapter in self.host or adapter in self.lru

    def _touch_host(self, adapter: int) -> None:
        self.host[adapter] = True
        self.host.move_to_end(adapter)
        while len(self.host) > self.shape.max_cpu_loras:
            self.host.popitem(last=False)

    def queue_read(self, adapter: int) -> None:
        if adapter not in self.reading:
            self.reading.add(adapter)
            self.reads.append(adapter)

    def read_done(self, adapter: int) -> None:
        self.reading.discard(adapter)
        self.disk_reads += 1
        self._touch_host(adapter)

    def _pin(self, req: Request) -> float | None:
        """Pin the request's adapter in a slot: the seconds of the slot load it takes (0 if resident), None if no slot."""
        a = req.adapter
        if a in self.lru:
            self.lru.move_to_end(a)
            self.pins[a] = self.pins.get(a, 0) + 1
            req.pinned = True
            return 0.0
        if len(self.lru) >= self.shape.max_loras:
            victim = next((x for x in self.lru if not self.pins.get(x)), None)
            if victim is None:
                return None
            del self.lru[victim]
            self.pins.pop(victim, None)
        self.lru[a] = True
        self.pins[a] = 1
        req.pinned = True
        self._touch_host(a)
        self.slot_loads += 1
        return self.costs.slot_seconds(self.ranks[a])

    def _unpin(self, req: Request) -> None:
        if req.pinned:
            self.pins[req.adapter] -= 1
            req.pinned = False

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.shape.block_size)

    def schedule(self) -> tuple[list[tuple[Request, int]], float]:
        """One step's batch (request, new tokens) and its seconds; [] when nothing can run."""
        shape, batch, extra = self.shape, [], 0.0
        budget = shape.max_num_batched_tokens
        # Running sequences first: a decode token each, or the next chunk of a prompt; KV for it or preempt.
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted below for an older one
            n = 1 if req.computed >= req.prompt else min(req.prompt - req.computed, budget)
            if n <= 0:
                continue
            need = self._blocks(req.computed + req.generated + n) - req.blocks
            while need > self.free_blocks and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if need > self.free_blocks:
                self._preempt(req)
                continue
            self.free_blocks -= need
            req.blocks += need
            batch.append((req, n))
            budget -= n
        # Then waiting requests, in order.
        kept: deque = deque()
        blocked = False
        watermark = max(1, shape.kv_blocks // 100)
        while self.waiting:
            req = self.waiting.popleft()
            if blocked or budget <= 0 or len(self.running) >= shape.max_num_seqs:
                kept.append(req)
                kept.extend(self.waiting)
                self.waiting.clear()
                break
            if not self.in_host(req.adapter):
                self.queue_read(req.adapter)  # left host memory since it arrived: read again; the others go
                kept.append(req)
                continue
            seconds = self._pin(req)
            if seconds is None:
                req.skips += 1
                kept.append(req)
                blocked = req.skips > shape.max_adapter_wait_steps
                continue
            n = min(req.prompt - req.computed, budget)
            need = self._blocks(req.computed + n)
            if need > self.free_blocks - watermark:
                self._unpin(req)
                kept.append(req)
                blocked = True
                continue
            extra += seconds
            self.free_blocks -= need
            req.blocks = need
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        self.waiting = kept
        if not batch:
            return [], 0.0
        prefill = sum(n for _, n in batch if n > 1)
        prefill_seqs = sum(1 for _, n in batch if n > 1)
        adapters = len({r.adapter for r, _ in batch})
        seconds = (self.costs.step(len(batch), adapters)
                   + self.costs.prefill_per_token * max(0, prefill - prefill_seqs) + extra)
        return batch, seconds

    def _preempt(self, req: Request) -> None:
        """Recompute mode: the sequence drops its KV and goes back to the head of the queue."""
        self.running.remove(req)
        self.free_blocks += req.blocks
        req.blocks, req.computed = 0, 0
        req.prompt += req.generated  # its generated tokens are prefilled again with the prompt
        req.output -= req.generated
        req.generated = 0
        self._unpin(req)
        self.waiting.appendleft(req)

    def finish_step(self, batch: list[tuple[Request, int]], now: float) -> list[Request]:
        """Apply a step's tokens; the requests that ended."""
        done = []
        for req, n in batch:
            if req not in self.running:
                continue
            if req.computed < req.prompt:
                req.computed += n
                if req.computed < req.prompt:
                    continue
            req.generated += 1
            if req.first_token is None:
                req.first_token = now
            if req.generated >= req.output:
                req.finished = now
                self.running.remove(req)
                self.free_blocks += req.blocks
                req.blocks = 0
                self._unpin(req)
                done.append(req)
        return done


# ---- routers ---------------------------------------------------------------------------------------

def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=8)
def ring_points(replicas: int, ring_size: int) -> tuple[list[int], list[int]]:
    """The ring's sorted point hashes and each point's replica (ring_size / replicas points per replica)."""
    per_host = math.ceil(ring_size / replicas)
    points = sorted((hash64(f"replica-{h}_{i}"), h) for h in range(replicas) for i in range(per_host))
    return [p for p, _ in points], [h for _, h in points]


class Ring:
    """Envoy's RING_HASH (minimum_ring_size 16384) with bounded loads (hash_balance_factor)."""

    def __init__(self, replicas: int, balance_factor: int = 200, ring_size: int = 16384):
        self.keys, self.hosts = ring_points(replicas, ring_size)
        self.replicas, self.factor = replicas, balance_factor

    def pick(self, key: str, active: list[int]) -> int:
        h = hash64(key)
        host = self.hosts[bisect.bisect_left(self.keys, h) % len(self.keys)]
        if not self.factor:
            return host
        slots = max(math.ceil(math.ceil((sum(active) + 1) * self.factor / 100) / self.replicas), 1)

        def overload(x: int) -> float:
            return active[x] / slots

        if overload(host) <= 1.0:
            return host
        best, best_load = host, overload(host)
        order = list(range(self.replicas))
        rng = random.Random(h)  # the same key probes the same hosts in the same order
        for i in range(self.replicas):
            j = i + rng.randrange(self.replicas - i)
            order[i], order[j] = order[j], order[i]
            alt = order[i]
            if alt == host:
                continue
            if overload(alt) <= 1.0:
                return alt
            if overload(alt) < best_load:
                best, best_load = alt, overload(alt)
        return best


@dataclass
class Scrape:
    waiting: int = 0
    kv: float = 0.0
    running_adapters: frozenset = frozenset()
    waiting_adapters: frozenset = frozenset()


def picker_scores(scrapes: list[Scrape], adapter: int, max_lora: int, lora_weight: float,
                  queue_weight: float = 2.0, kv_weight: float = 2.0) -> list[float]:
    """The endpoint picker's weighted scores: queue-scorer (min-max normalised waiting), kv-cache-utilization-scorer
    (1 - usage), and lora-affinity-scorer (1.0 running / 0.8 room / 0.6 waiting / 0)."""
    queues = [s.waiting for s in scrapes]
    lo, hi = min(queues), max(queues)
    out = []
    for s in scrapes:
        queue = 1.0 if hi == lo else (hi - s.waiting) / (hi - lo)
        score = queue_weight * queue + kv_weight * (1.0 - s.kv)
        if lora_weight:
            if adapter in s.running_adapters:
                lora = 1.0
            elif len(s.running_adapters) + len(s.waiting_adapters) < max_lora:
                lora = 0.8
            elif adapter in s.waiting_adapters:
                lora = 0.6
            else:
                lora = 0.0
            score += lora_weight * lora
        out.append(score)
    return out


# ---- the simulation ----------------------------------------------------------------------------

ARRIVE, STEP_END, READ_END, SCRAPE = range(4)


def simulate(policy, costs: Costs, workload: Workload, replicas: int, requests: int, rate: float,
             shape: Shape | None = None, scrape_interval: float = 0.1, lora_weight: float = 1.0,
             balance_factor: int = 200, seed: int = 0, trace: list | None = None) -> dict:
    """Run one policy (a name from POLICIES, or a callable(request, replicas) -> index); its figures.
    ``trace``: a list the simulated requests are appended to (for tests)."""
    shape = shape or Shape.from_costs(costs)
    label = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    if isinstance(policy, str) and ":" in policy:  # ring_tenant:125 = that ring with hash_balance_factor 125
        policy, factor = policy.split(":")
        balance_factor = int(factor)
    reqs, ranks = workload.requests(requests, rate)
    fleet = [Replica(i, shape, costs, ranks) for i in range(replicas)]
    rng = random.Random(f"{seed}-router")
    ring = Ring(replicas, balance_factor) if policy in ("ring_tenant", "ring_adapter") else None
    picker = policy in ("epp_default", "lora_affinity")
    scrapes = [Scrape() for _ in fleet]
    counter = itertools.count()
    events: list = [(r.arrival, next(counter), ARRIVE, r) for r in reqs]
    heapq.heapify(events)
    if picker:
        heapq.heappush(events, (0.0, next(counter), SCRAPE, None))
    batches: dict[int, list] = {}
    served, rr, now = 0, 0, 0.0

    def kick(rep: Replica, t: float) -> None:
        if not rep.stepping:
            batch, seconds = rep.schedule()
            if batch:
                rep.stepping = True
                batches[rep.index] = batch
                heapq.heappush(events, (t + seconds, next(counter), STEP_END, rep))
        if rep.reads and not rep.reader_busy:
            rep.reader_busy = True
            adapter = rep.reads.popleft()
            heapq.heappush(events, (t + costs.read_seconds(ranks[adapter]), next(counter), READ_END, (rep, adapter)))

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == ARRIVE:
            if callable(policy):
                target = policy(item, fleet)
            elif policy == "round_robin":
                target, rr = rr % replicas, rr + 1
            elif policy == "least_request":
                a, b = rng.sample(range(replicas), 2) if replicas > 1 else (0, 0)
                target = a if fleet[a].active <= fleet[b].active else b
            elif ring is not None:
                key = f"tenant-{item.tenant}" if policy == "ring_tenant" else f"adapter-{item.adapter}"
                target = ring.pick(key, [r.active for r in fleet])
            elif picker:
                scores = picker_scores(scrapes, item.adapter, shape.max_loras,
                                       lora_weight if policy == "lora_affinity" else 0.0)
                best = max(scores)
                target = rng.choice([i for i, s in enumerate(scores) if s == best])
            else:
                raise ValueError(f"unknown policy {policy!r}")
            rep = fleet[target]
            item.replica = target
            rep.active += 1
            rep.waiting.append(item)
            if not rep.in_host(item.adapter):
                rep.queue_read(item.adapter)  # the preloader reads a cold adapter as the request arrives
            kick(rep, now)
        elif kind == STEP_END:
            rep = item
            rep.stepping = False
            for req in rep.finish_step(batches.pop(rep.index), now):
                rep.active -= 1
                served += 1
            kick(rep, now)
        elif kind == READ_END:
            rep, adapter = item
            rep.reader_busy = False
            rep.read_done(adapter)
            kick(rep, now)
        elif kind == SCRAPE:
            for i, rep in enumerate(fleet):
                running, waiting = rep.lora_info()
                scrapes[i] = Scrape(len(rep.waiting), rep.kv_usage(), frozenset(running), frozenset(waiting))
            if served < requests:
                heapq.heappush(events, (now + scrape_interval, next(counter), SCRAPE, None))
    if trace is not None:
        trace.extend(reqs)
    return {**figures(label, reqs, fleet, rate), "completions": served}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def figures(policy: str, reqs: list[Request], fleet: list[Replica], rate: float) -> dict:
    measured = reqs[int(len(reqs) * WARMUP_SHARE):]
    ttft = [r.first_token - r.arrival for r in measured]
    tokens = sum(r.wanted for r in reqs)
    span = max(r.finished for r in reqs) - reqs[0].arrival
    per_replica = [sum(1 for r in reqs if r.replica == rep.index) for rep in fleet]
    return {"policy": policy, "rate": rate, "requests": len(reqs),
            "served": sum(1 for r in reqs if r.finished is not None),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "throughput_tok_s": tokens / span, "requests_per_s": len(reqs) / span,
            "slot_loads_per_request": sum(r.slot_loads for r in fleet) / len(reqs),
            "disk_reads_per_request": sum(r.disk_reads for r in fleet) / len(reqs),
            "busiest_replica_share": max(per_replica) / len(reqs)}


def knee(costs: Costs, workload: Workload, replicas: int, requests: int, target_p99: float, shape: Shape,
         low: float, high: float, iterations: int = 12, **kw) -> float:
    """The arrival rate at which ring_tenant's TTFT p99 is ``target_p99`` (bisection between low and high)."""
    for _ in range(iterations):
        mid = (low + high) / 2
        p99 = simulate("ring_tenant", costs, workload, replicas, requests, mid, shape, **kw)["ttft_p99_s"]
        low, high = (mid, high) if p99 < target_p99 else (low, mid)
    return (low + high) / 2


COLUMNS = [("policy", "policy", "{}"), ("rate", "req/s", "{:.2f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
           ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("throughput_tok_s", "tok/s", "{:.1f}"),
           ("slot_loads_per_request", "slot loads/req", "{:.3f}"), ("disk_reads_per_request", "disk reads/req", "{:.3f}"),
           ("busiest_replica_share", "busiest replica", "{:.1%}")]


def table(results: list[dict]) -> str:
    rows = [[h for _, h, _ in COLUMNS]] + [[f.format(r[k]) for k, _, f in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--costs", default=str(DEFAULT_COSTS), help="routing_costs.py's file (default %(default)s)")
    ap.add_argument("--replicas", type=int, default=8, help="replicas (default %(default)s)")
    ap.add_argument("--adapters", type=int, default=2000, help="adapters (default %(default)s)")
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity (default %(default)s)")
    ap.add_argument("--tenants", type=int, default=100, help="tenants owning the adapters (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="mean prompt tokens per request (default %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=32,
                    help="mean output tokens per request (default %(default)s)")
    ap.add_argument("--fixed-lengths", action="store_true",
                    help="every request exactly --prompt-tokens and --output-tokens (default: prompts uniform "
                         "within +-50%%, outputs exponential, at most 8x the mean)")
    ap.add_argument("--requests", type=int, default=8000, help="requests per run (default %(default)s)")
    ap.add_argument("--rate", type=float, default=0.0, help="arrivals per second (default: --knee)")
    ap.add_argument("--knee", action="store_true", help="run at the rate where ring_tenant's TTFT p99 is --target-p99")
    ap.add_argument("--target-p99", type=float, default=2.0, help="--knee's TTFT p99 in seconds (default %(default)s)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; a ring policy may name its hash_balance_factor, e.g. ring_tenant:125 "
                         "(default: %(default)s)")
    ap.add_argument("--max-loras", type=int, default=None, help="device slots per replica (default: the costs file's)")
    ap.add_argument("--max-cpu-loras", type=int, default=None, help="host tier per replica (default: the costs file's)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per replica (default: the file's)")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica (default: the costs file's)")
    ap.add_argument("--scrape-interval", type=float, default=0.1,
                    help="seconds between snapshots of the metrics the picker sees (default %(default)s: its 50 ms "
                         "refresh after the replica's 50 ms publishing)")
    ap.add_argument("--step-scale", type=float, default=1.0,
                    help="what-if: multiply the measured step and prefill seconds (a faster device; loads stay as "
                         "measured); default %(default)s = as measured")
    ap.add_argument("--lora-weight", type=float, default=1.0, help="lora-affinity-scorer's weight (default %(default)s)")
    ap.add_argument("--balance-factor", type=int, default=200,
                    help="Envoy's hash_balance_factor for the ring policies; 0 = none (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    costs = Costs.load(args.costs).scaled(args.step_scale)
    shape = Shape.from_costs(costs, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                             max_num_seqs=args.max_num_seqs, kv_blocks=args.kv_blocks)
    workload = Workload(args.adapters, args.alpha, args.tenants, args.prompt_tokens, args.output_tokens, args.seed,
                        args.fixed_lengths)
    kw = {"scrape_interval": args.scrape_interval, "balance_factor": args.balance_factor, "seed": args.seed}
    rate = args.rate
    if not rate or args.knee:
        # Bracket: the fleet's rate if every replica ran full batches of one adapter each step.
        full = shape.max_num_seqs / (costs.step(shape.max_num_seqs, 1) * args.output_tokens) * args.replicas
        rate = knee(costs, workload, args.replicas, args.requests, args.target_p99, shape, 0.02 * full, 1.5 * full, **kw)
        print(f"routing_sim.py: ring_tenant reaches TTFT p99 {args.target_p99:g} s at {rate:.3f} requests/s", flush=True)
    results = [simulate(p, costs, workload, args.replicas, args.requests, rate, shape, lora_weight=args.lora_weight,
                        **kw) for p in args.policies.split(",")]
    print(f"routing_sim.py: {args.replicas} replicas x {args.adapters} adapters (Zipf alpha {args.alpha:g}, "
          f"{args.tenants} tenants, ranks {'/'.join(map(str, RANKS))}), {args.requests} requests of "
          f"{args.prompt_tokens}+{args.output_tokens} tokens{'' if args.fixed_lengths else ' (means)'} at {rate:.3f}/s; replica: {shape}; costs: {args.costs}"
          + (f" with step and prefill seconds x{args.step_scale:g} (what-if)" if args.step_scale != 1.0 else ""))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rate": rate, "shape": vars(shape),
                                               "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
