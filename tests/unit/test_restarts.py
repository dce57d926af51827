"""loraplex-serve's restart policy: which exits of tritonserver are faults to restart, and the restart budget.

``serve()`` runs against a fake server whose every run ends as planned (no process is started).
"""

from __future__ import annotations

import io
import signal
import time
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraplex.launch.restarts import RESTART, STOP_WITH_IT, RestartBudget, after_exit
from loraplex.launch.serve import main, serve


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Proc:
    def __init__(self, returncode: int | None):
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


class FakeServer:
    """Each start() begins the next planned run: ready at once, then as planned: (returncode, logged a stop), or
    (returncode, logged a stop, the crash signal it logged, whether it still answers, whether its HTTP port listens).
    A returncode of None: it still runs."""

    http_url, grpc_url, metrics_url, http_port, env = "http://h:1", "h:2", "http://h:3/metrics", 1, {}
    exit_timeout_secs, ready_timeout, log_path = 5, 1.0, Path("/nonexistent/tritonserver.log")

    def __init__(self, runs: list[tuple]):
        self.runs, self.starts, self.stops = runs, 0, []
        self.proc, self.logged_stop, self.logged_crash, self.serving, self.listening = None, False, None, True, False
        self.readiness_asked = 0

    @property
    def pid(self) -> int:
        return 100 + self.starts

    def start(self):
        returncode, self.logged_stop, self.logged_crash, self.serving, self.listening = \
            (*self.runs[self.starts], None, True, False)[:5]
        self.proc, self.readiness_asked = _Proc(returncode), 0
        self.starts += 1
        return self

    def is_ready(self) -> bool:
        self.readiness_asked += 1
        return self.readiness_asked == 1 or self.serving  # ready at first, then as planned

    def signalled(self) -> bool:
        return self.logged_stop

    def crash_signal(self) -> int | None:
        return self.logged_crash

    def forget_crash_signal(self) -> None:
        self.logged_crash = None

    def stubs(self, include_dead: bool = False) -> list[int]:
        return []

    def http_listening(self) -> bool:
        return self.listening

    def stop(self, grace: float = 10.0):
        self.stops.append(grace)
        if self.proc.returncode is None:
            self.proc.returncode = -signal.SIGKILL if grace == 0 else 0
        return self.proc.returncode

    def log_tail(self, max_bytes: int = 8000) -> str:
        return "I1201 the last log line"


class StopAfter:
    """A stop request that is on once the server has been started ``n`` times (and asked ``looks`` times more)."""

    def __init__(self, server: FakeServer, n: int, looks: int = 0):
        self.server, self.n, self.looks = server, n, looks

    def __bool__(self) -> bool:
        if self.server.starts < self.n:
            return False
        self.looks -= 1
        return self.looks < 0


def run_serve(runs: list[tuple], budget: RestartBudget, stop_after: int = 99, looks: int = 0):
    server, err = FakeServer(runs), io.StringIO()
    with redirect_stderr(err):
        rc = serve(server, StopAfter(server, stop_after, looks), {"lora_name": None}, quiet=True, budget=budget)
    return rc, err.getvalue(), server


@pytest.mark.parametrize("returncode, logged_stop, verdict", [
    (-signal.SIGABRT, False, RESTART),  # the Python backend's lock_exception after a stub died
    (-signal.SIGSEGV, False, RESTART),
    (-signal.SIGKILL, False, RESTART),  # the OOM killer
    (-signal.SIGSEGV, True, STOP_WITH_IT),  # an operator's SIGTERM, then a crash past the exit timeout
    (0, True, STOP_WITH_IT),  # an operator's SIGTERM, a clean unload
    (0, False, STOP_WITH_IT),
    (1, False, STOP_WITH_IT),  # it gave up on its own (a model that failed to load)
])
def test_only_a_death_by_a_signal_it_was_not_asked_to_stop_with_is_restarted(returncode, logged_stop, verdict):
    assert after_exit(returncode, logged_stop) == verdict
    rc, err, server = run_serve([(returncode, logged_stop), (0, False)], RestartBudget(), stop_after=2)
    if verdict == RESTART:
        name = signal.Signals(-returncode).name
        assert rc == 0 and server.starts == 2  # restarted, then stopped by the operator's request
        assert f"tritonserver died by {name} (it was not asked to stop); restarting tritonserver" in err, err
    else:
        assert rc == 1 and server.starts == 1, err
        assert f"tritonserver exited with code {returncode}" in err and "restarting" not in err


def test_a_logged_crash_of_a_server_that_stopped_answering_is_restarted(monkeypatch):
    """Wedged in its crash handler: "Signal (6) received." logged, alive, not answering past the grace."""
    monkeypatch.setattr("loraplex.launch.serve.CRASH_GRACE_S", 0.0)
    rc, err, server = run_serve([(None, False, int(signal.SIGABRT), False, True), (0, False)], RestartBudget(),
                                stop_after=2)
    assert rc == 0 and server.starts == 2 and server.stops[0] == 0
    assert "tritonserver died by SIGABRT (it was not asked to stop); restarting tritonserver" in err


def test_log_lines_are_believed_only_with_what_they_imply(monkeypatch):
    """A crash line from a server that still answers, a stop line from one whose port stays open: nothing is done."""
    monkeypatch.setattr("loraplex.launch.serve.CRASH_GRACE_S", 0.0)
    monkeypatch.setattr("loraplex.launch.serve.time", SimpleNamespace(monotonic=time.monotonic,
                                                                       sleep=lambda s: time.sleep(s / 25)))
    rc, err, server = run_serve([(None, True, int(signal.SIGABRT), True, True)], RestartBudget(), stop_after=1,
                                looks=3)  # the stop request's look before the run, then two rounds of the watch
    assert rc == 0 and server.starts == 1 and server.stops == []  # the operator's stop request ended it
    assert "the log says tritonserver got signal 6, but it still serves 0 s later: not a crash of it, ignored" in err
    assert "shutting down" not in err and "restarting" not in err
    rc, err, server = run_serve([(None, True)], RestartBudget())  # the port closed: someone's stop
    assert rc == 1 and "tritonserver is shutting down (signalled by someone else)" in err


def test_the_budget_allows_max_restarts_in_any_window():
    clock = FakeClock()
    budget = RestartBudget(5, 600, clock=clock)
    assert [budget.take() for _ in range(6)] == [True] * 5 + [False]
    clock.now += 599.9
    assert not budget.take()  # all five are still within the window
    clock.now += 0.1
    assert [budget.take() for _ in range(6)] == [True] * 5 + [False]  # the five left it together
    clock.now += 300
    assert not budget.take()
    assert not RestartBudget(0, 600, clock=clock).take()  # 0: never restart


def test_a_crash_loop_past_the_budget_exits_1_naming_the_budget():
    clock = FakeClock()
    rc, err, server = run_serve([(-signal.SIGABRT, False)] * 10, RestartBudget(3, 600, clock=clock))
    assert rc == 1 and server.starts == 4  # the first run and three restarts
    assert err.count("tritonserver died by SIGABRT (it was not asked to stop); restarting tritonserver") == 3
    last = err.strip().splitlines()
    assert last[-2] == ("loraplex-serve: tritonserver died by SIGABRT (it was not asked to stop); restart budget spent: "
                        "tritonserver was already restarted 3 time(s) in the last 600 s (at most --max-restarts 3 "
                        "per --restart-window 600); not restarting it again, exiting; last log lines:")
    assert last[-1] == "I1201 the last log line"


def test_restarts_spread_over_more_than_the_window_go_on():
    clock = FakeClock()

    class Ticking(StopAfter):  # each look at the stop request is a window later
        def __bool__(self) -> bool:
            clock.now += 601
            return super().__bool__()

    server, err = FakeServer([(-signal.SIGKILL, False)] * 4), io.StringIO()
    with redirect_stderr(err):
        rc = serve(server, Ticking(server, 4), {"lora_name": None}, quiet=True, budget=RestartBudget(1, 600, clock))
    assert rc == 0 and server.starts == 4 and err.getvalue().count("restarting tritonserver") == 3


def test_the_budget_flags_are_checked_before_anything_starts(capsys):
    assert main(["--model-dir", "/nonexistent", "--max-restarts", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("loraplex-serve: --max-restarts must be >= 0 (got -1) and "
                                               "--restart-window > 0 (got 600)")
    assert main(["--model-dir", "/nonexistent", "--restart-window", "0"]) == 2
    assert "--restart-window > 0 (got 0)" in capsys.readouterr().err
