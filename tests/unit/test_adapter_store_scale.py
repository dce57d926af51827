"""The adapter store at 10,000 adapters: per-request work reads a bounded number of files and walks no folder;
shared adapters loaded at run time are versioned, resolved per request, and refused or replaced as vLLM does."""

from __future__ import annotations

import copy
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraplex.exceptions import AdapterNotFound, AdapterStoreError
from loraplex.lora.catalog import MAX_NAMES_TEXT, AdapterCatalog, names_text, shared_key, tenant_key
from loraplex.lora.store import MAX_PAGE, SHARED_DIR, AdapterStore, tenant_dir_name
from loraplex.tenancy.tenants import Tenant

N = 10_000
ACME = Tenant("acme", b"a")


def _pointer(folder: Path, name: str, version: str) -> None:
    (folder / f"{name}.json").write_text(json.dumps({
        "name": name, "version": version, "digest": "0" * 64, "rank": 4, "target_modules": ["q_proj"],
        "bytes": 1, "created": 0.0}))


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> AdapterStore:
    """N uploads of acme, N shared adapters loaded at run time, N shared folders (pointers and tiny files)."""
    root = tmp_path_factory.mktemp("big") / "store"
    own = root / ".tenants" / tenant_dir_name("acme") / "adapters"
    loaded = root / SHARED_DIR / "adapters"
    own.mkdir(parents=True)
    loaded.mkdir(parents=True)
    for i in range(N):
        _pointer(own, f"own-{i:05d}", "v1")
        _pointer(loaded, f"loaded-{i:05d}", "v2")
        (root / f"folder-{i:05d}").mkdir()
        (root / f"folder-{i:05d}" / "adapter_config.json").write_text("{}")
    settle(own, loaded, root)
    return AdapterStore(root)


def settle(*folders: Path) -> None:
    """Date the folders' last change 10 s back: past NAME_SETTLE_NS, so their listings may be reused."""
    for folder in folders:
        stamp = folder.stat().st_mtime - 10
        os.utime(folder, (stamp, stamp))


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of os.listdir/os.scandir/os.stat/open while the test runs (what 'no scan' means)."""
    counts: Counter = Counter()
    for module, name in ((os, "listdir"), (os, "scandir"), (os, "stat"), (io, "open")):
        real = getattr(module, name)

        def counted(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, counted)
    return counts


def test_resolving_at_10000_adapters_reads_one_file_and_lists_no_folder(big_store, calls):
    catalog = AdapterCatalog(big_store, {"multi": "/models/multi"})
    cases = [
        ("own-09999", (tenant_key("acme", "own-09999", "v1"), None, True)),
        ("loaded-04321", (shared_key("loaded-04321", "v2"), None, True)),
        ("multi", ("multi", "/models/multi", False)),
        ("folder-00007", ("folder-00007", str(big_store.root / "folder-00007"), True)),
    ]
    for name, (key, path, lazily) in cases:
        calls.clear()
        got = catalog.resolve("acme", name)
        assert (got[0], got[2]) == (key, lazily) and (path is None or got[1] == path)
        assert calls["listdir"] == calls["scandir"] == 0, (name, calls)
        assert calls["open"] + calls["stat"] <= 4, (name, calls)


def test_the_unknown_lora_error_lists_about_2000_characters_and_how_many_more(big_store, calls):
    catalog = AdapterCatalog(big_store, {})
    with pytest.raises(AdapterNotFound) as err:
        catalog.resolve("acme", "no-such")
    message = err.value.args[0]
    assert message.startswith("LoRA no-such is not supported, we currently support ['folder-00000', ")
    listed = message[message.index("["):message.index("]") + 1]
    assert MAX_NAMES_TEXT - 20 < len(listed) <= MAX_NAMES_TEXT
    shown = listed.count("'") // 2
    assert message.endswith(f"] and {3 * N - shown} more")
    assert calls["listdir"] <= 3 and calls["scandir"] == 0  # 0 once the listings are cached
    assert calls["open"] <= 2 and calls["stat"] <= 2 * (MAX_NAMES_TEXT // 4) + 10  # a bounded window's folders


def test_pages_cover_every_name_once_and_read_only_their_own_entries(big_store, calls):
    seen, after, pages = [], "", 0
    big_store.page("acme")  # lists the three folders (at most 3 listdirs); later pages stat them only
    while True:
        calls.clear()
        page = big_store.page("acme", after, MAX_PAGE, extra_shared={"multi"})
        assert calls["listdir"] == calls["scandir"] == 0
        assert calls["open"] <= MAX_PAGE and calls["stat"] <= MAX_PAGE + 10
        seen += page.names()
        pages += 1
        if page.next is None:
            break
        after = page.next
    assert pages == -(-(3 * N + 1) // MAX_PAGE)
    assert len(seen) == len(set(seen)) == 3 * N + 1 and seen == sorted(seen)
    first = big_store.page("acme", "", 5)
    assert first.shared == [f"folder-{i:05d}" for i in range(5)] and first.next == "folder-00004"
    assert [a.name for a in big_store.page("acme", "own-09997").own] == ["own-09998", "own-09999"]
    assert big_store.page("globex", "loaded-09999").names() == []  # acme's uploads are not globex's
    assert len(big_store.page("acme", "", 10**9).names()) == MAX_PAGE  # the limit is bounded


def test_a_folder_listing_is_reused_until_the_folder_changes(tmp_path, calls):
    store = AdapterStore(tmp_path / "store")
    folder = tmp_path / "store" / ".shared" / "adapters"
    folder.mkdir(parents=True)
    _pointer(folder, "a", "v1")
    calls.clear()
    assert store.names(folder, ".json") == ("a",) and calls["listdir"] == 1
    assert store.names(folder, ".json") == ("a",) and calls["listdir"] == 2  # changed just now: listed again
    settle(folder)
    store.names(folder, ".json")
    calls.clear()
    assert store.names(folder, ".json") == ("a",) and calls["listdir"] == 0 and calls["stat"] == 1
    _pointer(folder, "b", "v1")  # the folder's mtime moves
    assert store.names(folder, ".json") == ("a", "b") and calls["listdir"] == 1


def test_names_text_cuts_at_the_limit():
    assert names_text(["a", "b"], 2) == "['a', 'b']"
    assert names_text(["a", "b"], 7) == "['a', 'b'] and 5 more"
    assert names_text(["abc"] * 10, 10, limit=21) == "['abc', 'abc', 'abc'] and 7 more"


# shared adapters loaded at run time --------------------------------------------------


def _files(model, tmp_path: Path, seed: int, r: int = 4) -> tuple[str, bytes]:
    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights=False))
    folder = tmp_path / f"peft-{seed}-{r}"
    pm.save_pretrained(str(folder))
    return (folder / "adapter_config.json").read_text(), (folder / "adapter_model.safetensors").read_bytes()


def test_loaded_shared_adapters_are_versioned_refused_without_inplace_and_unloaded(tmp_path, base_model, hf_config):
    store = AdapterStore(tmp_path / "store")
    catalog = AdapterCatalog(store, {})
    a, b = _files(base_model, tmp_path, 1), _files(base_model, tmp_path, 2)
    v1 = store.load_shared("sql", *a, hf_config, 16)
    assert catalog.resolve("anyone", "sql") == (shared_key("sql", v1.version), str(v1.path), True)
    with pytest.raises(AdapterStoreError, match="The lora adapter 'sql' has already been loaded"):
        store.load_shared("sql", *b, hf_config, 16)
    v2 = store.load_shared("sql", *b, hf_config, 16, replace=True)
    assert v2.version != v1.version and v1.path.is_dir()  # in-flight requests keep v1 for the grace period
    assert catalog.resolve("acme", "sql")[0] == shared_key("sql", v2.version)
    assert store.page("acme").shared == ["sql"]
    assert store.unload_shared("sql") == v2
    with pytest.raises(AdapterNotFound, match="The lora adapter 'sql' cannot be found."):
        store.unload_shared("sql")
    with pytest.raises(AdapterNotFound, match="LoRA sql is not supported, we currently support \\[\\]"):
        catalog.resolve("acme", "sql")


def test_loading_validates_exactly_as_an_upload(tmp_path, base_model, hf_config):
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(AdapterStoreError, match="rank 8"):
        store.load_shared("big", *_files(base_model, tmp_path, 3, r=8), hf_config, 4)
    with pytest.raises(AdapterStoreError, match="invalid adapter name"):
        store.load_shared("../x", *_files(base_model, tmp_path, 3), hf_config, 16)
    config, weights = _files(base_model, tmp_path, 3)
    with pytest.raises(AdapterStoreError):
        store.load_shared("cut", config, weights[:-10], hf_config, 16)
    assert store.page("acme").names() == []


def test_a_shared_folder_needs_inplace_and_cannot_be_unloaded(tmp_path, base_model, hf_config):
    store = AdapterStore(tmp_path / "store")
    config, weights = _files(base_model, tmp_path, 4)
    (store.root / "demo").mkdir(parents=True)
    (store.root / "demo" / "adapter_config.json").write_text(config)
    (store.root / "demo" / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(AdapterStoreError, match="already been loaded"):
        store.load_shared("demo", config, weights, hf_config, 16)
    store.load_shared("x", config, weights, hf_config, 16)
    with pytest.raises(AdapterStoreError, match="not one loaded at run time"):
        store.unload_shared("demo")
    loaded = store.load_shared("demo", config, weights, hf_config, 16, replace=True)
    assert AdapterCatalog(store, {}).resolve("t", "demo")[0] == shared_key("demo", loaded.version)


def test_an_upload_of_the_same_name_wins_for_its_tenant_only(tmp_path, base_model, hf_config):
    store = AdapterStore(tmp_path / "store")
    files = _files(base_model, tmp_path, 5)
    shared = store.load_shared("x", *files, hf_config, 16)
    own = store.upload(ACME, "x", *files, hf_config, 16)
    catalog = AdapterCatalog(store, {})
    assert catalog.resolve("acme", "x")[0] == tenant_key("acme", "x", own.version)
    assert catalog.resolve("globex", "x")[0] == shared_key("x", shared.version)


def test_a_name_in_several_places_is_listed_and_counted_once(tmp_path):
    store = AdapterStore(tmp_path / "store")
    for name in ("a", "b"):
        (store.root / name).mkdir(parents=True)
        (store.root / name / "adapter_config.json").write_text("{}")
    own = store.root / ".tenants" / tenant_dir_name("acme") / "adapters"
    own.mkdir(parents=True)
    _pointer(own, "a", "v1")
    page = store.page("acme", extra_shared={"a", "c"})
    assert page.names() == ["a", "b", "c"] and page.total == 3 and page.next is None
    assert [s.name for s in page.own] == ["a"] and page.shared == ["a", "b", "c"]
    with pytest.raises(AdapterNotFound) as err:
        AdapterCatalog(store, {"a": "/x", "c": "/y"}).resolve("acme", "bogus")
    assert err.value.args[0] == "LoRA bogus is not supported, we currently support ['a', 'b', 'c']"
