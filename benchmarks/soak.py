"""Soak: waves of concurrent gRPC streams from many tenants over many adapters; checks exactness and leaks.

    python benchmarks/soak.py [--streams 1000] [--tenants 50] [--adapters 100] [--duration 600]
        [--max-loras 8] [--max-cpu-loras 32] [--client-procs 4] [--model-dir DIR] [--seed 0]

Starts its own tritonserver (free ports; the demo model unless --model-dir), builds the
adapters with peft (cached under .cache/soak/), then repeats waves of --streams
concurrent streams (one tritonclient gRPC stream each, spread over --client-procs
processes, tenant in the x-tenant-id header) until --duration seconds have passed (0: one
wave). Every stream is greedy with `ignore_eos` and a long-tailed max_tokens (lognormal,
clipped to [1, --max-tokens]); a share (--base-share) uses the base model.

Checked per stream: no error, exactly one FINAL, num_output_tokens and the streamed token
ids both equal max_tokens, the text deltas concatenate to the decoded ids, and the ids
agree with every other stream of the same prompt and adapter (greedy: one is a prefix of
the other); after each wave, the longest stream of each (prompt, adapter) equals
transformers + peft's greedy tokens on the same weights (unless --no-peft), so every stream
is checked against the oracle. After the drain: no KV block used, no adapter pin, no running or waiting
sequence, the Python stub's thread count back to its idle value (measured after a
warm-up). The stub's VmRSS is sampled through the run: its peak in the second half may
exceed the first half's peak by less than --rss-growth (5%). Prints the figures; exits 1
on any violation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loraplex.clients.load import StreamJob, StreamOutcome, StreamPool, first_difference, stream_problem
from loraplex.clients.metrics import scrape, wait_for_metric
from loraplex.launch.tritonserver import cache_dir

TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           ("o_proj", "up_proj", "down_proj"))
RANKS = (4, 8, 16)
WORDS = "tenant adapter stream token batch block cache prefix decode prefill slot rank alpha model".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1000, help="concurrent streams per wave (default 1000)")
    ap.add_argument("--tenants", type=int, default=50, help="tenants, sent as x-tenant-id (default 50)")
    ap.add_argument("--adapters", type=int, default=100, help="distinct LoRA adapters (default 100)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of waves; 0 = one wave (default 600)")
    ap.add_argument("--max-loras", type=int, default=8, help="engine max_loras: device slots (default 8)")
    ap.add_argument("--max-cpu-loras", type=int, default=32, help="engine max_cpu_loras: host tier (default 32)")
    ap.add_argument("--engine-config", default="{}", help="more engine knobs (JSON object)")
    ap.add_argument("--model-dir", default=None, help="LLaMA-family checkpoint (default: the offline demo model)")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes sharing the streams (default 4)")
    ap.add_argument("--server-threads", type=int, default=2, help="OMP_NUM_THREADS of the server (default 2)")
    ap.add_argument("--median-tokens", type=float, default=24.0, help="median max_tokens (default 24)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of max_tokens (default 1.0)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens clip (default 256)")
    ap.add_argument("--base-share", type=float, default=0.1, help="share of base-model streams (default 0.1)")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts (default 16)")
    ap.add_argument("--rss-growth", type=float, default=0.05, help="largest second-half RSS growth (default 0.05)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--wave-timeout", type=float, default=3600.0, help="seconds a wave may take (default 3600)")
    ap.add_argument("--no-peft", action="store_true",
                    help="skip the check of each (prompt, adapter)'s longest stream against transformers + peft")
    return ap.parse_args(argv)


# ---- adapters ----------------------------------------------------------------------------

def build_adapters(model_dir, count: int, root: Path | None = None) -> list[Path]:
    """`count` random PEFT adapters for the model (ranks and targets vary), cached across runs."""
    model_dir = Path(model_dir).resolve()
    key = hashlib.sha256(f"{model_dir}|{(model_dir / 'config.json').read_text()}".encode()).hexdigest()[:12]
    folder = (root or cache_dir() / "soak") / f"adapters-{key}"
    paths = [folder / f"soak-{i:03d}" for i in range(count)]
    missing = [i for i, p in enumerate(paths) if not (p / "adapter_model.safetensors").is_file()]
    if missing:
        from transformers import AutoModelForCausalLM

        from loraplex.models.builtin.demo import build_peft_adapter

        model = AutoModelForCausalLM.from_pretrained(model_dir).float()
        for i in missing:
            tmp = folder / f".tmp-{os.getpid()}-{i}"
            rank = RANKS[i // 3 % 3]
            build_peft_adapter(model_dir, tmp, r=rank, alpha=2 * rank, target_modules=TARGETS[i % 3], seed=1000 + i,
                               use_rslora=i % 5 == 0, model=model)
            os.replace(tmp, paths[i])  # complete adapters only: a killed build leaves a .tmp folder
    return paths


def populate_store(store: Path, adapters: list[Path]) -> Path:
    """An adapter store of links to the given adapter folders."""
    store.mkdir(parents=True, exist_ok=True)
    for path in adapters:
        link = store / path.name
        if not link.exists():
            link.symlink_to(path, target_is_directory=True)
    return store


# ---- workload and checks -----------------------------------------------------------------

def make_prompts(count: int, seed: int) -> list[str]:
    """Distinct prompts of 2 to 16 words."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 16))) for i in range(count)]


def make_wave(args, adapter_names: list[str], wave: int) -> list[StreamJob]:
    """One wave's jobs: tenants round-robin, adapters and prompts at random, long-tailed max_tokens."""
    rng = random.Random(f"{args.seed}/{wave}")
    prompts = make_prompts(args.prompts, args.seed)
    jobs = []
    for i in range(args.streams):
        max_tokens = min(args.max_tokens, max(1, round(rng.lognormvariate(math.log(args.median_tokens), args.sigma))))
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        if rng.random() >= args.base_share:
            params["lora_name"] = rng.choice(adapter_names)
        jobs.append(StreamJob(rng.choice(prompts), params, tenant=f"tenant-{i % args.tenants:03d}"))
    return jobs


def peft_oracle(model_dir, adapter_dirs: dict, tokenizer):
    """(prompt, adapter name | None, n) -> transformers + peft's first n greedy token ids (EOS ignored)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from peft_reference import greedy_tokens

    def oracle(prompt: str, adapter: str | None, n: int) -> list[int]:
        path = str(adapter_dirs[adapter]) if adapter else None
        return greedy_tokens(str(model_dir), path, tokenizer(prompt).input_ids, n, ignore_eos=True)

    return oracle


@dataclass
class Verifier:
    """Checks each stream against its request and against every earlier stream of the same prompt and adapter;
    with an oracle, each (prompt, adapter)'s longest stream against it."""

    tokenizer: object
    oracle: object = None  # peft_oracle's callable, or None
    longest: dict = field(default_factory=dict)  # (prompt, adapter) -> longest token ids seen
    verified: dict = field(default_factory=dict)  # (prompt, adapter) -> how many of those the oracle confirmed

    def check(self, jobs: list[StreamJob], outcomes: list[StreamOutcome]) -> list[str]:
        """Violations of the wave (empty when every stream is exact)."""
        violations = []
        for i, (job, out) in enumerate(zip(jobs, outcomes)):
            problem = self._problem(job, out)
            if problem:
                violations.append(f"stream {i} ({job.tenant}, {job.params.get('lora_name', 'base')}): {problem}")
        if self.oracle is not None:
            violations += self._against_oracle()
        return violations

    def _against_oracle(self) -> list[str]:
        """Each (prompt, adapter)'s longest stream against the oracle (the others are its prefixes)."""
        violations = []
        for (prompt, adapter), ids in self.longest.items():
            if self.verified.get((prompt, adapter), 0) >= len(ids):
                continue
            want = self.oracle(prompt, adapter, len(ids))
            if want != ids:
                violations.append(f"({prompt!r}, {adapter or 'base'}): token ids differ from transformers + peft "
                                  f"at {first_difference(want, ids)}")
            self.verified[(prompt, adapter)] = len(ids)
        return violations

    def _problem(self, job: StreamJob, out: StreamOutcome) -> str | None:
        want = job.params["max_tokens"]
        problem = stream_problem(out, want, self.tokenizer)
        if problem:
            return problem
        key = (job.prompt, job.params.get("lora_name"))
        seen = self.longest.get(key, [])
        n = min(len(seen), want)
        if seen[:n] != out.token_ids[:n]:
            at = first_difference(seen, out.token_ids)
            return f"token ids differ from another stream of the same prompt and adapter at {at}"
        if want > len(seen):
            self.longest[key] = out.token_ids
        return None


# ---- the server's Python stub ------------------------------------------------------------

def stub_pid(server_pid: int) -> int:
    """Pid of the triton_python_backend_stub child of the server."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if comm.startswith("triton_python_b") and int(rest[1]) == server_pid:
            return int(entry)
    raise RuntimeError(f"no triton_python_backend_stub child of pid {server_pid}")


def proc_status(pid: int) -> tuple[int, int]:
    """(VmRSS in KiB, thread count) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["Threads"])


class StubMonitor(threading.Thread):
    """Samples the stub's VmRSS and thread count every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(name="soak-monitor", daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int, int]] = []  # (monotonic time, rss KiB, threads)
        self.stopping = threading.Event()

    def run(self) -> None:
        """Sample until stopped."""
        while not self.stopping.is_set():
            self.samples.append((time.monotonic(), *proc_status(self.pid)))
            self.stopping.wait(self.interval)

    def stop(self) -> None:
        """Stop sampling (after one last sample)."""
        self.stopping.set()
        self.join()
        self.samples.append((time.monotonic(), *proc_status(self.pid)))

    def rss_halves(self) -> tuple[int, int]:
        """Peak RSS (KiB) of the first and of the second half of the sampled time."""
        start, end = self.samples[0][0], self.samples[-1][0]
        mid = (start + end) / 2
        first = max(rss for t, rss, _ in self.samples if t < mid)
        second = max((rss for t, rss, _ in self.samples if t >= mid), default=first)
        return first, second


# ---- one soak ----------------------------------------------------------------------------

@dataclass
class Report:
    """Figures of one soak and what it found wrong."""

    waves: int = 0
    streams: int = 0
    tokens: int = 0
    errors: int = 0
    load_seconds: float = 0.0
    rss_first_kib: int = 0
    rss_second_kib: int = 0
    threads_idle: int = 0
    threads_peak: int = 0
    threads_after: int = 0
    preemptions: float = 0.0
    peft_checked: int = 0  # (prompt, adapter) pairs whose longest stream equalled transformers + peft
    violations: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The figures, one per line."""
        growth = self.rss_second_kib / self.rss_first_kib - 1 if self.rss_first_kib else 0.0
        shown = self.violations[:20] + ([f"... {len(self.violations) - 20} more"] if len(self.violations) > 20 else [])
        return [
            f"waves {self.waves}, streams {self.streams}, tokens {self.tokens}, errors {self.errors}, "
            f"(prompt, adapter) pairs checked against peft {self.peft_checked}",
            f"load {self.load_seconds:.1f} s, {self.tokens / max(self.load_seconds, 1e-9):.0f} tok/s, "
            f"{self.streams / max(self.load_seconds, 1e-9):.1f} streams/s, preemptions {self.preemptions:.0f}",
            f"stub RSS peak first half {self.rss_first_kib / 1024:.1f} MiB, second half "
            f"{self.rss_second_kib / 1024:.1f} MiB ({growth:+.2%})",
            f"stub threads idle {self.threads_idle}, peak {self.threads_peak}, after {self.threads_after}",
            f"violations {len(self.violations)}", *("  " + v for v in shown),
        ]


def warm_up(pool: StreamPool, adapter_names: list[str]) -> None:
    """A few streams on the base model and adapters, so lazily started threads exist before the idle count."""
    names = [None, *adapter_names[:3]]
    pool.run([StreamJob("warm up", {"max_tokens": 4, **({"lora_name": n} if n else {})}) for n in names])


def drain_checks(server, monitor: StubMonitor, report: Report) -> None:
    """After the last wave: KV blocks, pins and queues at 0, the stub's threads back to idle."""
    url = server.metrics_url
    for name, labels in (("loraplex_kv_cache_blocks", {"state": "used"}), ("loraplex_adapter_pins", {}),
                         ("loraplex_num_sequences", {"state": "running"}),
                         ("loraplex_num_sequences", {"state": "waiting"}),
                         ("loraplex_num_sequences", {"state": "swapped"})):
        value = wait_for_metric(url, name, 0.0, timeout=60, **labels)
        if value != 0.0:
            report.violations.append(f"after the drain {name}{labels or ''} = {value}")
    deadline = time.monotonic() + 30
    while (threads := proc_status(monitor.pid)[1]) > report.threads_idle and time.monotonic() < deadline:
        time.sleep(0.5)
    report.threads_after = threads
    if threads != report.threads_idle:
        report.violations.append(f"stub threads after the drain {threads}, idle {report.threads_idle}")


def run_soak(server, args, adapter_names: list[str], tokenizer, log=print, oracle=None) -> Report:
    """Waves of streams against a running server until the duration is over, then the drain checks
    (``oracle``: peft_oracle's callable, checking each (prompt, adapter)'s longest stream)."""
    report = Report()
    verifier = Verifier(tokenizer, oracle)
    with StreamPool(server.grpc_url, args.client_procs, args.wave_timeout) as pool:
        warm_up(pool, adapter_names)
        wait_for_metric(server.metrics_url, "loraplex_kv_cache_blocks", 0.0, timeout=60, state="used")
        monitor = StubMonitor(stub_pid(server.pid))
        report.threads_idle = proc_status(monitor.pid)[1]
        preempted_before = scrape(server.metrics_url, "loraplex_preemptions_total") or 0.0
        monitor.start()
        start = time.monotonic()
        while report.waves == 0 or time.monotonic() - start < args.duration:
            jobs = make_wave(args, adapter_names, report.waves)
            began = time.monotonic()
            outcomes = pool.run(jobs)
            wall = time.monotonic() - began
            violations = verifier.check(jobs, outcomes)
            tokens = sum(o.num_output_tokens for o in outcomes)
            report.waves += 1
            report.streams += len(jobs)
            report.tokens += tokens
            report.errors += sum(o.error is not None for o in outcomes)
            report.violations += [f"wave {report.waves}: {v}" for v in violations]
            report.peft_checked = len(verifier.verified)
            log(f"wave {report.waves}: {len(jobs)} streams, {tokens} tokens in {wall:.1f} s "
                f"({tokens / wall:.0f} tok/s), {len(violations)} violations", flush=True)
        report.load_seconds = time.monotonic() - start
        monitor.stop()
    report.preemptions = (scrape(server.metrics_url, "loraplex_preemptions_total") or 0.0) - preempted_before
    report.rss_first_kib, report.rss_second_kib = monitor.rss_halves()
    report.threads_peak = max(t for _, _, t in monitor.samples)
    if report.rss_second_kib > report.rss_first_kib * (1 + args.rss_growth):
        report.violations.append(f"stub RSS grew by more than {args.rss_growth:.0%} in the second half")
    drain_checks(server, monitor, report)
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from loraplex.launch.tritonserver import TritonServer, engine_env, project_root

    model_dir = args.model_dir
    if model_dir is None:
        from loraplex.models.builtin.demo import build_demo

        model_dir = str(build_demo()["model"])
    adapters = build_adapters(model_dir, args.adapters)
    run_dir = cache_dir() / "soak" / f"run-{os.getpid()}"
    store = populate_store(run_dir / "adapters", adapters)
    config = {**json.loads(args.engine_config), "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras}
    env = {**engine_env(model_dir, store, config), "OMP_NUM_THREADS": str(args.server_threads)}
    print(f"soak: {args.streams} streams x waves for {args.duration:.0f} s, {args.tenants} tenants, "
          f"{len(adapters)} adapters, engine {json.dumps(config)}, {args.client_procs} client processes", flush=True)
    with TritonServer(project_root() / "model_repository", env=env, log_path=run_dir / "tritonserver.log",
                      ready_timeout=300) as server:
        print(f"server pid {server.pid}, gRPC {server.grpc_url}, log {server.log_path}", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        oracle = None if args.no_peft else peft_oracle(model_dir, {p.name: p for p in adapters}, tokenizer)
        report = run_soak(server, args, [p.name for p in adapters], tokenizer, oracle=oracle)
    for line in report.lines():
        print(line)
    print("PASS" if not report.violations else "FAIL", flush=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
