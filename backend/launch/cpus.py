"""How many CPUs this process may actually use: its affinity, capped by a cgroup CPU quota.

A thread pool sized to the visible cores collapses when a CFS quota allows fewer (its threads are
throttled at their barriers), so the pools are sized from usable_cpus() (decision 056).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The cgroup folders of this process that may hold a CPU quota (v2 unified, v1 cpu controller)."""
    dirs = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2
            dirs += [root / rel, root]
        elif "cpu" in controllers.split(","):
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                dirs += [root / name / rel, root / name]
    return dirs + [root]


def _read_quota(folder: Path) -> float | None:
    """CPUs allowed by the quota in ``folder`` (None: no quota there, or unreadable)."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs, maybe fractional) among this process's cgroups; None when none."""
    quotas = [q for d in dict.fromkeys(_own_cgroup_dirs(root, proc_cgroup)) if (q := _read_quota(d))]
    return min(quotas) if quotas else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs this process may use: its affinity set, capped by the cgroup quota rounded down (at least 1).

    Rounded down: a 1.5-CPU quota runs one busy thread unthrottled; two would each be stopped a
    quarter of every period, and a pool waits at its barriers for the slowest."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)
