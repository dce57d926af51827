"""Issue 43's goals from one GPU session's results: asked, measured, where, met.

    python benchmarks/gpu_goals.py RESULTS [RESULTS ...] [--json out.json]

RESULTS is what `gpu_session.sh` leaves in $OUT: `results.tgz`, or a folder it was unpacked into; of several
(one session's calls), a later one's file replaces an earlier one's of the same name. The
table is Markdown, for `docs/benchmarks.md`; a goal whose stage did not run reads "not run". Exit status
0 when some goal ran and every one that ran is met, else 1.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

EXACT_STAGES = ("exact_paths", "cuda_kernel_tests")  # pytest stages: all passed
ENGINE_CHECKS = ("engine_check", "engine_check_eager", "engine_check_prefill_kernel")
DEVICE_NAMES = (("engine_check.json", "gpu"), ("gpu_kernels.json", "device"), ("decode_roofline.json", "device_name"))


@dataclass
class Goal:
    """One row of the table."""

    goal: str
    asked: str
    measured: str = "not run"
    where: str = ""
    met: bool | None = None  # None: not run


def load(results: list[Path]) -> Path:
    """One folder of a session's results: each results.tgz or folder in turn, later files replacing earlier."""
    if len(results) == 1 and results[0].is_dir():
        return results[0]
    folder = Path(tempfile.mkdtemp(prefix="gpu-goals-"))
    for result in results:
        if result.is_dir():
            shutil.copytree(result, folder, dirs_exist_ok=True)
        else:
            with tarfile.open(result) as tar:
                tar.extractall(folder, filter="data")
    return folder


def read_json(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def pytest_summary(folder: Path, stage: str) -> tuple[str, bool] | None:
    """(pytest's last summary line, whether the stage exited 0 having passed tests) of a pytest stage's output:
    a stage whose tests all skipped (no GPU seen) checked nothing."""
    path = folder / f"{stage}.txt"
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    summaries = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)\b.*?)\s*=*$", text, re.M)
    exit_line = re.findall(r"^exit (\d+) after", text, re.M)
    summary = summaries[-1] if summaries else "no summary (timed out?)"
    return summary, bool(exit_line) and exit_line[-1] == "0" and " passed" in f" {summary}"


def at_least(goal: Goal, value: float | None, floor: float, where: str, fmt: str = "{:.2f}x") -> Goal:
    if value is not None:
        goal.measured, goal.where, goal.met = fmt.format(value), where, value >= floor
    return goal


def roofline_goals(roof: dict | None) -> list[Goal]:
    rows = {(r["adapters"], r["batch"]): r for r in (roof or {}).get("rows", [])}
    goals = []
    for adapters, floor in ((8, 0.85), (32, 0.80)):
        row = rows.get((adapters, 64))
        goals.append(at_least(Goal(f"{adapters} adapters vs the base model, batch 64", f">= {floor:.2f}x"),
                              row and row["of_base"], floor, "decode_roofline.py (Llama-3-8B shapes, rank 16)"))
    base = rows.get((0, 1))
    goals.append(at_least(Goal("8B-shaped bf16 decode at batch 1, of its HBM roofline", ">= 70%"),
                          base and base["of_roofline"], 0.70, "decode_roofline.py", "{:.0%}"))
    return goals


def kernel_goals(kernels: dict | None) -> list[Goal]:
    kernels = kernels or {}
    lora = [(r["peak_fraction"], f"BGMV batch {r['batch']} ranks {r['ranks']}") for r in kernels.get("bgmv", [])]
    lora += [(r["group_hbm"], f"fused q/k/v batch {r['batch']}") for r in kernels.get("lora_variants", [])
             if r.get("group_hbm") is not None]
    decode = [(r["peak_fraction"], f"batch {r['batch']} context {r['context']}") for r in kernels.get("decode", [])]
    goals = []
    for name, floor, rows in (("BGMV/SGMV, of HBM bandwidth (best row)", 0.50, lora),
                              ("paged decode attention, of HBM bandwidth (best row)", 0.60, decode)):
        best = max(rows, default=None)
        goals.append(at_least(Goal(name, f">= {floor:.0%}"), best and best[0], floor,
                              f"gpu_kernels.py, {best[1]}" if best else "", "{:.0%}"))
    return goals


def exactness_goal(folder: Path, triton: dict | None, kernels: dict | None) -> Goal:
    parts, ok = [], True
    for stage in ENGINE_CHECKS:
        check = read_json(folder, f"{stage}.json")
        if check:
            parts.append(f"{stage} {check['matched']}/{check['requests']}")
            ok &= check["matched"] == check["requests"]
    if triton and triton.get("exact"):
        parts.append(f"triton_gpu {triton['exact']['matched']}/{triton['exact']['requests']}")
        ok &= triton["exact"]["matched"] == triton["exact"]["requests"]
    if kernels and kernels.get("numerics"):
        bad = [r for r in kernels["numerics"] if r.get("ok") is False]
        parts.append(f"gpu_kernels numerics {len(kernels['numerics']) - len(bad)}/{len(kernels['numerics'])}")
        ok &= not bad
    for stage in EXACT_STAGES:
        summary = pytest_summary(folder, stage)
        if summary:
            parts.append(f"{stage}: {summary[0]}")
            ok &= summary[1]
    goal = Goal("every GPU path exact against its reference", "all")
    if parts:
        goal.measured, goal.where, goal.met = "; ".join(parts), "engine_check, triton_gpu, gpu_kernels, tests", ok
    return goal


def goals(folder: Path) -> list[Goal]:
    """Every goal of issue 43, from the session's JSON and stage outputs."""
    triton, kernels = read_json(folder, "triton_gpu.json"), read_json(folder, "gpu_kernels.json")
    served = at_least(Goal("through Triton vs in-process (served / in-process tokens/s)", ">= 0.90x"),
                      triton and triton.get("served_over_in_process"), 0.90, "triton_gpu.py")
    return [*roofline_goals(read_json(folder, "decode_roofline.json")),
            *kernel_goals(kernels), served, exactness_goal(folder, triton, kernels)]


def device_name(folder: Path) -> str:
    """torch's name of the device, from the first stage that reports one."""
    for name, key in DEVICE_NAMES:
        report = read_json(folder, name)
        if report and report.get(key):
            return report[key]
    return "unknown device"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, nargs="+",
                    help="results.tgz of gpu_session.sh, or the folder it was unpacked into; several: later ones win")
    ap.add_argument("--json", dest="json_path", type=Path, default=None, help="write the rows to this JSON file")
    args = ap.parse_args(argv)
    folder = load(args.results)
    rows = goals(folder)
    print(f"Device: {device_name(folder)}\n")
    print("| goal | asked | measured | where | met |\n|---|---|---|---|---|")
    for g in rows:
        met = "not run" if g.met is None else ("**met**" if g.met else "**not met**")
        print(f"| {g.goal} | {g.asked} | {g.measured} | {g.where} | {met} |")
    if args.json_path:
        args.json_path.write_text(json.dumps([asdict(g) for g in rows], indent=2) + "\n")
    return 0 if all(g.met is not False for g in rows) and any(g.met for g in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
