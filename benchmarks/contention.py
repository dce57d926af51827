"""The CPU path when it shares its cores: quiet, one core taken by a spinner, a CPU quota; old vs new threading.

    python benchmarks/contention.py [--streams 1,16] [--tokens 16] [--rounds 2] [--policies old,new]

SmolLM2 (fp16 weights, native ops) in-process, as `make serve` runs it: 1 torch thread, native
threads auto. Each (policy, condition) runs in a fresh worker process (the OpenMP wait policy is
read when libgomp loads), alternated round by round; the best round is reported:

  policy old   OMP_WAIT_POLICY unset (libgomp spins before sleeping), native threads = affinity
         new   OMP_WAIT_POLICY=PASSIVE (what tritonserver now gets), native threads = usable_cpus()
  condition quiet   nothing beside it
            busy    one `while True: pass` process beside it (one of two cores taken)
            quota   1.5 CPUs of 2: `systemd-run --scope -p CPUQuota=150%` when systemd runs; else a
                    duty-cycle throttler (SIGSTOP/SIGCONT of the worker, 75% on in each 100 ms), printed

Prints tok/s per streams and condition, and each condition's share of the quiet figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"old": {}, "new": {"OMP_WAIT_POLICY": "PASSIVE"},
            "spin3k": {"GOMP_SPINCOUNT": "3000"}, "spin300k": {"GOMP_SPINCOUNT": "300000"}}


def worker(streams: list[int], tokens: int) -> None:
    """In the worker process: load the engine, print {streams: tok/s} as JSON on the last line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from serving import BASE_MODEL
    from triton_overhead import in_process, prompts_for

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.launch.serve import builtin_model

    torch.set_num_threads(1)
    threads = int(os.environ.get("CONTENTION_NATIVE_THREADS", "0"))
    engine = LLMEngine(EngineConfig.from_dict({"model_dir": str(builtin_model("smollm2")[0]),
                                               "weight_dtype": "float16", "native_threads": threads}))
    in_process(engine, prompts_for("smollm2", 2), [BASE_MODEL], 4, "warm")
    print("READY", flush=True)
    sys.stdin.readline()  # the driver starts the condition, then says go
    print(json.dumps({n: in_process(engine, prompts_for("smollm2", n), [BASE_MODEL], tokens, f"s{n}")
                      for n in streams}), flush=True)


def throttle(pid: int, on: float, period: float, stop: threading.Event) -> None:
    """Duty-cycle the process: run `on` of every `period` seconds, stopped the rest."""
    while not stop.is_set():
        time.sleep(period * on)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(period * (1 - on))
        os.kill(pid, signal.SIGCONT)


def have_systemd() -> bool:
    return shutil.which("systemd-run") is not None and Path("/run/systemd/system").is_dir()


def run_one(policy: str, condition: str, streams: list[int], tokens: int) -> dict:
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        env.pop(name, None)
    env.update(POLICIES[policy])
    if policy == "old":
        env["CONTENTION_NATIVE_THREADS"] = str(len(os.sched_getaffinity(0)))
    cmd = [sys.executable, __file__, "--worker", "--streams", ",".join(map(str, streams)), "--tokens", str(tokens)]
    if condition == "quota" and have_systemd():
        cmd = ["systemd-run", "--scope", "-q", "-p", "CPUQuota=150%"] + cmd
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    extra, stop = None, threading.Event()
    try:
        while (line := proc.stdout.readline()) and line.strip() != "READY":
            pass
        if condition == "busy":
            extra = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        elif condition == "quota" and not have_systemd():
            threading.Thread(target=throttle, args=(proc.pid, 0.75, 0.1, stop), daemon=True).start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        last = ""
        for line in proc.stdout:
            last = line
        return {int(k): v for k, v in json.loads(last).items()}
    finally:
        stop.set()
        time.sleep(0.15)
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if extra:
            extra.kill()
            extra.wait()
        proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,16", help="concurrent requests per measurement")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds (best reported)")
    ap.add_argument("--policies", default="old,new", help="old (spin, affinity threads) and/or new")
    ap.add_argument("--conditions", default="quiet,busy,quota")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    streams = [int(n) for n in args.streams.split(",")]
    if args.worker:
        worker(streams, args.tokens)
        return 0
    policies, conditions = args.policies.split(","), args.conditions.split(",")
    print(f"quota: {'systemd-run CPUQuota=150%' if have_systemd() else 'emulated: SIGSTOP/SIGCONT at 75% of 100 ms'}")
    best: dict = {}
    for r in range(args.rounds):
        for condition in conditions:
            for policy in policies:
                got = run_one(policy, condition, streams, args.tokens)
                print(f"round {r} {condition:5} {policy:3} " + " ".join(f"{n}:{v:.1f}" for n, v in got.items()),
                      flush=True)
                for n, v in got.items():
                    best[(policy, condition, n)] = max(best.get((policy, condition, n), 0.0), v)
    print(f"\n{'policy':6} {'streams':>7} " + " ".join(f"{c + ' tok/s':>12} {'/quiet':>6}" for c in conditions))
    for policy in policies:
        for n in streams:
            quiet = best.get((policy, "quiet", n), 0.0)
            cells = [f"{best[(policy, c, n)]:>12.1f} {best[(policy, c, n)] / quiet if quiet else 0:>6.2f}"
                     for c in conditions]
            print(f"{policy:6} {n:>7} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
