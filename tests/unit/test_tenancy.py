"""The tenants file: validation, key lookup, development mode, reload without a restart."""

from __future__ import annotations

import json
import logging
import os

import pytest

from loraplex.tenancy import tenants as tenancy
from loraplex.exceptions import AUTH_ERROR
from loraplex.tenancy.tenants import TenantResolver, TenantsFile, key_digest, load_tenants_file, new_key, parse_tenants
from loraplex.exceptions import InvalidApiKey, TenantsFileError


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
    assert acme.tokens_per_minute == 0  # an explicit 0: unlimited
    absent = (globex.weight, globex.max_concurrent_requests, globex.max_queued_requests, globex.tokens_per_minute,
              globex.max_adapters, globex.max_adapter_rank, globex.max_adapter_bytes)
    assert absent == (1, 64, 256, 1_000_000, 16, 0, 268435456)  # a field left out: the documented default
    assert (acme.queue_fraction, globex.queue_fraction) == (2.5 / 3.5, 1 / 3.5)
    assert TenantResolver(None).resolve_tenant({"tenant": "t"}).max_queued_requests == 0  # development: no quotas


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


@pytest.mark.parametrize("text, message", [
    ('{"tenants": {"acme": %s, "acme": %s}}', "'acme' appears twice in one JSON object"),
    ('{"tenants": {"acme": {"api_key_sha256": "%s", "weight": 1, "weight": 2}}}',
     "'weight' appears twice in one JSON object"),
])
def test_duplicate_names_or_fields_are_refused_not_collapsed(tmp_path, text, message):
    path = tmp_path / "tenants.json"
    one, two = json.dumps(entry("key-1")), json.dumps(entry("key-2"))
    path.write_text(text % ((one, two) if text.count("%s") == 2 else key_digest("k").hex()))
    with pytest.raises(TenantsFileError) as err:
        load_tenants_file(path)
    assert str(err.value) == f"{path}: {message} (a duplicate tenant name?)"


def test_duplicate_key_hashes_are_refused_in_any_case(tmp_path):
    path = tmp_path / "tenants.json"
    digest = key_digest("shared").hex()
    write(path, {"acme": {"api_key_sha256": digest}, "globex": {"api_key_sha256": digest.upper()}})
    with pytest.raises(TenantsFileError) as err:
        load_tenants_file(path)
    assert str(err.value) == f"{path}: tenants 'acme' and 'globex' have the same api_key_sha256"


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
    failures = []
    tenants.on_failure = lambda: failures.append(tenants.reload_failures)
    with caplog.at_level(logging.ERROR, logger="loraplex.tenancy.tenants"):
        assert tenants.tenant_for_key("key-i").name == "initech"
        assert tenants.tenant_for_key("key-i").name == "initech"  # within the second: not checked again
        clock.now = 3.0
        assert tenants.tenant_for_key("key-a").name == "acme"  # unchanged and still broken: an ERROR again
        os.remove(path)
        clock.now = 4.0
        assert tenants.tenant_for_key("key-a").name == "acme"  # a vanished file keeps the last good one too
        clock.now = 5.0
        tenants.refresh()  # checked without a lookup too (the model's watch thread)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.message.split(": ")[0] for r in errors] == ["tenants file not reloaded, keeping the last good one "
                                                          "(2 tenant(s))"] * 4
    assert "No such file" in errors[2].message and failures == [1, 2, 3, 4] and tenants.reload_failures == 4
    write(path, {"initech": entry("key-i")})
    clock.now = 6.0
    assert tenants.tenant_for_key("key-a") is None and tenants.tenant_for_key("key-i").name == "initech"
    clock.now = 7.0
    tenants.refresh()
    assert tenants.reload_failures == 4  # good again: nothing more counted


def test_first_load_must_succeed(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": 1}')
    with pytest.raises(TenantsFileError):
        TenantResolver(path)
    with pytest.raises(TenantsFileError, match="No such file"):
        TenantResolver(tmp_path / "missing.json")
