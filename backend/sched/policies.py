"""Scheduling policies as named functions: admission order keys and preemption victims.

An admission key orders *new* waiting sequences (smallest first); it never changes while a
sequence waits, so a heap keeps the order. SJF's aging is linear in waiting time, and
``max_tokens - rate * (now - arrival)`` orders like ``max_tokens + rate * arrival``, which
is constant: aging costs nothing per step.

A victim policy picks which running sequence to preempt when one cannot get a KV block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

from loraplex.engine.request import Sequence

AdmissionKey = Callable[[Sequence], tuple]
VictimPolicy = Callable[[Seq[Sequence]], Sequence]


def fcfs_key(seq: Sequence) -> tuple:
    """First come, first served: arrival time, then engine order."""
    return (seq.request.arrival_time, seq.seq_id)


def priority_key(seq: Sequence) -> tuple:
    """Lower `priority` first (as vLLM), then arrival."""
    return (seq.request.params.priority, seq.request.arrival_time, seq.seq_id)


def sjf_key(aging_rate: float) -> AdmissionKey:
    """Shortest job (max_tokens) first; each second waited counts as `aging_rate` fewer max_tokens."""

    def key(seq: Sequence) -> tuple:
        arrival = seq.request.arrival_time
        return (seq.request.params.max_tokens + aging_rate * arrival, arrival, seq.seq_id)

    return key


def admission_key(policy: str, sjf_aging_rate: float = 0.0) -> AdmissionKey:
    """The key function of a named admission policy (fcfs | priority | sjf)."""
    if policy == "fcfs":
        return fcfs_key
    if policy == "priority":
        return priority_key
    if policy == "sjf":
        return sjf_key(sjf_aging_rate)
    raise ValueError(f"unknown admission policy {policy!r}")


def longest_first(running: Seq[Sequence]) -> Sequence:
    """The sequence with the most generated tokens (frees the most blocks); ties: the latest arrival."""
    return max(running, key=lambda s: (s.num_output_tokens, s.request.arrival_time, s.seq_id))


def most_preempted_last(running: Seq[Sequence]) -> Sequence:
    """Among the least-preempted sequences, the one with the most generated tokens; ties: the latest arrival."""
    return max(running, key=lambda s: (-s.num_preemptions, s.num_output_tokens, s.request.arrival_time, s.seq_id))


def lowest_priority(running: Seq[Sequence]) -> Sequence:
    """The sequence with the largest `priority` value (lowest priority); ties: the latest arrival."""
    return max(running, key=lambda s: (s.request.params.priority, s.request.arrival_time, s.seq_id))


VICTIM_POLICIES: dict[str, VictimPolicy] = {
    "longest_first": longest_first,
    "most_preempted_last": most_preempted_last,
    "lowest_priority": lowest_priority,
}
