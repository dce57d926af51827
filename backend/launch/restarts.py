"""When loraplex-serve restarts tritonserver: what counts as a fault, and a budget of restarts per window.

A fault is a dead Python-backend stub (Triton 2.51 never restarts a decoupled model's stub)
or a tritonserver that died by a signal it was not asked to stop with: SIGABRT (the Python
backend's ``boost::interprocess::lock_exception`` after a stub died), SIGSEGV, SIGKILL
from the OOM killer. An operator's stop is SIGINT or SIGTERM, which tritonserver logs
("Signal (15) received.") before it closes its ports and shuts down; a server stopped so
is being stopped whatever it dies of afterwards (it often crashes past its exit timeout).
A server that exits with a status (0 or an error code) ended on its own. In both cases
loraplex-serve stops with it (exit 1). Why: docs/decisions/063-launcher-restarts-on-a-crash.md.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from typing import Callable

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 600.0

RESTART, STOP_WITH_IT = "restart", "stop with it"


def after_exit(returncode: int, logged_stop_signal: bool) -> str:
    """What to do once tritonserver has exited: RESTART (it died of a fault) or STOP_WITH_IT (someone stopped it,
    or it exited on its own)."""
    if logged_stop_signal or returncode >= 0:
        return STOP_WITH_IT
    return RESTART


def signal_name(returncode: int) -> str:
    """``SIGABRT`` for a returncode of -6 (Popen's form of a death by signal)."""
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class RestartBudget:
    """At most ``max_restarts`` restarts in any ``window_s`` seconds; past it the launcher gives up."""

    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS, window_s: float = DEFAULT_RESTART_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0 or window_s <= 0:
            raise ValueError(f"--max-restarts must be >= 0 (got {max_restarts}) and --restart-window > 0 "
                             f"(got {window_s:g})")
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._times: deque[float] = deque()

    def take(self) -> bool:
        """Record one restart if the budget has room for it now; False (nothing recorded) if it is spent."""
        now = self.clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def spent_text(self) -> str:
        """The line the launcher exits with once the budget is spent."""
        return (f"restart budget spent: tritonserver was already restarted {len(self._times)} time(s) in the last "
                f"{self.window_s:g} s (at most --max-restarts {self.max_restarts} per --restart-window "
                f"{self.window_s:g}); not restarting it again, exiting")
