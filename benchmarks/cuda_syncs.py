"""Synchronizing CUDA operations per engine step, counted with torch's sync debug mode (goal 5 of issue 11).

torch warns at every operation that makes the host wait for the device (``.item()``,
``.tolist()``, a blocking copy, ``nonzero``); ``SyncCounter.step`` runs one engine step with
those warnings recorded and attributes each to the line that raised it and to whether it ran
inside the forward (``model.forward`` or a decode graph's replay). CuPy launches are not
torch operations and never warn: they do not synchronize.
"""

from __future__ import annotations

import statistics
import warnings
from collections import Counter
from functools import wraps

import torch

SYNC_WARNING = "synchronizing CUDA operation"


def _syncs(caught: list) -> list:
    """The recorded warnings that report a synchronizing operation."""
    return [w for w in caught if SYNC_WARNING in str(w.message)]


class SyncCounter:
    """Wraps an engine's forward entry points; step() runs engine.step() and counts its syncs."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.per_step: list[int] = []
        self.in_forward = 0
        self.where: Counter = Counter()
        self._caught: list = []
        runner = engine.runner
        runner.model.forward = self._counting(runner.model.forward)
        if runner.graphs is not None:
            runner.graphs.run = self._counting(runner.graphs.run)

    def _counting(self, fn):
        @wraps(fn)
        def forward(*args, **kwargs):
            before = len(self._caught)
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_forward += len(_syncs(self._caught[before:]))
        return forward

    def step(self) -> list:
        """engine.step() with every synchronizing operation recorded; returns its outputs."""
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._caught = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = self.engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                self._caught = []
        syncs = _syncs(caught)
        self.where.update(f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in syncs)
        self.per_step.append(len(syncs))
        return outputs

    def summary(self) -> dict:
        """Steps counted, syncs per step (median, max), syncs inside the forward, and the lines that raised them."""
        return {"steps": len(self.per_step), "per_step_median": statistics.median(self.per_step or [0]),
                "per_step_max": max(self.per_step, default=0), "in_forward": self.in_forward,
                "where": dict(self.where.most_common())}
