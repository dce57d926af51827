"""usable_cpus: the affinity set, capped by a cgroup v2 or v1 CPU quota read from (fake) cgroup files."""

import pytest

from loraplex import config
from loraplex.launch import cpus


def _v2(tmp_path, cpu_max: str | None):
    (tmp_path / "cg" / "app").mkdir(parents=True)
    if cpu_max is not None:
        (tmp_path / "cg" / "app" / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/app\n")
    return tmp_path / "cg", proc


def _v1(tmp_path, quota: int, period: int):
    folder = tmp_path / "cg" / "cpu,cpuacct" / "app"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/app\n0::/\n")
    return tmp_path / "cg", proc


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


@pytest.mark.parametrize("cpu_max, quota, usable", [
    ("max 100000", None, 4), ("150000 100000", 1.5, 1), ("200000 100000", 2.0, 2),
    ("50000 100000", 0.5, 1), ("800000 100000", 8.0, 4)])
def test_cgroup_v2_quota_caps_the_affinity(tmp_path, four_cpus, cpu_max, quota, usable):
    root, proc = _v2(tmp_path, cpu_max)
    assert cpus.cgroup_cpu_quota(root, proc) == quota
    assert cpus.usable_cpus(root, proc) == usable


@pytest.mark.parametrize("quota, period, usable", [(-1, 100000, 4), (300000, 100000, 3), (150000, 100000, 1)])
def test_cgroup_v1_quota_caps_the_affinity(tmp_path, four_cpus, quota, period, usable):
    root, proc = _v1(tmp_path, quota, period)
    assert cpus.usable_cpus(root, proc) == usable


def test_no_cgroup_files_means_the_affinity(tmp_path, four_cpus):
    assert cpus.usable_cpus(tmp_path / "none", tmp_path / "missing") == 4
    root, proc = _v2(tmp_path, None)
    assert cpus.usable_cpus(root, proc) == 4


def test_garbage_in_cpu_max_is_ignored(tmp_path, four_cpus):
    root, proc = _v2(tmp_path, "lots of cpus")
    assert cpus.usable_cpus(root, proc) == 4


def test_the_thread_knobs_follow_the_quota(monkeypatch, four_cpus):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda *a: 2.5)
    assert config.native_cpu_threads() == 2
    assert config.serving_cpu_threads() == 1
    assert config.native_cpu_threads(3) == 3  # an explicit knob wins


def test_the_server_env_sleeps_idle_openmp_threads():
    from loraplex.launch.tritonserver import server_env

    class Install:
        lib_dirs = ()
    assert server_env(Install(), base={})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert server_env(Install(), base={"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
