"""Per-tenant bookkeeping that must stay exact and bounded: quotas, metric labels, adapter versions."""

from __future__ import annotations

import pytest

from loraplex.lora.catalog import AdapterCatalog, AdapterVersions, tenant_key
from loraplex.lora.manager import AdapterNotFound
from loraplex.metrics import OTHER_TENANTS, TenantLabels
from loraplex.quotas import WINDOW_SECONDS, QuotaExceeded, TenantQuotas
from loraplex.request import Request, SamplingParams
from loraplex.tenancy import Tenant


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def request(tenant="acme", prompt_tokens=10, limits=None, lora=None, key=None, path=None):
    params = SamplingParams(lora_name=lora) if lora else SamplingParams()
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


def test_tokens_per_minute_counts_prompt_and_generated_tokens_over_a_sliding_minute():
    clock = Clock()
    quotas, limits = TenantQuotas(clock), Tenant("acme", b"k", tokens_per_minute=40)
    first = request(prompt_tokens=30, limits=limits)
    quotas.accept(first)
    quotas.accept(request(prompt_tokens=5, limits=limits))  # 35 < 40: still accepted
    quotas.served(first, 5)
    with pytest.raises(QuotaExceeded, match=r"tokens_per_minute=40 \(40 tokens served in the last 60 s\)"):
        quotas.accept(request(prompt_tokens=1, limits=limits))
    clock.now += WINDOW_SECONDS - 1
    with pytest.raises(QuotaExceeded):
        quotas.accept(request(prompt_tokens=1, limits=limits))
    clock.now += 1.5  # the first second's tokens leave the window
    quotas.accept(request(prompt_tokens=100, limits=limits))  # the request that crosses the limit is served


def test_a_refused_request_counts_nothing():
    quotas, limits = TenantQuotas(Clock()), Tenant("acme", b"k", max_queued_requests=1, tokens_per_minute=10)
    quotas.accept(request(prompt_tokens=20, limits=limits))
    refused = request(limits=limits)
    with pytest.raises(QuotaExceeded):
        quotas.accept(refused)
    assert not refused.queued and quotas.queued("acme") == 1


# ---- metric labels ---------------------------------------------------------------------------------
def test_development_tenant_labels_are_bounded_and_the_rest_are_other():
    labels = TenantLabels(max_distinct=3)
    assert [labels.label(f"t{i}", False) for i in range(5)] == ["t0", "t1", "t2", OTHER_TENANTS, OTHER_TENANTS]
    assert labels.label("t1", False) == "t1"
    assert labels.label("known-from-the-tenants-file", True) == "known-from-the-tenants-file"


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
