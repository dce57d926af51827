"""The admission pool: tenants in turn, a flooding tenant delays only itself, bounded backlog, one end per job."""

from __future__ import annotations

import threading
import time

import pytest

from loraplex.exceptions import EngineOverloaded, EngineShuttingDown, QuotaExceeded
from loraplex.triton.admission import AdmissionPool, Job


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.ran, self.failed = [], []
        self.done = threading.Event()

    def job(self, tenant, name, seconds=0.0, size=1, release: threading.Event | None = None) -> Job:
        def run():
            if release is not None:
                release.wait(10)
            time.sleep(seconds)
            with self.lock:
                self.ran.append((name, time.monotonic()))

        def fail(exc):
            with self.lock:
                self.failed.append((name, str(exc)))

        return Job(tenant, size, run, fail)

    def wait_for(self, name, timeout=10.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for ran, at in self.ran:
                    if ran == name:
                        return at
            time.sleep(0.001)
        raise AssertionError(f"{name} did not run within {timeout} s")


def test_a_flooding_tenant_leaves_a_worker_for_the_others():
    pool, rec = AdmissionPool(workers=2), Recorder()
    for i in range(20):
        pool.submit(rec.job("A", f"a{i}", seconds=0.2))  # each as slow as tokenizing a max-size prompt
    time.sleep(0.05)
    start = time.monotonic()
    pool.submit(rec.job("B", "b0"))
    latency = rec.wait_for("b0") - start
    assert latency < 0.1, latency  # not behind A's 20 x 0.2 s: A holds one worker at most
    assert pool.backlog("A") >= 18  # A's requests run one at a time, in order
    pool.close()
    rec.wait_for("a0")  # a job on a worker when the pool closes runs to its end (its own answer)
    ran = [name for name, _ in rec.ran if name.startswith("a")]
    assert ran == [f"a{i}" for i in range(len(ran))]
    assert len(rec.failed) == 20 - len(ran) and all(m == "the model is shutting down; the request did not start"
                                                    for _, m in rec.failed)


def test_tenants_take_turns_one_job_each():
    pool, rec, gate = AdmissionPool(workers=1), Recorder(), threading.Event()
    pool.submit(rec.job("X", "x", release=gate))  # holds the only worker while the others queue
    time.sleep(0.05)
    for i in range(3):
        pool.submit(rec.job("A", f"a{i}"))
    pool.submit(rec.job("B", "b0"))
    pool.submit(rec.job("C", "c0"))
    gate.set()
    rec.wait_for("a2")
    assert [name for name, _ in rec.ran] == ["x", "a0", "b0", "c0", "a1", "a2"]
    pool.close()


def test_the_backlog_is_bounded_per_tenant_and_a_tenant_with_none_always_gets_one_in():
    pool, rec, gate = AdmissionPool(workers=1, tenant_backlog_chars=100), Recorder(), threading.Event()
    pool.submit(rec.job("X", "x", release=gate))
    time.sleep(0.05)
    pool.submit(rec.job("A", "big", size=500))  # over the bound alone, but A has nothing waiting
    with pytest.raises(QuotaExceeded) as err:
        pool.submit(rec.job("A", "more", size=1))
    assert str(err.value) == ("tenant quota exceeded: 1 requests of this tenant (500 characters) are waiting to be "
                              "tokenized; retry later")
    pool.submit(rec.job("B", "b", size=100))  # another tenant is unaffected
    gate.set()
    rec.wait_for("b")
    pool.close()


def test_development_mode_has_a_global_bound_and_a_closed_pool_refuses():
    pool, gate = AdmissionPool(workers=1, max_backlog_chars=10), threading.Event()
    rec = Recorder()
    pool.submit(rec.job("X", "x", release=gate))
    time.sleep(0.05)
    pool.submit(rec.job("t1", "a", size=8))
    with pytest.raises(EngineOverloaded) as err:
        pool.submit(rec.job("t2", "b", size=8))
    assert str(err.value) == "server overloaded: 8 characters of prompts are waiting to be tokenized; retry later"
    gate.set()
    pool.close()
    with pytest.raises(EngineShuttingDown):
        pool.submit(rec.job("t1", "late"))
    rec.wait_for("x")
    time.sleep(0.05)
    names = sorted([n for n, _ in rec.ran] + [n for n, _ in rec.failed])
    assert names == ["a", "x"]  # each job ended exactly once, run or failed
