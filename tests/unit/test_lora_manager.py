"""LoraSlots and AdapterManager: padding, reuse, on-demand loading, pins, LRU, host tier, numerics."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraplex.lora.adapter import load_peft_adapter
from loraplex.exceptions import AdapterError, AdapterNotFound
from loraplex.lora.manager import AdapterManager
from loraplex.lora.shapes import MODULES, module_shapes
from loraplex.lora.slots import LoraSlots
from loraplex.lora.backends.tiles import SlotTiles

ALL = list(MODULES)


@pytest.fixture(scope="module")
def adapters(base_model, tmp_path_factory):
    """name -> (folder, peft model) for four distinct adapters."""
    specs = {
        "one": dict(r=4, lora_alpha=8, target_modules=ALL),
        "two": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                    layers_to_transform=[1]),
        "three": dict(r=8, lora_alpha=16, target_modules=["o_proj", "up_proj"], rank_pattern={"up_proj": 3}),
        "four": dict(r=4, lora_alpha=4, target_modules=["k_proj"]),
    }
    out = {}
    for seed, (name, kw) in enumerate(specs.items(), start=10):
        torch.manual_seed(seed)
        pm = get_peft_model(copy.deepcopy(base_model), LoraConfig(init_lora_weights=False, **kw)).eval()
        folder = tmp_path_factory.mktemp(name)
        pm.save_pretrained(str(folder))
        out[name] = (folder, pm)
    return out


def new_slots(hf_config, max_loras=2, max_rank=8):
    return LoraSlots(hf_config.num_hidden_layers, module_shapes(hf_config), max_loras, max_rank, torch.float32, "cpu")


def new_manager(hf_config, adapters, max_loras=2, max_cpu_loras=4, names=("one", "two", "three", "four")):
    mgr = AdapterManager(new_slots(hf_config, max_loras), hf_config, max_lora_rank=8, max_cpu_loras=max_cpu_loras,
                         dtype=torch.float32)
    for name in names:
        mgr.register(name, adapters[name][0])
    return mgr


def peft_module(pm, layer, module):
    layer_mod = pm.base_model.model.model.layers[layer]
    return getattr(layer_mod.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else layer_mod.mlp, module)


def assert_slot_holds(slots, slot, adapter):
    for layer in range(slots.num_layers):
        for m in MODULES:
            a, b = slots.a[layer][m][slot], slots.b[layer][m][slot]
            if (layer, m) in adapter.weights:
                wa, wb, scale = adapter.weights[(layer, m)]
                r = wa.shape[0]
                assert torch.equal(a[:r], wa) and torch.equal(b[:, :r], wb)
                assert int(slots.ranks[layer][m][slot]) == r
                assert float(slots.scales[layer][m][slot]) == pytest.approx(scale)
            else:
                r = 0
                assert int(slots.ranks[layer][m][slot]) == 0 and float(slots.scales[layer][m][slot]) == 0.0
            assert not a[r:].any() and not b[:, r:].any()


def assert_slot_empty(slots, slot):
    for layer in range(slots.num_layers):
        for m in MODULES:
            assert not slots.a[layer][m][slot].any() and not slots.b[layer][m][slot].any()
            assert int(slots.ranks[layer][m][slot]) == 0 and float(slots.scales[layer][m][slot]) == 0.0


# slots -------------------------------------------------------------------------------


def test_slots_layout_and_memory(hf_config):
    slots = new_slots(hf_config, max_loras=3, max_rank=8)
    assert slots.a[0]["q_proj"].shape == (3, 8, 64)
    assert slots.b[1]["down_proj"].shape == (3, 64, 8)
    assert slots.a[1]["down_proj"].shape == (3, 8, 128)
    assert slots.b[0]["k_proj"].shape == (3, 32, 8)
    assert slots.ranks[0]["v_proj"].dtype == torch.int32 and slots.scales[0]["v_proj"].dtype == torch.float32
    # sum(in + out) over the 7 projections = 1024; A+B per layer = 3 slots * 8 * 1024 * 4 bytes
    assert slots.memory_bytes() == 2 * (3 * 8 * 1024 * 4 + 7 * 3 * 4 * 2)
    for s in range(3):
        assert_slot_empty(slots, s)


def test_slots_zero_padded_and_cleared_on_reuse(hf_config, adapters):
    one = load_peft_adapter(adapters["one"][0], "one", hf_config, 8)
    two = load_peft_adapter(adapters["two"][0], "two", hf_config, 8)
    slots = new_slots(hf_config, max_loras=3)
    slots.load(1, one)
    assert_slot_holds(slots, 1, one)
    assert_slot_empty(slots, 0)
    assert_slot_empty(slots, 2)
    slots.load(1, two)  # smaller rank, fewer modules: nothing of "one" may remain
    assert_slot_holds(slots, 1, two)
    assert int(slots.ranks[0]["q_proj"][1]) == 0 and int(slots.ranks[1]["q_proj"][1]) == 2
    slots.clear(1)
    assert_slot_empty(slots, 1)
    with pytest.raises(IndexError):
        slots.load(3, one)
    with pytest.raises(ValueError, match="rank 4 > slot max_rank 2"):
        new_slots(hf_config, max_rank=2).load(0, one)


# manager -----------------------------------------------------------------------------


def test_on_demand_load_and_pins(hf_config, adapters):
    mgr = new_manager(hf_config, adapters)
    assert mgr.names() == ["four", "one", "three", "two"]
    assert not mgr.is_resident("one") and mgr.loads_from_disk == 0
    assert mgr.acquire("one") == 0
    assert mgr.loads_from_disk == 1 and mgr.is_resident("one") and mgr.slot_of("one") == 0
    assert mgr.acquire("one") == 0
    assert mgr.loads_from_disk == 1 and mgr.pins("one") == 2 and mgr.pinned_count() == 1
    assert mgr.acquire("two") == 1
    assert mgr.pinned_count() == 2 and mgr.total_pins() == 3
    assert_slot_holds(mgr.slots, 0, load_peft_adapter(adapters["one"][0], "one", hf_config, 8))
    assert_slot_holds(mgr.slots, 1, load_peft_adapter(adapters["two"][0], "two", hf_config, 8))
    mgr.release("one")
    mgr.release("one")
    mgr.release("two")
    assert mgr.pinned_count() == 0 and mgr.total_pins() == 0 and mgr.is_resident("one") and mgr.is_resident("two")


def test_lru_eviction_order(hf_config, adapters):
    mgr = new_manager(hf_config, adapters)
    for name in ("one", "two"):
        mgr.acquire(name)
        mgr.release(name)
    assert mgr.acquire("one") == 0  # touch: "two" is now least recently used
    mgr.release("one")
    assert mgr.resident_names() == ["two", "one"]
    assert mgr.acquire("three") == 1  # evicts "two"
    mgr.release("three")
    assert mgr.evictions == 1 and mgr.resident_names() == ["one", "three"] and not mgr.is_resident("two")
    assert mgr.acquire("two") == 0  # evicts "one"
    mgr.release("two")
    assert mgr.evictions == 2 and mgr.resident_names() == ["three", "two"]
    assert_slot_holds(mgr.slots, 0, load_peft_adapter(adapters["two"][0], "two", hf_config, 8))


def test_pin_prevents_eviction_and_full_pins_return_none(hf_config, adapters):
    mgr = new_manager(hf_config, adapters)
    assert mgr.acquire("one") == 0  # stays pinned, least recently used
    assert mgr.acquire("two") == 1
    mgr.release("two")
    assert mgr.acquire("three") == 1  # "one" is older but pinned: "two" goes
    assert mgr.is_resident("one") and not mgr.is_resident("two")
    assert mgr.acquire("four") is None  # both slots pinned
    assert not mgr.is_resident("four") and mgr.evictions == 1
    assert "four" not in mgr.host_names()  # not read from disk while it cannot get a slot
    mgr.release("one")
    assert mgr.acquire("four") == 0
    assert mgr.resident_names() == ["three", "four"]


def test_release_errors(hf_config, adapters):
    mgr = new_manager(hf_config, adapters)
    mgr.acquire("one")
    mgr.release("one")
    with pytest.raises(ValueError, match="not pinned"):
        mgr.release("one")
    with pytest.raises(ValueError, match="not pinned"):
        mgr.release("two")
    with pytest.raises(AdapterNotFound):
        mgr.release("nope")
    assert mgr.pins("one") == 0


def test_unknown_name(hf_config, adapters):
    mgr = new_manager(hf_config, adapters)
    for call in (mgr.acquire, mgr.digest, mgr.unregister):
        with pytest.raises(AdapterNotFound) as info:
            call("nope")
        assert isinstance(info.value, KeyError)


def test_host_tier_is_bounded_and_independent_of_device(hf_config, adapters):
    mgr = new_manager(hf_config, adapters, max_cpu_loras=2)
    assert mgr.acquire("one") == 0
    mgr.digest("two")
    mgr.digest("three")
    assert mgr.host_names() == ["two", "three"] and mgr.host_evictions == 1 and mgr.loads_from_disk == 3
    assert mgr.is_resident("one") and mgr.acquire("one") == 0 and mgr.loads_from_disk == 3
    assert mgr.digest("one") == load_peft_adapter(adapters["one"][0], "one", hf_config, 8).digest
    assert mgr.loads_from_disk == 3  # resident digest answers without disk
    mgr.digest("two")  # host hit
    assert mgr.loads_from_disk == 3 and mgr.host_names() == ["three", "two"]
    mgr.digest("four")
    assert mgr.host_names() == ["two", "four"] and mgr.loads_from_disk == 4


def test_bad_adapter_raises_and_leaves_slots_alone(hf_config, adapters, tmp_path):
    mgr = new_manager(hf_config, adapters)
    mgr.acquire("one")
    mgr.release("one")
    mgr.acquire("two")
    mgr.release("two")
    mgr.register("bad", tmp_path / "missing")
    for call in (mgr.digest, mgr.acquire):
        with pytest.raises(AdapterError, match="does not exist"):
            call("bad")
    assert mgr.resident_names() == ["one", "two"] and mgr.evictions == 0


def test_a_failed_read_of_unchanged_files_is_not_done_again(hf_config, adapters, tmp_path, monkeypatch):
    """The loop reads again what the preloader could not: unchanged files fail at once, with the same error."""
    import json

    from loraplex.lora import manager as manager_module

    folder = tmp_path / "bad"
    shutil.copytree(adapters["one"][0], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": -1}))
    reads = []
    real = manager_module.load_peft_adapter
    monkeypatch.setattr(manager_module, "load_peft_adapter", lambda *a, **k: reads.append(a[1]) or real(*a, **k))
    mgr = new_manager(hf_config, adapters, names=())
    mgr.register("bad", folder)
    errors = []
    for call in (lambda: mgr.read("bad", str(folder)), lambda: mgr.acquire("bad"), lambda: mgr.acquire("bad")):
        with pytest.raises(AdapterError, match="r must be a positive integer") as info:
            call()
        errors.append(str(info.value))
    assert reads == ["bad"] and len(set(errors)) == 1
    (folder / "adapter_config.json").write_text(json.dumps(config))  # changed: read again, and served
    assert mgr.acquire("bad") == 0 and reads == ["bad", "bad"]


def test_a_slot_load_that_fails_keeps_no_slot(hf_config, adapters, monkeypatch):
    mgr = new_manager(hf_config, adapters, max_loras=1)
    real = mgr.slots.load

    def fails(slot, adapter):
        raise AdapterError("the DoRA output scale is not finite")

    monkeypatch.setattr(mgr.slots, "load", fails)
    with pytest.raises(AdapterError, match="not finite"):
        mgr.acquire("one")
    monkeypatch.setattr(mgr.slots, "load", real)
    assert mgr.acquire("two") == 0 and mgr.resident_names() == ["two"]


def test_reregister_with_changed_content_changes_digest(hf_config, adapters, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(adapters["one"][0], folder)
    mgr = new_manager(hf_config, adapters, names=())
    mgr.register("x", folder)
    d1 = mgr.digest("x")
    assert mgr.acquire("x") == 0
    mgr.release("x")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapters["three"][0] / f, folder / f)
    assert mgr.digest("x") == d1  # not re-registered: cached copy still served
    mgr.register("x", folder)
    assert not mgr.is_resident("x")
    d2 = mgr.digest("x")
    assert d2 != d1 and d2 == load_peft_adapter(folder, "x", hf_config, 8).digest
    assert mgr.acquire("x") == 0
    assert_slot_holds(mgr.slots, 0, load_peft_adapter(adapters["three"][0], "x", hf_config, 8))
    mgr.release("x")
    # re-register under a different path invalidates as well
    mgr.register("x", adapters["four"][0])
    assert mgr.acquire("x") == 0 and mgr.slot_of("x") == 0
    assert_slot_holds(mgr.slots, 0, load_peft_adapter(adapters["four"][0], "x", hf_config, 8))


def test_refresh_sees_files_changed_or_deleted_on_disk(hf_config, adapters, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(adapters["one"][0], folder)
    mgr = new_manager(hf_config, adapters, names=())
    mgr.register("x", folder)
    old = mgr.digest("x")
    assert mgr.acquire("x") == 0  # a running sequence pins the version it started with
    mgr.refresh("x")
    assert mgr.is_resident("x") and mgr.loads_from_disk == 1  # unchanged files: nothing re-read
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:100])  # garbled behind its back
    mgr.refresh("x")
    with pytest.raises(AdapterError, match="not a valid safetensors file"):
        mgr.digest("x")
    assert_slot_holds(mgr.slots, 0, load_peft_adapter(adapters["one"][0], "x", hf_config, 8))  # still serves the pin
    shutil.rmtree(folder)
    mgr.refresh("x")
    with pytest.raises(AdapterError, match="does not exist"):
        mgr.digest("x")
    shutil.copytree(adapters["one"][0], folder)  # restored: served again, in its old slot
    mgr.refresh("x")
    assert mgr.digest("x") == old and mgr.acquire("x") == 0
    mgr.release("x")
    mgr.release("x")
    assert mgr.total_pins() == 0


def test_reregister_unchanged_content_keeps_slot(hf_config, adapters):
    mgr = new_manager(hf_config, adapters)
    assert mgr.acquire("one") == 0
    mgr.release("one")
    mgr.register("one", adapters["one"][0])
    assert not mgr.is_resident("one")
    assert mgr.acquire("one") == 0 and mgr.loads_from_disk == 2 and mgr.is_resident("one")
    assert mgr.resident_names() == ["one"] and mgr.evictions == 0


def test_reregister_while_pinned_retires_old_version(hf_config, adapters, tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(adapters["one"][0], folder)
    mgr = new_manager(hf_config, adapters, names=())
    mgr.register("x", folder)
    old = load_peft_adapter(folder, "x", hf_config, 8)
    assert mgr.acquire("x") == 0
    mgr.register("x", adapters["two"][0])
    assert mgr.acquire("x") == 1  # new content in a new slot; the running sequence keeps slot 0
    assert_slot_holds(mgr.slots, 0, old)
    assert mgr.pinned_count() == 2 and mgr.total_pins() == 2  # the retired copy's pin counts too
    with pytest.raises(ValueError, match="pass slot="):
        mgr.release("x")
    mgr.release("x", slot=0)
    assert_slot_empty(mgr.slots, 0)
    assert mgr.pinned_count() == 1 and mgr.slot_of("x") == 1
    mgr.register("y", adapters["three"][0])
    assert mgr.acquire("y") == 0  # the retired slot is free again
    mgr.unregister("y")  # pinned: slot stays until released
    assert mgr.names() == ["x"] and mgr.pinned_count() == 2
    mgr.release("y")
    assert mgr.pinned_count() == 1
    assert_slot_empty(mgr.slots, 0)


# numerics ----------------------------------------------------------------------------


# (seq_slots, rows of each sequence): decode rows over two adapters and the base; a step with prefill whose
# 9-row run on slot 0 the torch path adds densely, the other rows in tiles
SEQ_SLOTS = [-1, 0, 1, 0, 1]
STEPS = {"decode": [1, 1, 1, 1, 1], "prefill": [1, 9, 2, 3, 1], "rows": [1, 9, 2, 3, 1]}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("backend", ["kernel", "torch", "native"])
def test_each_lora_backend_matches_peft_modules(hf_config, adapters, base_model, backend, step):
    # every backend behind the seam (plan once, apply per projection) against peft's own modules, row by row:
    # BGMV/SGMV (the reference on the CPU), the torch path's dense runs and tiles, the native per-row lora_add
    from loraplex.kernels import cpu_native
    from loraplex.lora.backends import KernelLoraBackend, NativeLoraBackend, TorchLoraBackend

    mgr = new_manager(hf_config, adapters)
    assert mgr.acquire("one") == 0
    assert mgr.acquire("two") == 1
    slots = mgr.slots
    cls = {"kernel": KernelLoraBackend, "torch": TorchLoraBackend, "native": NativeLoraBackend}[backend]
    if backend == "native" and not cpu_native.lora_stacks_native(slots.a[0]["q_proj"], slots.b_t[0]["q_proj"],
                                                                 slots.ranks[0]["q_proj"], slots.scales[0]["q_proj"]):
        pytest.skip("the native library is not built here")
    lengths = STEPS[step]
    cu = np.concatenate(([0], np.cumsum(lengths)))
    plan = cls(slots, torch.from_numpy).plan(np.array(SEQ_SLOTS, np.int32), cu, step == "decode", step == "rows")
    row_slots = np.repeat(SEQ_SLOTS, lengths).tolist()
    pms = {0: adapters["one"][1], 1: adapters["two"][1]}
    gen = torch.Generator().manual_seed(123)
    for layer in range(hf_config.num_hidden_layers):
        for m in MODULES:
            x = torch.randn(len(row_slots), slots.shapes[m][0], generator=gen)
            base = peft_module(adapters["one"][1], layer, m)
            base = getattr(base, "base_layer", base)
            with torch.no_grad():
                y = x @ base.weight.T
                plan.apply(y, x, layer, m)
                expected = torch.cat([(base if s < 0 else peft_module(pms[s], layer, m))(x[t:t + 1])
                                      for t, s in enumerate(row_slots)])
            torch.testing.assert_close(y, expected, atol=1e-5, rtol=0, msg=lambda msg: f"{layer} {m}: {msg}")


def test_slot_tiles_layout():
    # rows 1, 3 on slot 2 and row 4 on slot 4: tiles for slots 2..4 of 2 rows; slot 3 and one entry of
    # slot 4 are padding, which adds to no row
    ranks = [0, 0, 8, 64, 4]  # slot 3 is in the range but unused: its rank does not count
    tiles = SlotTiles.plan(np.array([1, 3, 4]), np.array([2, 2, 4]), ranks, torch.from_numpy)
    assert (tiles.lo, tiles.hi, tiles.size, tiles.rank) == (2, 5, 2, 8)
    assert tiles.gather.tolist() == [1, 3, 0, 0, 4, 0]
    assert tiles.picks.tolist() == [0, 1, 4] and tiles.dest.tolist() == [1, 3, 4]
    full = SlotTiles.plan(np.array([0, 1, 2, 3]), np.array([1, 0, 1, 0]), [4, 4], torch.from_numpy)
    assert full.gather.tolist() == [1, 3, 0, 2] and full.picks is None and full.dest.tolist() == [1, 3, 0, 2]


def test_slot_tiles_refuse_sparse_slots_and_one_dominant_adapter():
    ranks = [8] * 11
    assert SlotTiles.plan(np.array([0, 1]), np.array([0, 9]), ranks, torch.from_numpy) is None  # 8 unused slots between
    rows = np.arange(60)
    slots = np.array([0] * 50 + list(range(1, 11)))  # one adapter owns 50 of 60 rows: 11 tiles of 50
    assert SlotTiles.plan(rows, slots, ranks, torch.from_numpy) is None
    assert SlotTiles.plan(np.array([], dtype=np.int64), np.array([], dtype=np.int64), ranks, torch.from_numpy) is None


def test_slot_reuse_zeroes_exactly_what_the_last_adapter_wrote(hf_config, adapters):
    """clear() zeroes only the previous adapter's rows; a reused slot still holds exactly the new adapter
    (zeros past its ranks and in modules it does not target), whatever the slot held before."""
    slots = new_slots(hf_config)
    for name in ("three", "one", "two", "four", "one"):
        adapter = load_peft_adapter(adapters[name][0], name, hf_config, 8)
        slots.load(0, adapter)
        assert_slot_holds(slots, 0, adapter)
    slots.clear(0)
    assert all(not slots.a[layer][m].any() and not slots.b[layer][m].any()
               for layer in range(slots.num_layers) for m in MODULES)
