"""One serving benchmark against two revisions of the package, alternated in one run.

    python benchmarks/compare_revisions.py --base REV [--rounds 2] [--figure ours.adapters.output_tokens_per_s] \
        -- <serving.py arguments>

The base revision is checked out (``git worktree``) into ``.cache/revisions/<rev>``; its package is
put first on ``PYTHONPATH`` (a folder whose ``loraplex`` is that checkout's ``backend/``), so the
benchmark process, ``loraplex-serve``, tritonserver's Python stub and the model repository all come
from it; the current checkout runs as installed. This ``serving.py`` drives both, so the workload
is the same. Rounds alternate base, current, base, current, ... (drift on a shared machine then
falls on both); the figure (a dotted path into serving.py's ``--json``) is printed per run, with
each current run's ratio to the mean of the base runs around it and the median of those ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str) -> Path:
    """A worktree of ``rev`` under .cache/revisions, and a PYTHONPATH folder whose ``loraplex`` is its backend/."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = ROOT / ".cache" / "revisions" / sha
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
    shim = tree.parent / f"{sha}-path"
    shim.mkdir(exist_ok=True)
    link = shim / "loraplex"
    if not link.exists():
        link.symlink_to(tree / "backend")
    return shim


def figure(report: dict, path: str) -> float:
    """The value at a dotted path of a report."""
    value = report
    for key in path.split("."):
        value = value[key]
    return float(value)


def run(label: str, python_path: Path | None, serving_args: list[str], out: Path, path: str) -> float:
    """serving.py once, with the package from ``python_path`` (None: as installed); its figure."""
    env = dict(os.environ, LORAPLEX_CACHE_DIR=str(ROOT / ".cache"))
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(python_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), *serving_args, "--json", str(out)]
    subprocess.run(cmd, env=env, check=True)
    value = figure(json.loads(out.read_text()), path)
    print(f"compare_revisions.py: {label}: {value:.2f}", flush=True)
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against (any git revision)")
    ap.add_argument("--rounds", type=int, default=2, help="base/current pairs; a last base run closes them")
    ap.add_argument("--figure", default="ours.adapters.output_tokens_per_s",
                    help="dotted path of the figure in serving.py's --json")
    ap.add_argument("--json", default=None, help="write every run's figure and the ratios here")
    args = ap.parse_args(argv[:split])
    serving_args = argv[split + 1:]
    base_path = checkout(args.base)
    work = ROOT / ".cache" / "revisions" / f"runs-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    base, current = [], []
    for i in range(args.rounds):
        base.append(run(f"base {args.base} #{i}", base_path, serving_args, work / f"base-{i}.json", args.figure))
        current.append(run(f"current #{i}", None, serving_args, work / f"current-{i}.json", args.figure))
    base.append(run(f"base {args.base} #{args.rounds}", base_path, serving_args, work / "base-last.json",
                    args.figure))
    ratios = [c / ((base[i] + base[i + 1]) / 2) for i, c in enumerate(current)]
    print(f"compare_revisions.py: {args.figure}: base {base}, current {current}; current / bracketing base: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "figure": args.figure, "serving_args": serving_args,
                                               "base_runs": base, "current_runs": current, "ratios": ratios,
                                               "median_ratio": statistics.median(ratios)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
