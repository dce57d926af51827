"""Preemption as a last resort: an admission cap that backs off when preemptions thrash.

Each step records how many sequences it preempted. When more than ``threshold``
preemptions fall within the last ``window`` steps, the cap on running sequences drops to
half of what was running (multiplicative decrease; the window restarts, so one burst
lowers it once). After ``window`` consecutive steps without a preemption it doubles, up
to ``max_num_seqs``. The cap only gates admission: nothing running is evicted by it, and
an empty batch always admits its head, so a cap of 1 still makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class AdmissionCap:
    """Running-sequence cap lowered under sustained preemption and raised again when calm."""

    limit: int  # max_num_seqs
    window: int  # steps
    threshold: int  # preemptions allowed within the window
    value: int = 0
    num_lowered: int = 0
    num_raised: int = 0
    _recent: deque = field(default_factory=deque)
    _sum: int = 0
    _quiet: int = 0

    def __post_init__(self) -> None:
        self.value = self.value or self.limit

    def record(self, num_preempted: int, num_running: int) -> None:
        """Account for one step: preemptions it made, sequences running after it."""
        recent = self._recent
        if len(recent) == self.window:
            self._sum -= recent.popleft()
        recent.append(num_preempted)
        self._sum += num_preempted
        if self._sum > self.threshold:
            self.value = max(1, min(self.value, num_running + num_preempted) // 2)
            self.num_lowered += 1
            recent.clear()
            self._sum = self._quiet = 0
        elif num_preempted:
            self._quiet = 0
        else:
            self._quiet += 1
            if self._quiet >= self.window and self.value < self.limit:
                self.value = min(self.limit, self.value * 2)
                self.num_raised += 1
                self._quiet = 0
