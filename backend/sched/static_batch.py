"""Request-level (static) batching, the baseline the benchmarks compare continuous batching with.

``batching="static"``: a batch is admitted only into an empty one and keeps its shape until its
last sequence ends. A sequence that ends its request keeps its blocks, pin and row (a *padding*
row: its final token's decode, rerun every step without advancing, its output dropped) until
then, as padded rows cost a static batch on any device; the padding gives way before any
sequence is preempted. ``batching="static-shrink"`` admits the same way but lets ended rows leave.
"""

from __future__ import annotations

from loraplex.engine.request import Sequence
from loraplex.sched.scheduler import Scheduler, SchedulerOutput


class StaticBatchScheduler(Scheduler):
    """The Scheduler with static batching's admission and, unless shrinking, its padding rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pads = self.config.batching == "static"  # ended sequences keep their rows until the batch ends
        self.padding: list[Sequence] = []  # those ended sequences (FINISHED), holding their blocks and pins

    def _release_ended_batch(self) -> None:
        """Release the padding once its batch has no running sequence left."""
        if self.padding and not self.running:
            self._release_padding()

    def _may_admit(self) -> bool:
        """Only into an empty batch."""
        return not self.running

    def _end_schedule(self, out: SchedulerOutput) -> None:
        """The ended sequences' rows: each its final token's decode again, into the slot it kept for it."""
        if not (self.padding and self.running):
            return
        for seq in self.padding:
            out.seqs.append(seq)
            out.num_new_tokens.append(1)
            out.block_tables.append(self.kv.block_table(seq.seq_id))
        out.num_padding = len(self.padding)

    def _make_room(self) -> bool:
        """The padding gives way before any sequence is preempted."""
        if not self.padding:
            return False
        self._release_padding()
        return True

    def _free_ended(self, seq: Sequence) -> None:
        """Keep the ended sequence's row (a slot for its final token) until the batch ends, when padding."""
        if self.pads and self.kv.allocate(seq.seq_id, seq.num_computed_tokens, 1):
            self.padding.append(seq)
        else:
            super()._free_ended(seq)

    def _release_padding(self) -> None:
        """Free the padding rows' blocks and pins: their batch ended, or a running sequence needs the blocks."""
        for seq in self.padding:
            super()._free_ended(seq)
        self.padding = []


def make_scheduler(config, *args, **kwargs) -> Scheduler:
    """The scheduler ``config.batching`` asks for: continuous (Scheduler) or static (StaticBatchScheduler)."""
    cls = Scheduler if config.batching == "continuous" else StaticBatchScheduler
    return cls(config, *args, **kwargs)
