"""The adapter preloader serves tenants by fair queuing on the work their reads cost (decision 060).

Work is counted, not timed: each read advances a fake clock by its cost (a DoRA read 10 units, a plain one 1),
and a first read held on an event lets every later read queue before the worker picks one.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from loraplex.lora.preloader import AdapterPreloader, lane_of

COST = {"dora": 10.0, "plain": 1.0, "gate": 1.0}


class Held:
    """A preloader whose reads cost COST[kind] on a fake clock; the read of 'gate' waits for ``release``."""

    def __init__(self):
        self.now, self.reads = 0.0, []
        self.started, self.release = threading.Event(), threading.Event()
        self.delivered: queue.SimpleQueue = queue.SimpleQueue()
        self.preloader = AdapterPreloader(self.read, lambda req, got: self.delivered.put((req.tenant, got)),
                                          clock=lambda: self.now)

    def read(self, name, folder):
        if name == "gate":
            self.started.set()
            assert self.release.wait(30)
        self.reads.append(name)
        self.now += COST[name.split("-")[0]]
        return name

    def submit(self, tenant, name):
        self.preloader.submit(SimpleNamespace(tenant=tenant, request_id=name), name, f"/adapters/{name}")

    def hold(self, tenant="mallory"):
        self.submit(tenant, "gate")
        assert self.started.wait(30)

    def run(self, count):
        self.release.set()
        order = [self.delivered.get(timeout=30)[1] for _ in range(count)]
        self.preloader.close()
        return order


def test_a_tenant_queueing_dora_reads_delays_anothers_cold_load_by_the_read_in_progress_only():
    held = Held()
    held.hold()
    for i in range(5):
        held.submit("mallory", f"dora-{i}")
    held.submit("alice", "plain-0")
    order = held.run(7)
    assert order[:2] == ["gate", "plain-0"]  # FIFO would serve it last, after five DoRA reads


def test_the_work_a_lane_caused_is_charged_to_it():
    """Mallory is charged 10 per DoRA read, alice 1 per plain read: alice's reads go between mallory's."""
    held = Held()
    held.hold()
    for i in range(3):
        held.submit("mallory", f"dora-{i}")
    for i in range(3):
        held.submit("alice", f"plain-{i}")
    order = held.run(7)
    assert order == ["gate", "plain-0", "dora-0", "plain-1", "plain-2", "dora-1", "dora-2"]
    assert held.preloader.charged() == {"mallory": 31.0}  # alice's lane, idle and behind, is forgotten


def test_an_idle_lane_banks_no_credit():
    """A lane idle while another worked starts level with the read being served, not where it stopped."""
    held = Held()
    held.hold("alice")
    for i in range(3):
        held.submit("mallory", f"dora-{i}")
    held.release.set()
    assert [held.delivered.get(timeout=30)[1] for _ in range(4)] == ["gate", "dora-0", "dora-1", "dora-2"]
    held.started.clear()
    held.release.clear()
    held.hold("bob")  # mallory: 30 charged; virtual time 20 (the last read's start)
    held.submit("mallory", "dora-3")
    for i in range(15):
        held.submit("alice", f"plain-{i}")  # alice stopped at 1: with that credit all 15 would go first
    order = held.run(17)
    assert order.index("dora-3") == 11  # after bob's gate and the 10 plain reads that bring alice to 30


def test_requests_of_one_lane_for_a_queued_adapter_share_its_read():
    held = Held()
    held.hold()
    for _ in range(3):
        held.submit("alice", "plain-0")
    held.submit("bob", "plain-0")  # another lane: a read of its own
    assert held.preloader.loading() == 2  # gate and plain-0
    order = held.run(5)
    assert order == ["gate", "plain-0", "plain-0", "plain-0", "plain-0"]
    assert held.reads == ["gate", "plain-0", "plain-0"] and held.preloader.loading() == 0


@pytest.mark.parametrize("request_,name,lane", [
    (SimpleNamespace(tenant="acme"), "acme/x@1", "acme"),
    (SimpleNamespace(tenant="acme"), "shared-a", "acme"),
    ("a re-read", "acme/x@1", "acme"),
    ("a re-read", ":shared/x@1", ":shared"),
    ("a re-read", "demo-a", ""),
])
def test_a_read_is_charged_to_the_requests_tenant_or_the_keys_owner(request_, name, lane):
    assert lane_of(request_, name) == lane
