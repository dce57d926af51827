"""Per-tenant bookkeeping that must stay exact and bounded: quotas, metric labels, adapter versions."""

from __future__ import annotations

import pytest

from loraplex.lora.catalog import AdapterCatalog, AdapterVersions, tenant_key
from loraplex.lora.store import Page
from loraplex.exceptions import AdapterNotFound, EngineOverloaded, InvalidRequest, QueueFull, QuotaExceeded
from loraplex.engine.metrics import OTHER_TENANTS, TenantLabels
from loraplex.tenancy.quotas import WINDOW_SECONDS, TenantQuotas
from loraplex.engine.request import Request, SamplingParams
from loraplex.tenancy.tenants import Tenant


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def request(tenant="acme", prompt_tokens=10, limits=None, lora=None, key=None, path=None, n=1, max_tokens=16):
    params = SamplingParams(n=n, max_tokens=max_tokens, lora_name=lora)
    return Request(f"r-{id(params)}", "", [1] * prompt_tokens, params, tenant, limits=limits, adapter_key=key,
                   adapter_path=path)


# ---- quotas --------------------------------------------------------------------------------------
def test_max_queued_requests_refuses_beyond_the_quota_and_frees_on_start_or_end():
    quotas, limits = TenantQuotas(), Tenant("acme", b"k", max_queued_requests=2)
    first, second = request(limits=limits), request(limits=limits)
    quotas.accept(first)
    quotas.accept(second)
    with pytest.raises(QuotaExceeded, match=r"max_queued_requests=2 \(2 requests of this tenant are waiting\)"):
        quotas.accept(request(limits=limits))
    quotas.accept(request("globex", limits=Tenant("globex", b"g", max_queued_requests=2)))  # other tenants unaffected
    quotas.started(first)
    quotas.started(first)  # idempotent: an end after the start counts nothing
    quotas.accept(request(limits=limits))
    assert quotas.queued("acme") == 2


def test_queue_state_is_dropped_when_a_tenant_holds_nothing():
    quotas = TenantQuotas()
    reqs = [request(f"tenant-{i}") for i in range(1000)]
    for r in reqs:
        quotas.accept(r)
    for r in reqs:
        quotas.started(r)
    assert quotas.tracked_tenants() == 0


def test_tokens_per_minute_reserves_prompt_plus_n_max_tokens_at_acceptance():
    clock = Clock()
    quotas, limits = TenantQuotas(clock=clock), Tenant("acme", b"k", tokens_per_minute=100)
    first = request(prompt_tokens=10, limits=limits, n=2, max_tokens=20)  # may use 10 + 2 x 20 = 50
    quotas.accept(first)
    assert (quotas.used("acme"), quotas.outstanding("acme"), first.reserved_tokens) == (50, 40, 40)
    quotas.accept(request(prompt_tokens=10, limits=limits, max_tokens=40))  # 50 + 50 = 100: fits exactly
    with pytest.raises(QuotaExceeded) as err:
        quotas.accept(request(prompt_tokens=1, limits=limits, max_tokens=1))
    assert str(err.value) == ("tenant quota exceeded: tokens_per_minute=100 (100 tokens served or reserved in the "
                              "last 60 s, this request may use 2); retry later")
    quotas.served(first, 5)  # generated tokens move from the reservation into the window: no change in use
    assert (quotas.used("acme"), quotas.outstanding("acme"), first.reserved_tokens) == (100, 75, 35)
    quotas.ended(first)  # it stopped after 5 of its 40: the other 35 come back at once
    assert (quotas.used("acme"), quotas.outstanding("acme"), first.reserved_tokens) == (65, 40, 0)
    quotas.ended(first)  # once only
    assert quotas.used("acme") == 65
    quotas.accept(request(prompt_tokens=5, limits=limits, max_tokens=30))
    clock.now += WINDOW_SECONDS + 1  # served tokens leave the window; reservations stay until their requests end
    assert quotas.used("acme") == 70 and quotas.outstanding("acme") == 70


def test_a_request_that_could_never_fit_tokens_per_minute_is_invalid():
    quotas, limits = TenantQuotas(clock=Clock()), Tenant("acme", b"k", tokens_per_minute=1000)
    with pytest.raises(InvalidRequest) as err:
        quotas.accept(request(prompt_tokens=10, limits=limits, n=16, max_tokens=8190))
    assert str(err.value) == ("the request may use 131050 tokens (prompt 10 + n 16 x max_tokens 8190), more than "
                              "the tenant's tokens_per_minute=1000; lower max_tokens or n")
    assert quotas.used("acme") == 0 and quotas.queued("acme") == 0


def test_a_token_served_after_its_request_ended_still_counts():
    quotas, limits = TenantQuotas(clock=Clock()), Tenant("acme", b"k", tokens_per_minute=100)
    r = request(prompt_tokens=4, limits=limits, n=2, max_tokens=1)
    quotas.accept(r)
    quotas.served(r, 1)
    quotas.ended(r)  # both samples finished in one step: the request ends before the second token is counted
    quotas.served(r, 1)
    assert (quotas.used("acme"), quotas.outstanding("acme")) == (6, 0)


def test_a_refused_request_counts_nothing():
    quotas, limits = TenantQuotas(clock=Clock()), Tenant("acme", b"k", max_queued_requests=1, tokens_per_minute=100)
    quotas.accept(request(prompt_tokens=20, limits=limits))
    refused = request(limits=limits)
    with pytest.raises(QuotaExceeded):
        quotas.accept(refused)
    assert not refused.queued and refused.reserved_tokens == 0 and quotas.queued("acme") == 1
    assert quotas.used("acme") == 36


# ---- the queue share -------------------------------------------------------------------------------
def authenticated(name, weight=1.0, total=2.0):
    return Tenant(name, b"k-" + name.encode(), weight=weight, queue_fraction=weight / total)


def test_a_flood_fills_its_part_and_the_shared_part_then_only_the_flooder_is_refused():
    quotas = TenantQuotas(max_waiting_requests=8, tenant_queue_share=0.5)  # 4 reserved: 2 each; 4 shared
    acme, globex = authenticated("acme"), authenticated("globex")
    flood = [request("acme", limits=acme) for _ in range(6)]  # its 2, then the 4 shared places
    for r in flood:
        quotas.accept(r)
    assert [r.borrowed for r in flood] == [False, False, True, True, True, True]
    with pytest.raises(QueueFull) as err:
        quotas.accept(request("acme", limits=acme))
    assert str(err.value) == ("tenant quota exceeded: 6 requests of this tenant are waiting, its share of the queue "
                              "is 2 (max_waiting_requests=8) and the shared part is full; retry later")
    mine = [request("globex", limits=globex) for _ in range(2)]
    for r in mine:
        quotas.accept(r)  # below its part: accepted though the queue "looks full"
    with pytest.raises(QueueFull):
        quotas.accept(request("globex", limits=globex))  # over its part, and nothing shared is free
    assert quotas.share.total() == 8  # never more than max_waiting_requests
    quotas.started(flood[5])  # a shared place frees: anyone over its part may take it
    quotas.accept(request("globex", limits=globex))
    quotas.started(flood[0])  # acme's own place frees: only acme's next request may use it
    with pytest.raises(QueueFull):
        quotas.accept(request("globex", limits=globex))
    quotas.accept(request("acme", limits=acme))
    assert quotas.share.total() == 8 and quotas.share.borrowed == 4


def test_queue_parts_follow_weights_and_every_tenant_has_at_least_one_place():
    share = TenantQuotas(max_waiting_requests=100, tenant_queue_share=0.5).share
    assert share.part(request("a", limits=authenticated("a", 3, 4))) == 37  # floor(50 x 3/4)
    assert share.part(request("b", limits=authenticated("b", 1, 4))) == 12
    assert share.part(request("c", limits=authenticated("c", 1, 1000))) == 1
    assert share.shared(request("a", limits=authenticated("a", 3, 4))) == 50


def test_development_mode_keeps_the_plain_global_bound():
    quotas = TenantQuotas(max_waiting_requests=2, tenant_queue_share=0.5)
    quotas.accept(request("t1"))
    quotas.accept(request("t2", limits=Tenant("t2", b"")))
    with pytest.raises(EngineOverloaded) as err:
        quotas.accept(request("t3"))
    assert type(err.value) is EngineOverloaded
    assert str(err.value) == "server overloaded: 2 requests are waiting (max_waiting_requests=2); retry later"


def test_queue_state_is_exact_whatever_order_requests_leave_in():
    quotas = TenantQuotas(max_waiting_requests=6, tenant_queue_share=0.5)
    acme = authenticated("acme", 1, 1)  # part 3, 3 shared
    reqs = [request("acme", limits=acme) for _ in range(6)]
    for r in reqs:
        quotas.accept(r)
    for r in reversed(reqs[:4]):  # two borrowed, two own places leave, newest first
        quotas.ended(r)
    assert (quotas.share.total(), quotas.share.borrowed) == (2, 2)
    quotas.accept(request("acme", limits=acme))  # below its part again: an own place
    assert quotas.share.borrowed == 2 and quotas.share.own == {"acme": 1}
    for r in reqs[4:]:
        quotas.started(r)
    assert quotas.share.borrowed == 0 and quotas.share.waiting == {"acme": 1} == quotas.share.own


# ---- metric labels ---------------------------------------------------------------------------------
def test_development_tenant_labels_are_bounded_and_the_rest_are_other():
    labels = TenantLabels(max_distinct=3)
    assert [labels.label(f"t{i}", False) for i in range(5)] == ["t0", "t1", "t2", OTHER_TENANTS, OTHER_TENANTS]
    assert labels.label("t1", False) == "t1"
    assert labels.label("known-from-the-tenants-file", True) == "known-from-the-tenants-file"


def test_hashed_tenant_labels_are_stable_per_salt_and_do_not_show_the_name():
    from loraplex.config import EngineConfig
    from loraplex.engine.metrics import hashed_tenant

    labels = TenantLabels.from_config(EngineConfig(metric_tenant_label="hash", metric_tenant_salt="s3"))
    assert labels.label("acme", True) == hashed_tenant("acme", "s3") == labels.label("acme", True)
    assert hashed_tenant("acme", "s3") == "t" + __import__("hashlib").sha256(b"2:s3:acme").hexdigest()[:12]
    assert len({hashed_tenant("acme", ""), hashed_tenant("acme", "s3"), hashed_tenant("globex", "s3")}) == 3
    assert "acme" not in labels.label("acme", True)
    dev = TenantLabels(max_distinct=1, hashed=True)
    assert [dev.label("a", False), dev.label("b", False)] == [hashed_tenant("a"), OTHER_TENANTS]
    with pytest.raises(ValueError, match="metric_tenant_label must be 'name' or 'hash'"):
        EngineConfig.from_dict({"metric_tenant_label": "sha"})


# ---- adapter versions ------------------------------------------------------------------------------
class Registry:
    """Records what AdapterVersions registers with the AdapterManager."""

    def __init__(self):
        self.paths = {}

    def register(self, name, path):
        self.paths[name] = path

    def unregister(self, name):
        if name not in self.paths:
            raise AdapterNotFound(name)
        del self.paths[name]


def uploaded(tenant, name, version):
    return request(tenant, lora=name, key=tenant_key(tenant, name, version), path=f"/store/{tenant}/{name}/{version}")


def test_a_request_keeps_its_version_and_a_superseded_one_goes_when_its_last_user_ends():
    registry = Registry()
    versions = AdapterVersions(registry, max_idle=4)
    old, new = uploaded("acme", "support", "v1"), uploaded("acme", "support", "v2")
    versions.use(old)
    versions.use(new)  # replaced while `old` runs
    assert set(registry.paths) == {old.adapter_key, new.adapter_key}
    versions.done(old)
    assert set(registry.paths) == {new.adapter_key}
    versions.done(new)
    assert set(registry.paths) == {new.adapter_key}  # current and idle: kept for the next request (host copy)
    versions.use(uploaded("acme", "support", "v2"))
    assert versions.registered() == 1


def test_idle_versions_are_bounded():
    registry = Registry()
    versions = AdapterVersions(registry, max_idle=3)
    for i in range(50):
        r = uploaded(f"tenant-{i}", "a", "v1")
        versions.use(r)
        versions.done(r)
    assert versions.registered() == 3 and len(registry.paths) == 3


def test_same_name_in_two_tenants_are_two_versions():
    registry = Registry()
    versions = AdapterVersions(registry, max_idle=4)
    a, b = uploaded("acme", "support", "v1"), uploaded("globex", "support", "v1")
    versions.use(a)
    versions.use(b)
    versions.done(a)
    versions.done(b)
    assert set(registry.paths) == {a.adapter_key, b.adapter_key}


class Store:
    """Just enough of AdapterStore for the catalog: tenant -> {name: version}."""

    def __init__(self, uploads):
        self.uploads = uploads

    def lookup(self, tenant, name):
        version = self.uploads.get(tenant, {}).get(name)
        if version is None:
            return None
        return type("Stored", (), {"name": name, "version": version, "path": f"/store/{tenant}/{name}"})()

    def list(self, tenant):
        return [self.lookup(tenant, n) for n in sorted(self.uploads.get(tenant, {}))]

    def lookup_shared(self, name):
        return None

    def shared_folder(self, name):
        return None

    def page(self, tenant, after="", limit=1000, extra_shared=(), read=True):
        names = sorted(set(self.uploads.get(tenant, {})) | set(extra_shared))
        return Page(self.list(tenant), sorted(extra_shared), None, len(names))


def test_catalog_resolves_own_uploads_first_then_shared_and_hides_other_tenants():
    catalog = AdapterCatalog(Store({"acme": {"support": "v1", "demo-a": "v7"}, "globex": {"secret": "v1"}}),
                             {"demo-a": "/shared/demo-a", "demo-b": "/shared/demo-b"})
    assert catalog.resolve("acme", "demo-a") == (tenant_key("acme", "demo-a", "v7"), "/store/acme/demo-a", True)
    assert catalog.resolve("globex", "demo-a") == ("demo-a", "/shared/demo-a", False)
    with pytest.raises(AdapterNotFound) as other:
        catalog.resolve("acme", "secret")
    with pytest.raises(AdapterNotFound) as missing:
        catalog.resolve("acme", "no-such")
    assert str(other.value).replace("secret", "X") == str(missing.value).replace("no-such", "X")
    assert "we currently support ['demo-a', 'demo-b', 'support']" in str(other.value)


def test_shared_names_with_a_slash_are_refused():
    with pytest.raises(ValueError, match="must not contain '/'"):
        AdapterCatalog(None, {"a/b": "/x"})
