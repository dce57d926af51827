"""AdapterStore: uploads validated before anything is stored, atomic versions, names, quotas, GC, flock."""

from __future__ import annotations

import copy
import fcntl
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save
from tiny_llama import tiny_config
from transformers import LlamaForCausalLM

from loraplex.lora.adapter import adapter_digest
from loraplex.exceptions import AdapterNotFound, AdapterStoreError, StoreFull
from loraplex.lora.store import COLLECT_INTERVAL_SECONDS, RETIRED_VERSION_GRACE_SECONDS, AdapterStore, Collector, TenantUsage, max_weights_bytes, tenant_dir_name
from loraplex.tenancy.tenants import Tenant

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 16
ACME, GLOBEX = Tenant("acme", b"a"), Tenant("globex", b"g")


def _peft_files(model, tmp_path_factory, seed: int, **kw) -> tuple[str, bytes]:
    kw.setdefault("r", 4)
    kw.setdefault("lora_alpha", 8)
    kw.setdefault("target_modules", ["q_proj", "v_proj"])
    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **kw))
    folder = tmp_path_factory.mktemp("peft")
    pm.save_pretrained(str(folder))
    return (folder / "adapter_config.json").read_text(), (folder / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def make(base_model, tmp_path_factory):
    """make(seed, **LoraConfig kwargs) -> (adapter_config.json text, adapter_model.safetensors bytes)."""
    return lambda seed=1, **kw: _peft_files(base_model, tmp_path_factory, seed, **kw)


@pytest.fixture(scope="module")
def good(make):
    return make(1)


@pytest.fixture(scope="module")
def other_model_files(tmp_path_factory):
    """A valid PEFT adapter of a different (wider) model: wrong shapes for ours."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(hidden_size=96)).eval()
    return _peft_files(model, tmp_path_factory, 5)


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "store")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with its sha256 (folders as 'dir'): what 'unchanged' means."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def upload(store, tenant, name, files, hf_config, max_rank=MAX_RANK):
    return store.upload(tenant, name, files[0], files[1], hf_config, max_rank)


# round trip --------------------------------------------------------------------------

def test_upload_lookup_list_info_delete(store, good, make, hf_config):
    stored = upload(store, ACME, "support", good, hf_config)
    assert (stored.tenant, stored.name, stored.rank, stored.target_modules) == ("acme", "support", 4,
                                                                                ("q_proj", "v_proj"))
    assert stored.digest == adapter_digest(good[0].encode(), good[1]) and stored.bytes == len(good[1])
    assert (stored.path / "adapter_model.safetensors").read_bytes() == good[1]
    assert (stored.path / "adapter_config.json").read_text() == good[0]
    assert stored.path == store.root / ".tenants" / tenant_dir_name("acme") / "versions" / "support" / stored.version
    assert store.lookup("acme", "support") == stored == store.info("acme", "support")
    upload(store, ACME, "billing", make(2, r=8, target_modules=ALL), hf_config)
    assert [a.name for a in store.list("acme")] == ["billing", "support"]
    assert store.list("acme")[0].target_modules == tuple(sorted(ALL))
    info = stored.to_json()
    assert set(info) == {"name", "version", "rank", "target_modules", "bytes", "digest", "created", "created_unix"}
    assert info["created"].endswith("Z") and abs(info["created_unix"] - time.time()) < 60
    assert str(store.root) not in json.dumps([a.to_json() for a in store.list("acme")])
    assert store.delete("acme", "support") == stored
    assert store.lookup("acme", "support") is None and [a.name for a in store.list("acme")] == ["billing"]
    with pytest.raises(AdapterNotFound) as info:
        store.delete("acme", "support")
    assert str(info.value.args[0]) == "adapter 'support' not found"


def test_tenant_folder_is_a_digest_and_names_its_tenant(store, good, hf_config):
    upload(store, ACME, "x", good, hf_config)
    tdir = store.root / ".tenants" / hashlib.sha256(b"acme").hexdigest()[:32]
    assert (tdir / "TENANT").read_text() == "acme\n"
    assert json.loads((tdir / "adapters" / "x.json").read_text())["name"] == "x"
    assert not list(store.root.rglob(".tmp-*"))


def test_shared_adapters_are_the_folders_under_the_root(store, good, hf_config):
    (store.root / "shared-a").mkdir(parents=True)
    (store.root / "shared-a" / "adapter_config.json").write_text(good[0])
    (store.root / "not-an-adapter").mkdir()
    upload(store, ACME, "x", good, hf_config)
    assert store.shared() == {"shared-a": str(store.root / "shared-a")}
    assert AdapterStore(store.root / "nothing-here").shared() == {}


def test_other_tenants_adapters_are_not_found_exactly_like_missing_ones(store, tmp_path, good, hf_config):
    upload(store, ACME, "secret", good, hf_config)
    empty = AdapterStore(tmp_path / "empty")
    before = snapshot(store.root)
    assert store.lookup("globex", "secret") is None and store.list("globex") == []
    for op in ("info", "delete"):
        with pytest.raises(AdapterNotFound) as theirs:
            getattr(store, op)("globex", "secret")
        with pytest.raises(AdapterNotFound) as nobodys:
            getattr(empty, op)("globex", "secret")
        assert str(theirs.value) == str(nobodys.value) == repr("adapter 'secret' not found")
    assert snapshot(store.root) == before


def test_same_name_in_two_tenants_are_two_adapters(store, make, hf_config):
    a = upload(store, ACME, "support", make(1), hf_config)
    g = upload(store, GLOBEX, "support", make(2), hf_config)
    assert a.digest != g.digest and a.path != g.path
    store.delete("globex", "support")
    assert store.lookup("acme", "support") == a


# refusals: nothing stored --------------------------------------------------------------

BAD_NAMES = ["../x", "a/b", ".hidden", "x" * 65, "caf\u00e9", "", "..", "x\x00", "-dash", " x", "a\\b"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_unsafe_names_are_refused(store, good, hf_config, name):
    upload(store, ACME, "ok", good, hf_config)
    before = snapshot(store.root)
    with pytest.raises(AdapterStoreError, match="invalid adapter name"):
        upload(store, ACME, name, good, hf_config)
    for op in (store.info, store.delete):
        with pytest.raises(AdapterStoreError, match="invalid adapter name"):
            op("acme", name)
    assert store.lookup("acme", name) is None
    assert snapshot(store.root) == before


def _pickle_bytes(files) -> bytes:
    from safetensors.torch import load

    buf = io.BytesIO()
    torch.save(load(files[1]), buf)
    return buf.getvalue()


def _lying_header(data: bytes, **entry_changes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    first = min(k for k in header if k != "__metadata__")
    header[first].update(entry_changes)
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def _refusals(good, make, other_model_files):
    data = good[1]
    n = int.from_bytes(data[:8], "little")
    big = Tenant("acme", b"a", max_adapter_rank=4, max_adapter_bytes=3 * len(data))
    cases = {
        "pickle": (ACME, (good[0], _pickle_bytes(good)), "pickle is refused"),
        "garbage": (ACME, (good[0], b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!"), "not a valid safetensors file"),
        "empty weights": (ACME, (good[0], b""), "adapter_weights is empty"),
        "header past the end": (ACME, (good[0], (len(data)).to_bytes(8, "little") + data[8:]), "runs past the end"),
        "truncated data": (ACME, (good[0], data[:-4]), "data_offsets"),
        "trailing bytes": (ACME, (good[0], data + b"\0" * 8), "cover"),
        "offsets lie": (ACME, (good[0], _lying_header(data, data_offsets=[0, 10**12])), "outside"),
        "shape lies": (ACME, (good[0], _lying_header(data, shape=[4, 4096])), "needs"),
        "unknown dtype": (ACME, (good[0], _lying_header(data, dtype="X9")), "unknown dtype"),
        "header not json": (ACME, (good[0], n.to_bytes(8, "little") + b"\xff" * n + data[8 + n:]), "not valid JSON"),
        "config not json": (ACME, ("{nope", data), "adapter_config.json is not valid JSON"),
        "config too big": (ACME, (" " * (64 * 1024 + 1), data), "at most 65536"),
        "wrong shapes": (ACME, other_model_files, "has shape"),
        "rank over server": (ACME, make(3, r=32), "above the server's max_lora_rank 16"),
        "rank over quota": (big, make(4, r=8), "above the max_adapter_rank quota (4) of tenant 'acme'"),
        "bytes over quota": (big, make(4, r=4, target_modules=ALL), "above the max_adapter_bytes quota"),
        "bigger than any valid adapter": (ACME, (good[0], data + b" " * (10 << 20)), "more than any valid adapter"),
        "unknown module": (ACME, (json.dumps({**json.loads(good[0]), "target_modules": ["score"]}), data),
                           "unknown target module"),
        "regex bomb": (ACME, (json.dumps({**json.loads(good[0]), "target_modules": "(?:(?:(?:a{200}){200}){200})"}),
                              data), "target_modules pattern '(?:(?:(?:a{200}){200}){200})' expands past 1024"),
        "config nested deep": (ACME, ("[" * 30_000 + "]" * 30_000, data), "adapter_config.json nests too deeply"),
    }
    assert sorted(cases) == sorted(REFUSALS)
    return cases


REFUSALS = ["pickle", "garbage", "empty weights", "header past the end", "truncated data", "trailing bytes",
            "offsets lie", "shape lies", "unknown dtype", "header not json", "config not json", "config too big",
            "wrong shapes", "rank over server", "rank over quota", "bytes over quota",
            "bigger than any valid adapter", "unknown module", "regex bomb", "config nested deep"]


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_uploads_leave_the_store_unchanged(store, good, make, other_model_files, hf_config, case):
    upload(store, ACME, "support", good, hf_config)
    tenant, files, fragment = _refusals(good, make, other_model_files)[case]
    for name in ("support", "new"):  # replacing an adapter, and a new name
        before = snapshot(store.root)
        with pytest.raises(AdapterStoreError) as info:
            upload(store, tenant, name, files, hf_config)
        assert fragment in str(info.value), str(info.value)
        assert str(store.root) not in str(info.value)
        assert snapshot(store.root) == before
    assert store.lookup("acme", "support").digest == adapter_digest(good[0].encode(), good[1])


def test_a_refused_first_upload_creates_nothing(store, good, hf_config):
    with pytest.raises(AdapterStoreError, match="pickle is refused"):
        upload(store, ACME, "x", (good[0], _pickle_bytes(good)), hf_config)
    assert not store.root.exists()


class FakeClock:
    """Unix time that moves only when a test says so (starts at a whole second of the real time)."""

    def __init__(self):
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


GRACE = RETIRED_VERSION_GRACE_SECONDS


def test_max_adapters_counts_every_version_on_disk(tmp_path, make, hf_config):
    clock = FakeClock()
    store = AdapterStore(tmp_path / "store", clock=clock)
    tenant = Tenant("acme", b"a", max_adapters=2)
    upload(store, tenant, "a", make(1), hf_config)
    upload(store, tenant, "b", make(2), hf_config)
    before = snapshot(store.root)
    with pytest.raises(AdapterStoreError) as info:
        upload(store, tenant, "c", make(3), hf_config)
    assert str(info.value) == ("tenant 'acme' already has 2 adapter version(s) on disk (2 current), its max_adapters "
                               "quota (2): delete one (its version is kept 600 s for requests in flight, then "
                               "removed), or upload under an existing name to replace it")
    assert snapshot(store.root) == before
    clock.now += 100
    replaced = upload(store, tenant, "b", make(3), hf_config)  # a replacement may retire one version
    assert store.lookup("acme", "b") == replaced
    assert store.usage("acme") == TenantUsage(current=2, retired=1, bytes=store.usage("acme").bytes,
                                              next_free=clock.now + GRACE)
    clock.now += 10
    with pytest.raises(AdapterStoreError) as info:
        upload(store, tenant, "b", make(4), hf_config)
    assert str(info.value) == ("tenant 'acme' already has 3 adapter version(s) on disk (2 current and 1 replaced or "
                               "deleted, kept 600 s for requests in flight (the oldest is removed in 590 s)), its "
                               "max_adapters quota (2 plus the version a replacement retires): retry then")
    assert upload(store, tenant, "b", make(3), hf_config).version == replaced.version  # same bytes: no new version
    store.delete("acme", "a")  # a deleted version counts until it is collected
    with pytest.raises(AdapterStoreError, match=r"already has 3 adapter version\(s\) on disk \(1 current and 2 "):
        upload(store, tenant, "c", make(5), hf_config)
    clock.now += GRACE  # b's first version is past its grace; a's is not (deleted 10 s later)
    with pytest.raises(AdapterStoreError) as info:
        upload(store, tenant, "c", make(5), hf_config)
    assert str(info.value) == ("tenant 'acme' already has 2 adapter version(s) on disk (1 current and 1 replaced or "
                               "deleted, kept 600 s for requests in flight (the oldest is removed in 1 s)), its "
                               "max_adapters quota (2): retry then")
    clock.now += 1
    upload(store, tenant, "c", make(5), hf_config)
    assert [a.name for a in store.list("acme")] == ["b", "c"]
    assert store.usage("acme") == TenantUsage(current=2, retired=0, bytes=store.usage("acme").bytes, next_free=None)
    assert len(_on_disk(store, "acme")) == 2


def _variant(files, i: int) -> tuple[str, bytes]:
    """The same adapter with its last float changed: a distinct version of exactly the same size."""
    return files[0], files[1][:-4] + struct.pack("<f", 0.001 * (i + 1))


def _on_disk(store, tenant: str) -> list[Path]:
    return sorted(p for p in (store.root / ".tenants" / tenant_dir_name(tenant) / "versions").glob("*/*"))


def test_50_replacements_under_max_adapters_1_leave_two_versions(tmp_path, good, hf_config):
    store = AdapterStore(tmp_path / "store", clock=FakeClock())
    tenant = Tenant("acme", b"a", max_adapters=1)
    refused = 0
    for i in range(50):
        try:
            upload(store, tenant, "x", _variant(good, i), hf_config)
        except AdapterStoreError as exc:
            assert str(exc).startswith("tenant 'acme' already has 2 adapter version(s) on disk (1 current and 1 "
                                       "replaced or deleted"), str(exc)
            refused += 1
    size = len(good[0].encode()) + len(good[1])
    assert refused == 48 and len(_on_disk(store, "acme")) == 2
    assert store.usage("acme") == TenantUsage(current=1, retired=1, bytes=2 * size, next_free=store.clock() + GRACE)
    assert store.stored_bytes() == 2 * size == sum(p.stat().st_size for p in _on_disk(store, "acme")[0].parent.parent
                                                   .rglob("*") if p.is_file())


def test_50_replacements_a_minute_apart_keep_the_current_and_the_last_10_minutes(tmp_path, good, hf_config):
    clock = FakeClock()
    store = AdapterStore(tmp_path / "store", clock=clock)
    for i in range(50):
        upload(store, ACME, "x", _variant(good, i), hf_config)  # no max_adapters: only the grace bounds it
        clock.now += 60
    clock.now -= 60  # the last upload's time: versions 38..48 were retired at most 600 s before
    size = len(good[0].encode()) + len(good[1])
    assert len(_on_disk(store, "acme")) == 12
    assert store.usage("acme") == TenantUsage(current=1, retired=11, bytes=12 * size, next_free=clock.now)
    assert store.stored_bytes() == 12 * size


def test_the_collection_timer_collects_every_tenants_retired_versions(tmp_path, make, hf_config):
    clock = FakeClock()
    store = AdapterStore(tmp_path / "store", clock=clock)
    a1 = upload(store, ACME, "x", make(1), hf_config)
    upload(store, ACME, "x", make(2), hf_config)
    clock.now += GRACE - 5
    g1 = upload(store, GLOBEX, "y", make(3), hf_config)
    upload(store, GLOBEX, "y", make(4), hf_config)
    clock.now += 10  # acme's retired version is past its grace, globex's is not
    collector = Collector(store, interval=0.01).start()
    try:
        deadline = time.monotonic() + 10
        while a1.path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        collector.stop()
    assert not a1.path.exists() and g1.path.is_dir()
    assert (len(_on_disk(store, "acme")), len(_on_disk(store, "globex"))) == (1, 2)


def test_any_tenants_upload_collects_once_the_interval_has_passed(tmp_path, make, hf_config):
    clock = FakeClock()
    store = AdapterStore(tmp_path / "store", clock=clock)
    a1 = upload(store, ACME, "x", make(1), hf_config)
    upload(store, ACME, "x", make(2), hf_config)
    clock.now += GRACE + 1
    upload(store, GLOBEX, "y", make(3), hf_config)  # globex's upload collects acme's retired version
    assert not a1.path.exists()
    a2 = store.lookup("acme", "x")
    upload(store, ACME, "x", make(4), hf_config)
    clock.now += GRACE - 30
    assert store.collect() == 0  # nothing past its grace yet
    clock.now += 31  # a2 is past its grace now, 31 s after the last collection
    upload(store, GLOBEX, "z", make(5), hf_config)
    assert a2.path.is_dir()  # a collection runs at most every COLLECT_INTERVAL_SECONDS
    clock.now += COLLECT_INTERVAL_SECONDS
    upload(store, GLOBEX, "w", make(6), hf_config)
    assert not a2.path.exists()


def test_a_tenant_busy_in_an_upload_is_skipped_by_the_collection(tmp_path, make, hf_config):
    clock = FakeClock()
    store = AdapterStore(tmp_path / "store", clock=clock)
    a1 = upload(store, ACME, "x", make(1), hf_config)
    upload(store, ACME, "x", make(2), hf_config)
    clock.now += GRACE + 1
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(a1.path.parent.parent.parent / ".lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        collected = []
        t = threading.Thread(target=lambda: collected.append(store.collect()), daemon=True)
        t.start()
        t.join(30)  # a guard only: waiting for the lock would wait for the holder, which waits for us
        assert collected == [0] and a1.path.is_dir()  # returned while the other replica held its lock
        assert holder.poll() is None
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
    assert store.collect() == 1 and not a1.path.exists()


# the store-wide byte cap ------------------------------------------------------------------

FULL = ("the adapter store is full: this upload ({} bytes) does not fit under the server's adapter_store_max_bytes; "
        "retry later (replaced versions are removed 600 s after they are replaced) or ask the operator")


def test_the_store_wide_cap_counts_every_tenants_versions(tmp_path, good, hf_config):
    size = len(good[0].encode()) + len(good[1])
    clock = FakeClock()
    store = AdapterStore(tmp_path / "store", max_bytes=3 * size, clock=clock)
    upload(store, ACME, "a", _variant(good, 1), hf_config)
    upload(store, GLOBEX, "b", _variant(good, 2), hf_config)
    upload(store, ACME, "a", _variant(good, 3), hf_config)  # the replaced version still counts
    before = snapshot(store.root)
    for tenant, name in ((GLOBEX, "c"), (ACME, "a")):
        with pytest.raises(StoreFull) as info:
            upload(store, tenant, name, _variant(good, 4), hf_config)
        assert str(info.value) == FULL.format(size)
        assert snapshot(store.root) == before
    assert store.stored_bytes() == 3 * size
    clock.now += GRACE + 1  # acme's replaced version is collectable: the upload collects it and fits
    upload(store, GLOBEX, "c", _variant(good, 4), hf_config)
    assert store.stored_bytes() == 3 * size
    assert upload(store, GLOBEX, "b", _variant(good, 2), hf_config).name == "b"  # same bytes: no new version


def test_the_cap_is_checked_again_under_the_store_lock(tmp_path, good, hf_config, monkeypatch):
    """Replica A places a version while B's upload waits for the store lock: B is refused, leaving nothing."""
    size = len(good[0].encode()) + len(good[1])
    store = AdapterStore(tmp_path / "store", max_bytes=2 * size)
    first = upload(store, ACME, "a", _variant(good, 1), hf_config)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(store.root / ".tenants" / ".lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    outcome = []
    try:
        assert holder.stdout.readline().strip() == "locked"

        def run():
            try:
                outcome.append(upload(AdapterStore(store.root, max_bytes=2 * size), GLOBEX, "b", _variant(good, 2),
                                      hf_config))
            except AdapterStoreError as exc:
                outcome.append(exc)

        asked = asked_for(monkeypatch, store.root / ".tenants" / ".lock")
        t = threading.Thread(target=run)
        t.start()
        assert asked.wait(30)  # past its early check (1 of 2 fit), staged, now waiting for the store lock
        assert t.is_alive() and outcome == []
        shutil.copytree(first.path, first.path.parent / "0000000000000000")  # what replica A places meanwhile
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
    t.join(30)
    assert isinstance(outcome[0], StoreFull) and str(outcome[0]) == FULL.format(size)
    assert not list(store.root.rglob(".tmp-*")) and store.lookup("globex", "b") is None
    assert not (store.root / ".tenants" / tenant_dir_name("globex") / "versions" / "b").exists()


# the safetensors header bound -------------------------------------------------------------

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152)


def test_a_header_of_200000_zero_size_tensors_is_refused_unparsed(monkeypatch):
    """SmolLM2-135M's shapes at max_lora_rank 64: 428 tensors at most, a 503,808-byte header."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**SMOLLM2)
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    data = len(raw).to_bytes(8, "little") + raw
    assert len(data) < max_weights_bytes(hf_config, 64)  # within the size bound: the header bound must refuse it
    config = json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    store = AdapterStore(Path(tempfile.mkdtemp()) / "store")
    parsed, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **kw: parsed.append(len(text)) or loads(text, *a, **kw))
    with pytest.raises(AdapterStoreError) as info:
        store.upload(ACME, "x", config, data, hf_config, 64)
    assert str(info.value) == (f"adapter 'x': adapter_model.safetensors is not a valid safetensors file: header "
                               f"length {len(raw)} is more than an adapter of this base model needs (503808 bytes "
                               f"for at most 428 tensors)")
    assert max(parsed, default=0) <= len(config) and not store.root.exists()  # the header was never parsed


def test_largest_valid_adapter_fits_the_size_bound(hf_config, make):
    from loraplex.lora.vocab import max_vocab_bytes

    files = make(9, r=MAX_RANK, target_modules=ALL)
    from safetensors.torch import load

    f64 = save({k: v.double() for k, v in load(files[1]).items()})
    vocab = max_vocab_bytes(hf_config, MAX_RANK)  # embed_tokens' and lm_head's tensors: tests/unit/test_vocab_adapter.py
    assert len(f64) <= max_weights_bytes(hf_config, MAX_RANK) - vocab < 2 * len(f64)


# versions, grace period, garbage collection ---------------------------------------------

def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_replaced_and_deleted_versions_stay_for_the_grace_period(store, make, hf_config):
    v1 = upload(store, ACME, "x", make(1), hf_config)
    _age(v1.path, 2 * RETIRED_VERSION_GRACE_SECONDS)  # long current: its mtime is old
    v2 = upload(store, ACME, "x", make(2), hf_config)
    assert v1.version != v2.version and store.lookup("acme", "x") == v2
    assert (v1.path / "adapter_model.safetensors").is_file()  # retired just now: still readable
    assert v1.path.stat().st_mtime > time.time() - 60
    same = upload(store, ACME, "x", make(2), hf_config)  # the same bytes are the same version
    assert same.version == v2.version
    _age(v1.path, RETIRED_VERSION_GRACE_SECONDS + 5)
    upload(store, ACME, "y", make(3), hf_config)  # any upload of the tenant collects its garbage
    assert not v1.path.exists() and v2.path.is_dir()
    store.delete("acme", "x")
    assert v2.path.is_dir()  # deleted, but a request elsewhere may still reload it
    _age(v2.path, RETIRED_VERSION_GRACE_SECONDS + 5)
    store.delete("acme", "y")
    assert not v2.path.exists() and not v2.path.parent.exists()


def test_a_retired_version_uploaded_again_is_not_collected(store, make, hf_config):
    v1 = upload(store, ACME, "x", make(1), hf_config)
    upload(store, ACME, "x", make(2), hf_config)
    _age(v1.path, RETIRED_VERSION_GRACE_SECONDS + 5)
    again = upload(store, ACME, "x", make(1), hf_config)
    assert again.version == v1.version and (again.path / "adapter_model.safetensors").is_file()


def test_crashed_writers_leftovers_are_removed_after_the_grace(store, good, hf_config):
    v = upload(store, ACME, "x", good, hf_config)
    tdir = v.path.parent.parent.parent
    old_tmp, new_tmp = v.path.parent / ".tmp-dead", tdir / "adapters" / ".tmp-fresh-x.json"
    old_tmp.mkdir()
    (old_tmp / "adapter_model.safetensors").write_bytes(b"partial")
    new_tmp.write_bytes(b"{")
    _age(old_tmp, RETIRED_VERSION_GRACE_SECONDS + 5)
    store.delete("acme", "x")
    assert not old_tmp.exists() and new_tmp.exists()
    assert store.list("acme") == []  # a temp file is never taken for a pointer


def test_unreadable_pointer_is_ignored(store, good, hf_config):
    v = upload(store, ACME, "x", good, hf_config)
    pointer = v.path.parent.parent.parent / "adapters" / "x.json"
    pointer.write_text(json.dumps({**json.loads(pointer.read_text()), "version": "../../../etc"}))
    assert store.lookup("acme", "x") is None and store.list("acme") == []


# two replicas ---------------------------------------------------------------------------

HOLD_LOCK = """
import fcntl, sys
f = open(sys.argv[1], "a+b")
fcntl.flock(f.fileno(), fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


def asked_for(monkeypatch, lock: Path) -> threading.Event:
    """Set once a thread of this process asks for ``lock``'s flock and waits for it (a replica at that lock)."""
    asked, flock, path = threading.Event(), fcntl.flock, str(lock.resolve())

    def watched(fd, operation):
        if operation == fcntl.LOCK_EX and os.readlink(f"/proc/self/fd/{fd}") == path:
            asked.set()
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", watched)
    return asked


def test_the_quota_is_checked_again_under_the_tenants_flock(store, make, hf_config, monkeypatch):
    """Replica A holds the tenant's lock while it adds a name; B's upload waits, then sees the quota full."""
    tenant = Tenant("acme", b"a", max_adapters=2)
    first = upload(store, tenant, "a", make(1), hf_config)
    tdir = first.path.parent.parent.parent
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tdir / ".lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        other_replica = AdapterStore(store.root)
        outcome = []

        def run():
            try:
                outcome.append(upload(other_replica, tenant, "c", make(3), hf_config))
            except AdapterStoreError as exc:
                outcome.append(exc)

        asked = asked_for(monkeypatch, tdir / ".lock")
        t = threading.Thread(target=run)
        t.start()
        assert asked.wait(30)  # past its early quota check (1 of 2), now waiting for the lock
        assert t.is_alive() and outcome == []
        # what replica A does under its lock: a second name's version is installed and becomes current
        meta = json.loads((tdir / "adapters" / "a.json").read_text())
        shutil.copytree(first.path, tdir / "versions" / "b" / meta["version"])
        (tdir / "adapters" / "b.json").write_text(json.dumps({**meta, "name": "b"}))
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
    t.join(30)
    assert isinstance(outcome[0], AdapterStoreError) and "max_adapters quota (2)" in str(outcome[0])
    assert [a.name for a in store.list("acme")] == ["a", "b"]


def test_replicas_see_each_others_changes_at_once(store, make, hf_config):
    replica = AdapterStore(store.root)
    v = upload(store, ACME, "x", make(1), hf_config)
    assert replica.lookup("acme", "x") == v
    v2 = upload(replica, ACME, "x", make(2), hf_config)
    assert store.lookup("acme", "x") == v2
    replica.delete("acme", "x")
    assert store.lookup("acme", "x") is None


def test_lock_file_is_flockable(store, good, hf_config):
    v = upload(store, ACME, "x", good, hf_config)
    with open(v.path.parent.parent.parent / ".lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it between operations
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def test_lora_adapters_answers_a_full_store_with_unavailable(monkeypatch):
    """The store-wide cap is the server's capacity (UNAVAILABLE, retryable); a tenant's quota stays INVALID_ARG."""
    import importlib
    import types

    codes = types.SimpleNamespace(UNAVAILABLE="UNAVAILABLE", INVALID_ARG="INVALID_ARG", NOT_FOUND="NOT_FOUND",
                                  UNSUPPORTED="UNSUPPORTED", INTERNAL="INTERNAL", CANCELLED="CANCELLED")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(TritonError=codes))
    sys.modules.pop("loraplex.triton.adapters_model", None)
    try:
        model = importlib.import_module("loraplex.triton.adapters_model").TritonPythonModel
        assert model._error_code(StoreFull(FULL.format(1))) == "UNAVAILABLE"
        assert model._error_code(AdapterStoreError("tenant 'acme' already has ...")) == "INVALID_ARG"
    finally:
        sys.modules.pop("loraplex.triton.adapters_model", None)  # bound to the fake pb_utils
