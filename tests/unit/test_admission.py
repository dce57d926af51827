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
        self.started, self.ran, self.failed = [], [], []

    def job(self, tenant, name, seconds=0.0, size=1, release: threading.Event | None = None) -> Job:
        def run():
            with self.lock:
                self.started.append((name, time.monotonic()))
            if release is not None:
                release.wait(10)
            time.sleep(seconds)
            with self.lock:
                self.ran.append((name, time.monotonic()))

        def fail(exc):
            with self.lock:
                self.failed.append((name, str(exc)))

        return Job(tenant, size, run, fail)

    def wait_for(self, name, timeout=10.0, started=False) -> float:
        """When job ``name`` ended its run (or started it); fails after ``timeout`` (a hung test's guard)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for ran, at in self.started if started else self.ran:
                    if ran == name:
                        return at
            time.sleep(0.001)
        raise AssertionError(f"{name} did not {'start' if started else 'run'} within {timeout} s")

    def ended(self) -> list[str]:
        """Names of the jobs that ran or failed, in that order."""
        with self.lock:
            return [n for n, _ in self.ran] + [n for n, _ in self.failed]


def test_a_flooding_tenant_leaves_a_worker_for_the_others():
    pool, rec, gate = AdmissionPool(workers=2), Recorder(), threading.Event()
    for i in range(20):
        pool.submit(rec.job("A", f"a{i}", release=gate))  # each as slow as tokenizing a max-size prompt, or more
    rec.wait_for("a0", started=True)
    pool.submit(rec.job("B", "b0"))
    rec.wait_for("b0")  # while a0 still holds its worker: B is not behind A's jobs
    assert [name for name, _ in rec.started] == ["a0", "b0"] and pool.backlog("A") == 19  # A: one at a time
    gate.set()
    pool.close()
    rec.wait_for("a0")  # a job on a worker when the pool closes runs to its end (its own answer)
    for thread in pool._threads:
        thread.join(10)
    ran = [name for name, _ in rec.ran if name.startswith("a")]
    assert ran == [f"a{i}" for i in range(len(ran))]  # in order
    assert len(rec.failed) == 20 - len(ran) and all(m == "the model is shutting down; the request did not start"
                                                    for _, m in rec.failed)


def test_tenants_take_turns_one_job_each():
    pool, rec, gate = AdmissionPool(workers=1), Recorder(), threading.Event()
    pool.submit(rec.job("X", "x", release=gate))  # holds the only worker while the others queue
    rec.wait_for("x", started=True)
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
    rec.wait_for("x", started=True)
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
    rec.wait_for("x", started=True)  # on the worker: no longer in the backlog
    pool.submit(rec.job("t1", "a", size=8))
    with pytest.raises(EngineOverloaded) as err:
        pool.submit(rec.job("t2", "b", size=8))
    assert str(err.value) == "server overloaded: 8 characters of prompts are waiting to be tokenized; retry later"
    pool.close()  # while x runs and a waits
    with pytest.raises(EngineShuttingDown):
        pool.submit(rec.job("t1", "late"))
    gate.set()
    for thread in pool._threads:
        thread.join(10)  # the workers ended: nothing more can run
    assert sorted(rec.ended()) == ["a", "x"]  # each job ended exactly once, run or failed
