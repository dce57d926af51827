"""The tenants file: validation, key lookup, development mode, reload without a restart."""

from __future__ import annotations

import json
import logging
import os

import pytest

from loraplex import tenancy
from loraplex.tenancy import (AUTH_ERROR, InvalidApiKey, TenantResolver, TenantsFile, TenantsFileError, key_digest,
                              load_tenants_file, new_key, parse_tenants)


def entry(key: str, **fields) -> dict:
    return {"api_key_sha256": key_digest(key).hex(), **fields}


def write(path, tenants: dict) -> None:
    path.write_text(json.dumps({"tenants": tenants}))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_defaults_and_all_fields():
    full = entry("k1", weight=2.5, max_concurrent_requests=64, max_queued_requests=256, max_adapters=16,
                 max_adapter_rank=64, max_adapter_bytes=268435456, tokens_per_minute=0)
    tenants = parse_tenants({"tenants": {"acme": full, "globex": entry("k2")}})
    acme, globex = tenants["acme"], tenants["globex"]
    assert (acme.weight, acme.max_concurrent_requests, acme.max_adapter_bytes) == (2.5, 64, 268435456)
    assert acme.api_key_digest == key_digest("k1")
    assert (globex.weight, globex.max_queued_requests, globex.tokens_per_minute) == (1, 0, 0)


@pytest.mark.parametrize("data, message", [
    ([], "expected {\"tenants\""),
    ({"tenants": {}, "extra": 1}, "expected {\"tenants\""),
    ({"tenants": {"a b": entry("k")}}, "tenant name 'a b'"),
    ({"tenants": {"acme": "x"}}, "tenant 'acme': expected a JSON object"),
    ({"tenants": {"acme": {}}}, "tenant 'acme': api_key_sha256 must be"),
    ({"tenants": {"acme": {"api_key_sha256": "ab" * 31}}}, "tenant 'acme': api_key_sha256"),
    ({"tenants": {"acme": entry("k", wieght=1)}}, "tenant 'acme': unknown field\\(s\\) wieght"),
    ({"tenants": {"acme": entry("k", weight=0)}}, "tenant 'acme': weight must be > 0"),
    ({"tenants": {"acme": entry("k", weight="1")}}, "tenant 'acme': weight must be a number"),
    ({"tenants": {"acme": entry("k", max_adapters=-1)}}, "tenant 'acme': max_adapters must be an integer >= 0"),
    ({"tenants": {"acme": entry("k", max_adapter_rank=1.5)}}, "tenant 'acme': max_adapter_rank must be an integer"),
    ({"tenants": {"acme": entry("k", tokens_per_minute=True)}}, "tenant 'acme': tokens_per_minute"),
    ({"tenants": {"acme": entry("k"), "globex": entry("k")}}, "'acme' and 'globex' have the same api_key_sha256"),
])
def test_invalid_files_name_tenant_and_field(data, message):
    with pytest.raises(TenantsFileError, match=message):
        parse_tenants(data)


def test_unreadable_file_names_the_path(tmp_path):
    bad = tmp_path / "tenants.json"
    bad.write_text("{nope")
    with pytest.raises(TenantsFileError, match=str(bad)):
        load_tenants_file(bad)
    with pytest.raises(TenantsFileError, match="No such file"):
        load_tenants_file(tmp_path / "missing.json")


def test_new_key_hash_matches():
    key, digest = new_key()
    assert len(key) >= 40 and key_digest(key).hex() == digest


def test_development_mode_names_the_tenant():
    resolver = TenantResolver(None)
    assert resolver.resolve({"x-tenant-id": "t1", "tenant": "t2"}) == "t1"
    assert resolver.resolve({"tenant": "t2"}) == "t2"
    assert resolver.resolve({"x-api-key": "whatever"}) == "default"


def test_key_establishes_the_tenant_and_claims_are_ignored(tmp_path, monkeypatch):
    path = tmp_path / "tenants.json"
    write(path, {"acme": entry("key-a"), "globex": entry("key-g")})
    compared = []
    real = tenancy.hmac.compare_digest
    monkeypatch.setattr(tenancy.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    resolver = TenantResolver(path)
    assert resolver.resolve({"x-api-key": "key-a", "x-tenant-id": "globex", "tenant": "globex"}) == "acme"
    assert len(compared) == 2  # every tenant's digest is compared, the match does not stop the loop
    assert resolver.resolve({"api_key": "key-g"}) == "globex"
    for parameters in ({}, {"x-api-key": "nope"}, {"api_key": 7}, {"x-tenant-id": "acme"}, {"x-api-key": ""}):
        with pytest.raises(InvalidApiKey) as err:
            resolver.resolve(parameters)
        assert str(err.value) == AUTH_ERROR


def test_reload_within_the_window_and_broken_edit_keeps_last_good(tmp_path, caplog):
    path, clock = tmp_path / "tenants.json", Clock()
    write(path, {"acme": entry("key-a")})
    tenants = TenantsFile(path, clock=clock)
    write(path, {"acme": entry("key-a"), "initech": entry("key-i", weight=3)})
    assert tenants.tenant_for_key("key-i") is None  # checked at most once a second
    clock.now = 1.0
    assert tenants.tenant_for_key("key-i").weight == 3
    path.write_text('{"tenants": {"acme": ')
    clock.now = 2.0
    with caplog.at_level(logging.ERROR, logger="loraplex.tenancy"):
        assert tenants.tenant_for_key("key-i").name == "initech"
        clock.now = 3.0
        assert tenants.tenant_for_key("key-a").name == "acme"
    assert len([r for r in caplog.records if "keeping the last good one" in r.message]) == 1
    os.remove(path)
    clock.now = 4.0
    assert tenants.tenant_for_key("key-a").name == "acme"  # a vanished file keeps the last good one too
    write(path, {"initech": entry("key-i")})
    clock.now = 5.0
    assert tenants.tenant_for_key("key-a") is None and tenants.tenant_for_key("key-i").name == "initech"


def test_first_load_must_succeed(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": 1}')
    with pytest.raises(TenantsFileError):
        TenantResolver(path)
    with pytest.raises(TenantsFileError, match="No such file"):
        TenantResolver(tmp_path / "missing.json")
