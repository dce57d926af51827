"""The response thread's cancellation schedule: every request asked about every interval, round
robin, never more asks a second than the cap (no server: a simulated clock)."""

from collections import Counter

from loraplex.triton.responder import CancelPolls


def simulate(live: int, seconds: float, tick: float = 0.02, interval: float = 0.1, rate: float = 200):
    """Ask as the response thread does (due, then keep), every `tick`; count asks per request."""
    polls = CancelPolls(interval, rate)
    pending = {f"r{i}": None for i in range(live)}
    for request_id in pending:
        polls.add(request_id)
    asked = Counter()
    for step in range(round(seconds / tick) + 1):
        due = polls.due(step * tick, pending)
        asked.update(due)
        polls.keep(due)
    return asked


def test_few_requests_are_each_asked_about_every_interval():
    asked = simulate(live=4, seconds=2.0)
    assert set(asked) == {f"r{i}" for i in range(4)}
    assert all(18 <= n <= 21 for n in asked.values()), asked  # 2 s / 0.1 s


def test_many_requests_share_the_cap_evenly():
    asked = simulate(live=100, seconds=2.0)
    assert 390 <= sum(asked.values()) <= 401  # 200 a second, not 100 / 0.1 s = 1000
    assert set(asked.values()) <= {3, 4, 5}  # round robin: everyone about every 0.5 s


def test_new_requests_are_asked_first_and_ended_ones_cost_nothing():
    polls = CancelPolls(interval=1.0, rate=200)
    pending = {"old": None}
    polls.add("old")
    polls.keep(polls.due(0.0, pending) + polls.due(1.0, pending))
    polls.add("ended")
    polls.add("new")
    pending["new"] = None
    assert polls.due(1.5, pending) == ["new"]  # half an interval's credit for 2 live requests: one ask
    assert polls.due(2.0, pending) == ["old"]  # "ended" was skipped without using the credit
    assert "ended" not in polls.order
