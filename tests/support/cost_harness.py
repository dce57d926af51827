"""The cost harness: an adversarial input's cost at sizes n and 2n, in a fresh subprocess under a memory
rlimit and a wall-clock bound, so a super-linear parser, compiler or matcher fails a test instead of hanging it.

Both sizes run in one child (one start-up). A case is a module-level function of a test module, ``case(n) -> callable``: it builds the input of size n
(not timed) and returns a zero-argument callable that runs the code under test on it (timed). The callable may
raise: a refusal is an outcome, and its cost is what is measured. ``assert_linear(case, n, ...)`` runs the
case at n and 2n and asserts the cost at 2n is under ``max_seconds`` and at most ``max_ratio`` times the cost
at n (linear is 2; quadratic is 4); a case that misses either is measured once more, best of three calls,
and judged on that (CI once failed a linear case at ratio 3.11: one call stretched 1.6x on a shared machine). Costs are the child's CPU seconds (all its threads), so a busy machine
(tests run two at a time on two cores) stretches neither side of the ratio; the wall clock only bounds a hang. A child that runs out of memory or time fails the assertion, naming the
case and the size.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SUPPORT_DIR = Path(__file__).resolve().parent
ROOT = SUPPORT_DIR.parents[1]
FLOOR_S = 0.003  # costs below this are timer noise: a ratio is taken over max(cost, FLOOR_S)


@dataclass(frozen=True, slots=True)
class Cost:
    """One child's measurement: the best of ``repeats`` timed calls, and what the last call raised (if any)."""

    n: int
    seconds: float
    raised: str | None


def _limit_memory(mem_mb: int):
    def apply():
        limit = mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        os.setsid()  # a timed-out child is killed with everything it started

    return apply


def measure(case, sizes: list[int], *, mem_mb: int = 4096, timeout_s: float = 60.0, repeats: int = 3) -> list[Cost]:
    """``case``'s cost at each of ``sizes``, in one fresh subprocess (memory rlimit ``mem_mb`` MiB, ``timeout_s`` of
    wall clock for all); AssertionError when the child runs out of either or fails to build an input."""
    module = sys.modules[case.__module__]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT_DIR), os.environ.get("PYTHONPATH", "")]),
               OMP_WAIT_POLICY="PASSIVE")  # as loraplex-serve runs: OpenMP threads spinning on a busy machine are not work
    args = [sys.executable, "-m", "cost_harness", str(Path(module.__file__).resolve()), case.__name__, str(repeats),
            *map(str, sizes)]
    where = f"{case.__name__}({', '.join(map(str, sizes))})"
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT,
                              preexec_fn=_limit_memory(mem_mb))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{where} ran past {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise AssertionError(f"{where} failed in its child (rc {done.returncode}, memory limit {mem_mb} MiB):\n{tail}")
    results = [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith('{"n"')]
    return [Cost(r["n"], r["seconds"], r["raised"]) for r in results]


def assert_linear(case, n: int, *, max_seconds: float, max_ratio: float = 3.0, mem_mb: int = 4096,
                  timeout_s: float | None = None, repeats: int = 3) -> tuple[Cost, Cost]:
    """Assert ``case`` costs at most ``max_seconds`` at 2n and at most ``max_ratio`` times its cost at n."""
    timeout = timeout_s if timeout_s is not None else max(30.0, 10 * max_seconds)
    for _ in range(2):  # a miss gets a second look, best of three: noise does not repeat, a super-linear cost does
        small, large = measure(case, [n, 2 * n], mem_mb=mem_mb, timeout_s=timeout, repeats=repeats)
        ratio = max(large.seconds, FLOOR_S) / max(small.seconds, FLOOR_S)
        if large.seconds <= max_seconds and ratio <= max_ratio:
            break
        repeats = max(repeats, 3)
    where = f"{case.__name__}: {small.seconds * 1e3:.1f} ms at n={n}, {large.seconds * 1e3:.1f} ms at 2n"
    assert large.seconds <= max_seconds, f"{where}: over its bound of {max_seconds:g} s"
    assert ratio <= max_ratio, f"{where}: ratio {ratio:.2f} > {max_ratio:g} (super-linear)"
    return small, large


def _child(path: str, name: str, repeats: int, sizes: list[int]) -> None:
    """Run in the subprocess: import the test module by path, then for each size build the input and time the call."""
    sys.path.insert(0, str(ROOT / "tests"))
    spec = importlib.util.spec_from_file_location(f"cost_case_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for n in sizes:
        best, raised = float("inf"), None
        for _ in range(repeats):
            call = getattr(module, name)(n)
            t0 = time.process_time()
            try:
                call()
                raised = None
            except MemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 (a refusal is an outcome: its cost is measured)
                raised = f"{type(exc).__name__}: {str(exc)[:300]}"
            best = min(best, time.process_time() - t0)
        print(json.dumps({"n": n, "seconds": best, "raised": raised}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(a) for a in sys.argv[4:]])
