"""PEFT adapter loading and validation, with peft itself as the oracle."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_llama import tiny_config
from transformers import MistralConfig, Qwen2Config

from loraplex.lora import adapter as adapter_module
from loraplex.lora import patterns as patterns_module
from loraplex.lora.adapter import REGEX_BUDGET_SECONDS, CONVERSION_HINT, LoraAdapter, check_safetensors_header, load_peft_adapter, max_adapter_tensors, max_header_bytes
from loraplex.exceptions import AdapterError
from loraplex.lora.shapes import MODULES, module_shapes, normalize_target

ALL = list(MODULES)
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def make(base_model, tmp_path_factory):
    """make(seed, **LoraConfig kwargs) -> (adapter folder, peft model)."""

    def build(seed=1, **kw):
        kw.setdefault("r", 4)
        kw.setdefault("lora_alpha", 8)
        kw.setdefault("target_modules", ALL)
        torch.manual_seed(seed)
        pm = get_peft_model(copy.deepcopy(base_model), LoraConfig(init_lora_weights=False, **kw))
        folder = tmp_path_factory.mktemp("adapter")
        pm.save_pretrained(str(folder))
        return folder, pm

    return build


@pytest.fixture(scope="module")
def good(make):
    return make(seed=1)


def peft_module(pm, layer, module):
    layer_mod = pm.base_model.model.model.layers[layer]
    parent = layer_mod.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else layer_mod.mlp
    return getattr(parent, module)


def load(folder, hf_config, max_rank=16, **kw) -> LoraAdapter:
    return load_peft_adapter(folder, "t", hf_config, max_rank, **kw)


def copy_of(good, tmp_path):
    dst = tmp_path / "a"
    shutil.copytree(good[0], dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / CONFIG).read_text())
    cfg.update(changes)
    (folder / CONFIG).write_text(json.dumps(cfg))


def edit_tensors(folder, fn):
    tensors = load_file(str(folder / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(folder / WEIGHTS))


# shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    tiny_config(),
    tiny_config(head_dim=32),
    MistralConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                  intermediate_size=96, vocab_size=300),
    Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=80, vocab_size=300),
], ids=["llama", "llama-head_dim", "mistral", "qwen2"])
def test_module_shapes_match_hf_linear_layers(cfg):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg)
    layer = model.model.layers[0]
    expected = {}
    for m in MODULES:
        lin = getattr(layer.self_attn if m in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, m)
        expected[m] = (lin.in_features, lin.out_features)
    assert module_shapes(cfg) == expected


def test_module_shapes_tiny_llama_exact(hf_config):
    assert module_shapes(hf_config) == {
        "q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
        "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64),
    }


@pytest.mark.parametrize("name,short", [
    ("q_proj", "q_proj"), ("self_attn.k_proj", "k_proj"), ("model.layers.0.self_attn.o_proj", "o_proj"),
    ("base_model.model.model.layers.3.mlp.down_proj", "down_proj"), ("mlp.gate_proj", "gate_proj"),
])
def test_normalize_target_accepts_short_and_full_names(name, short):
    assert normalize_target(name) == short


@pytest.mark.parametrize("name", ["lm_head", "embed_tokens", "mlp.q_proj", "self_attn.up_proj", "", "qkv_proj"])
def test_normalize_target_rejects_unknown(name):
    with pytest.raises(ValueError):
        normalize_target(name)


# loading -----------------------------------------------------------------------------


def test_loaded_weights_equal_peft(good, hf_config):
    folder, pm = good
    ad = load(folder, hf_config)
    assert ad.name == "t" and ad.path == str(folder) and ad.rank == 4
    assert set(ad.weights) == {(layer, m) for layer in range(2) for m in MODULES}
    for (layer, m), (a, b, scale) in ad.weights.items():
        mod = peft_module(pm, layer, m)
        assert torch.equal(a, mod.lora_A["default"].weight.detach())
        assert torch.equal(b, mod.lora_B["default"].weight.detach())
        assert scale == mod.scaling["default"] == 2.0
        assert a.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
    cfg_bytes = (folder / CONFIG).read_bytes()
    w_bytes = (folder / WEIGHTS).read_bytes()
    assert ad.digest == hashlib.sha256(len(cfg_bytes).to_bytes(8, "little") + cfg_bytes + w_bytes).hexdigest()
    assert ad.nbytes() == sum(a.nbytes + b.nbytes for a, b, _ in ad.weights.values())


def test_rslora_scale_is_alpha_over_sqrt_r(make, hf_config):
    folder, pm = make(seed=2, r=4, lora_alpha=8, use_rslora=True, target_modules=["v_proj"])
    ad = load(folder, hf_config)
    for (layer, m), (_a, _b, scale) in ad.weights.items():
        assert scale == pytest.approx(8 / math.sqrt(4))
        assert scale == pytest.approx(peft_module(pm, layer, m).scaling["default"])


def test_rank_and_alpha_patterns_follow_peft(make, hf_config):
    folder, pm = make(seed=3, r=4, lora_alpha=8,
                      rank_pattern={"down_proj": 2, "model.layers.1.self_attn.q_proj": 8},
                      alpha_pattern={"v_proj": 3})
    ad = load(folder, hf_config)
    assert ad.rank == 8
    for (layer, m), (a, b, scale) in ad.weights.items():
        mod = peft_module(pm, layer, m)
        r = mod.r["default"]
        assert a.shape == (r, module_shapes(hf_config)[m][0]) and b.shape[1] == r
        assert scale == pytest.approx(mod.scaling["default"])
    assert ad.weights[(1, "q_proj")][0].shape[0] == 8
    assert ad.weights[(0, "q_proj")][0].shape[0] == 4
    assert ad.weights[(0, "down_proj")][0].shape[0] == 2
    assert ad.weights[(0, "v_proj")][2] == pytest.approx(3 / 4)


@pytest.mark.parametrize("layers,expected", [([1], {1}), (0, {0})])
def test_layers_to_transform(make, hf_config, layers, expected):
    folder, pm = make(seed=4, target_modules=["q_proj", "up_proj"], layers_to_transform=layers)
    ad = load(folder, hf_config)
    assert set(ad.weights) == {(layer, m) for layer in expected for m in ("q_proj", "up_proj")}
    for (layer, m), (a, _b, _s) in ad.weights.items():
        assert torch.equal(a, peft_module(pm, layer, m).lora_A["default"].weight.detach())


def test_mixed_and_regex_target_modules(make, hf_config):
    folder, _ = make(seed=5, target_modules=["k_proj", "o_proj", "gate_proj"])
    assert set(load(folder, hf_config).weights) == {(i, m) for i in range(2) for m in ("k_proj", "o_proj", "gate_proj")}
    folder, pm = make(seed=6, target_modules=r".*\.layers\.1\.(self_attn\.v_proj|mlp\.down_proj)")
    ad = load(folder, hf_config)
    assert set(ad.weights) == {(1, "v_proj"), (1, "down_proj")}
    assert torch.equal(ad.weights[(1, "down_proj")][1], peft_module(pm, 1, "down_proj").lora_B["default"].weight.detach())


def test_exclude_modules(make, hf_config):
    folder, _ = make(seed=7, target_modules=["q_proj", "k_proj"], exclude_modules=["model.layers.0.self_attn.k_proj"])
    assert set(load(folder, hf_config).weights) == {(0, "q_proj"), (1, "q_proj"), (1, "k_proj")}


def test_dtype_conversion(good, hf_config):
    folder, pm = good
    ad = load(folder, hf_config, dtype=torch.float16)
    a, b, _ = ad.weights[(1, "gate_proj")]
    assert a.dtype == b.dtype == torch.float16
    assert torch.equal(a, peft_module(pm, 1, "gate_proj").lora_A["default"].weight.detach().half())


@pytest.mark.parametrize("rename", [
    lambda k: k.removeprefix("base_model.model."),
    lambda k: k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"),
], ids=["no-prefix", "adapter-name-segment"])
def test_accepts_key_variants(good, hf_config, tmp_path, rename):
    folder = copy_of(good, tmp_path)
    ref = load(good[0], hf_config)
    tensors = load_file(str(folder / WEIGHTS))
    save_file({rename(k): v for k, v in tensors.items()}, str(folder / WEIGHTS))
    ad = load(folder, hf_config)
    assert set(ad.weights) == set(ref.weights)
    for key, (a, b, s) in ref.weights.items():
        assert torch.equal(ad.weights[key][0], a) and torch.equal(ad.weights[key][1], b) and ad.weights[key][2] == s


# validation --------------------------------------------------------------------------


def expect_error(folder, hf_config, *fragments, max_rank=16, **kw):
    with pytest.raises(AdapterError) as info:
        load(folder, hf_config, max_rank=max_rank, **kw)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_missing_folder_and_files(good, hf_config, tmp_path):
    expect_error(tmp_path / "nope", hf_config, "does not exist")
    folder = copy_of(good, tmp_path)
    (folder / CONFIG).unlink()
    expect_error(folder, hf_config, "missing adapter_config.json")
    folder2 = tmp_path / "b"
    shutil.copytree(good[0], folder2)
    (folder2 / WEIGHTS).unlink()
    expect_error(folder2, hf_config, "missing adapter_model.safetensors")


def test_pickle_only_adapter_is_refused(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    torch.save(load_file(str(folder / WEIGHTS)), str(folder / "adapter_model.bin"))
    (folder / WEIGHTS).unlink()
    expect_error(folder, hf_config, "adapter_model.bin", "pickle", "refused")


def test_unparseable_config(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / CONFIG).write_text("{not json")
    expect_error(folder, hf_config, "adapter_config.json is not valid JSON")
    (folder / CONFIG).write_text("[1, 2]")
    expect_error(folder, hf_config, "JSON object")


def test_corrupt_safetensors(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    expect_error(folder, hf_config, "not a valid safetensors file")


@pytest.mark.parametrize("changes,fragment", [
    ({"peft_type": "PREFIX_TUNING"}, "peft_type is 'PREFIX_TUNING'"),
    ({"use_dora": True}, "no lora_magnitude_vector"),  # DoRA without its magnitudes
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"lora_bias": True}, "lora_bias"),
    ({"r": 0}, "r must be a positive integer"),
    ({"lora_alpha": "x"}, "lora_alpha must be a number"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "score"]},
     "unknown target module 'score'"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]},
     "targets lm_head but the weights have no LoRA pair"),
    ({"target_modules": None}, "target_modules is not set"),
    ({"layers_to_transform": [0, 1, 5]}, "layers_to_transform lists layer 5"),
    ({"rank_pattern": {"q_proj(": 2}}, "rank_pattern pattern 'q_proj(' is not a valid regex"),
    ({"target_modules": "model.*[q_proj"}, "target_modules pattern"),
    ({"target_modules": "lm_head"}, "targets lm_head but the weights have no LoRA pair"),
    ({"target_modules": "lm_heads"}, "targets none of the modules"),
])
def test_config_errors(good, hf_config, tmp_path, changes, fragment):
    folder = copy_of(good, tmp_path)
    edit_config(folder, **changes)
    expect_error(folder, hf_config, fragment)


def test_tensor_not_targeted_by_config(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    expect_error(folder, hf_config, "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
                 "does not target")


def test_shape_mismatch_names_tensor_and_expected_shape(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.__setitem__(Q0_A, torch.zeros(4, 32)))
    msg = expect_error(folder, hf_config, Q0_A, "[4, 32]", "expected [4, 64]")
    assert msg.endswith("has shape [4, 32], expected [4, 64]")
    folder2 = tmp_path / "b"
    shutil.copytree(good[0], folder2)
    edit_tensors(folder2, lambda t: t.__setitem__(Q0_B, torch.zeros(64, 3)))
    expect_error(folder2, hf_config, Q0_B, "[64, 3]", "expected [64, 4]")


def test_adapter_for_other_model_is_rejected(good, hf_config):
    bigger = tiny_config(intermediate_size=256)
    expect_error(good[0], bigger, "gate_proj.lora_B.weight", "expected [256, 4]")


def test_rank_above_max_lora_rank(good, hf_config):
    expect_error(good[0], hf_config, "rank 4", "max_lora_rank 2", max_rank=2)


def test_incomplete_pair(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.pop(Q0_B))
    expect_error(folder, hf_config, "incomplete LoRA pair", Q0_A, "lora_B missing")


def test_targeted_module_without_tensors(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: (t.pop(Q0_A), t.pop(Q0_B)))
    expect_error(folder, hf_config, "model.layers.0.self_attn.q_proj", "no lora_A / lora_B tensors")


def swap_in(tensors: dict, key: str, value: torch.Tensor) -> None:
    """Put a tensor in place of layer 1's down_proj pair: a full adapter stays within the tensor count bound."""
    for kind in ("A", "B"):
        del tensors[f"base_model.model.model.layers.1.mlp.down_proj.lora_{kind}.weight"]
    tensors[key] = value


def test_layer_index_out_of_range(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    key = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    edit_tensors(folder, lambda t: swap_in(t, key, torch.zeros(4, 64)))
    expect_error(folder, hf_config, key, "layer 7", "2 layers")


@pytest.mark.parametrize("key,fragment", [
    ("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", "unknown LoRA target module"),
    ("base_model.model.lm_head.lora_A.weight", "which adapter_config.json does not target"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "expected [4, 300]"),
    ("base_model.model.model.norm.lora_A.weight", "not a decoder-layer projection"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "lora_magnitude_vector"),
    ("base_model.model.lm_head.weight", "modules_to_save"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "lora_bias"),
])
def test_unsupported_tensors(good, hf_config, tmp_path, key, fragment):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: swap_in(t, key, torch.zeros(4, 64)))
    expect_error(folder, hf_config, key, fragment)


def test_non_floating_dtype(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.__setitem__(Q0_A, torch.zeros(4, 64, dtype=torch.int32)))
    expect_error(folder, hf_config, Q0_A, "torch.int32", "floating-point")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values(good, hf_config, tmp_path, bad):
    folder = copy_of(good, tmp_path)

    def poison(t):
        t[Q0_B] = t[Q0_B].clone()
        t[Q0_B][3, 1] = bad

    edit_tensors(folder, poison)
    expect_error(folder, hf_config, Q0_B, "NaN or infinite")


def test_overflow_on_dtype_conversion(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.__setitem__(Q0_A, torch.full((4, 64), 1e6)))
    load(folder, hf_config)  # fine in fp32
    expect_error(folder, hf_config, Q0_A, "overflows torch.float16", dtype=torch.float16)


# hostile input: paths, safetensors headers, regexes ------------------------------------

def test_error_messages_name_no_server_path(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.__setitem__(Q0_A, torch.zeros(4, 32)))
    for target in (folder, tmp_path / "nope"):
        message = expect_error(target, hf_config, "adapter 't'")
        assert str(tmp_path) not in message, message


def _header_of(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def test_safetensors_header_is_checked_against_the_real_size(good):
    data = (good[0] / WEIGHTS).read_bytes()
    header = _header_of(data)
    body = data[8 + int.from_bytes(data[:8], "little"):]
    assert check_safetensors_header(data).keys() == {k for k in header if k != "__metadata__"}
    names = sorted(k for k in header if k != "__metadata__")
    b0, e0 = header[names[0]]["data_offsets"]

    def lie(name, **changes):
        return _with_header({**header, name: {**header[name], **changes}}, body)

    cases = {
        b"\x01\x02": "shorter than the 8-byte header length",
        (2**40).to_bytes(8, "little") + b"{}": "header length",
        (len(data)).to_bytes(8, "little") + data[8:]: "runs past the end",
        data[:-1]: "data_offsets",
        data + b"\0": "cover",
        lie(names[0], data_offsets=[b0, 10**15]): "outside",
        _with_header({**header, "zz.extra": header[names[0]]}, body): "overlapping",
        lie(names[0], shape=[1]): "needs",
        lie(names[0], dtype="F4"): "unknown dtype",
        lie(names[0], shape=[-1, 4]): "non-negative",
        _with_header({**header, names[0]: [1, 2]}, body): "expected dtype, shape and data_offsets",
        _with_header({**header, "__metadata__": {"a": 1}}, body): "__metadata__",
        b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]": "not a JSON object",
    }
    assert e0 - b0 > 0
    for blob, fragment in cases.items():
        with pytest.raises(AdapterError) as info:
            check_safetensors_header(blob)
        assert "not a valid safetensors file" in str(info.value) and fragment in str(info.value), str(info.value)


def test_safetensors_with_a_lying_header_is_refused_before_parsing(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    data = (folder / WEIGHTS).read_bytes()
    header = _header_of(data)
    name = min(k for k in header if k != "__metadata__")
    header[name]["shape"] = [4, 10**6]
    (folder / WEIGHTS).write_bytes(_with_header(header, data[8 + int.from_bytes(data[:8], "little"):]))
    expect_error(folder, hf_config, "adapter 't': adapter_model.safetensors is not a valid safetensors file", name)


def test_pickle_bytes_are_named_as_pickle(good):
    import io

    buf = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, buf)
    for blob in (buf.getvalue(), b"\x80\x04\x95garbage"):
        with pytest.raises(AdapterError, match="pickle is refused"):
            check_safetensors_header(blob)


@pytest.mark.parametrize("field,value", [
    ("target_modules", "q" * 257),
    ("exclude_modules", "k" * 300),
    ("rank_pattern", {"q" * 257: 2}),
    ("alpha_pattern", {"v" * 257: 2}),
    ("layers_pattern", "l" * 257),
])
def test_long_regexes_are_refused(good, hf_config, tmp_path, field, value):
    folder = copy_of(good, tmp_path)
    edit_config(folder, **{field: value})
    expect_error(folder, hf_config, f"{field} pattern is", "at most 256")


SLOW = r"(.|..)+\d\d\d"  # exponential backtracking on a module name such as model.layers.1.self_attn.q_proj


@pytest.mark.parametrize("field,value", [
    ("target_modules", SLOW),
    ("exclude_modules", SLOW),
    ("rank_pattern", {SLOW: 2}),
    ("alpha_pattern", {SLOW: 2}),
])
def test_catastrophic_regexes_time_out(good, hf_config, tmp_path, field, value, monkeypatch):
    folder = copy_of(good, tmp_path)
    edit_config(folder, **{field: value})
    timeouts = []

    class Recorded:
        """A compiled pattern that records the time bound of each match."""

        def __init__(self, pattern):
            self.compiled = real_regex.compile(pattern)

        def __getattr__(self, method):
            def call(key, timeout=None):
                timeouts.append(timeout)
                return getattr(self.compiled, method)(key, timeout=timeout)
            return call

    real_regex = patterns_module.regex
    monkeypatch.setattr(patterns_module, "regex", SimpleNamespace(compile=Recorded, error=real_regex.error))
    expect_error(folder, hf_config, f"matching the {field} patterns took longer than 0.5 s")
    assert timeouts and all(t is not None and 0 <= t <= REGEX_BUDGET_SECONDS for t in timeouts)


def test_the_regex_budget_is_one_deadline_for_the_whole_load(good, hf_config, tmp_path, monkeypatch):
    """Matches that each end within their bound still stop the load once their sum passes the budget (fake clock)."""
    folder = copy_of(good, tmp_path)
    edit_config(folder, target_modules=r".*\.q_proj")
    clock = SimpleNamespace(now=0.0, monotonic=lambda: clock.now)

    class TakesAFifth:
        """A compiled pattern whose every match takes a fifth of the budget on the fake clock (none matches)."""

        def __init__(self, pattern):
            pass

        def __getattr__(self, method):
            def call(key, timeout=None):
                step = REGEX_BUDGET_SECONDS / 5
                clock.now += min(step, timeout)
                if step >= timeout:
                    raise TimeoutError
            return call

    monkeypatch.setattr(patterns_module, "time", clock)
    monkeypatch.setattr(patterns_module, "regex", SimpleNamespace(compile=TakesAFifth, error=patterns_module.regex.error))
    expect_error(folder, hf_config, "matching the target_modules patterns took longer than 0.5 s")
    assert clock.now <= REGEX_BUDGET_SECONDS + 1e-9


def test_the_regex_budget_counts_only_the_time_spent_matching(monkeypatch):
    """A load that spends seconds elsewhere (reading tensors on a busy machine) still has the whole budget to match
    in (CI once refused a good rank_pattern after its weights took 0.5 s to load)."""
    clock = SimpleNamespace(now=0.0, monotonic=lambda: clock.now)
    monkeypatch.setattr(patterns_module, "time", clock)
    patterns = patterns_module.Patterns("adapter 'slow'")
    clock.now += 10.0  # not matching
    assert patterns.fullmatch("rank_pattern", r".*\.q_proj", "model.layers.0.self_attn.q_proj")
    assert patterns.left == REGEX_BUDGET_SECONDS


# the header bound: tensors an adapter of this base model may hold ----------------------


def test_the_tensor_bound_is_two_per_projection_per_layer(hf_config):
    assert max_adapter_tensors(hf_config) == 2 * 2 * 7 + 8 == 36  # and embed_tokens' and lm_head's (lora/vocab.py)
    assert max_header_bytes(36) == 64 * 1024 + 36 * 1024


def _zero_size_header(count: int) -> bytes:
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return len(raw).to_bytes(8, "little") + raw


def test_a_header_longer_than_the_bound_is_refused_before_it_is_parsed(hf_config):
    n = 112_891  # the length of 2,000 zero-size tensors' header; the bound is 102,400
    assert int.from_bytes(_zero_size_header(2000)[:8], "little") == n
    not_json = n.to_bytes(8, "little") + b"\xff" * n
    with pytest.raises(AdapterError) as info:
        check_safetensors_header(not_json, max_adapter_tensors(hf_config))
    assert str(info.value) == (f"adapter_model.safetensors is not a valid safetensors file: header length {n} is "
                               f"more than an adapter of this base model needs (102400 bytes for at most 36 tensors)")
    with pytest.raises(AdapterError, match="header is not valid JSON"):  # without the bound it is parsed
        check_safetensors_header(not_json)


def test_more_tensors_than_the_model_has_room_for_are_refused_before_any_entry_is_checked(hf_config):
    data = _zero_size_header(1000)  # 55,898 bytes: within the byte bound
    with pytest.raises(AdapterError) as info:
        check_safetensors_header(data, max_adapter_tensors(hf_config))
    assert str(info.value) == ("adapter_model.safetensors is not a valid safetensors file: the header lists 1000 "
                               "tensors; an adapter of this base model has at most 36 (lora_A and lora_B of each "
                               "projection of each layer, its experts and vocabulary parts)")


def test_a_full_adapter_plus_one_tensor_is_refused_by_the_count(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.update({f"extra{i}": torch.zeros(4, 64) for i in range(9)}))
    assert expect_error(folder, hf_config) == (
        "adapter 't': adapter_model.safetensors is not a valid safetensors file: the header lists 37 tensors; "
        "an adapter of this base model has at most 36 (lora_A and lora_B of each projection of each layer, its experts and vocabulary parts)")


def test_zero_element_tensors_are_refused(good, hf_config, tmp_path):
    assert "zero" not in str(check_safetensors_header(_zero_size_header(0)))  # an empty header is well-formed
    with pytest.raises(AdapterError) as info:
        check_safetensors_header(_zero_size_header(1))
    assert str(info.value) == ("adapter_model.safetensors is not a valid safetensors file: tensor 't0': "
                               "shape [0] has no elements")
    folder = copy_of(good, tmp_path)
    edit_tensors(folder, lambda t: t.__setitem__(Q0_A, torch.zeros(0, 64)))
    assert expect_error(folder, hf_config) == (
        f"adapter 't': adapter_model.safetensors is not a valid safetensors file: tensor '{Q0_A}': "
        f"shape [0, 64] has no elements")


# init_lora_weights: peft rewrites the base weights for some values ----------------------

REWRITING = "with it peft rewrites the base model's weights (subtracting the initial adapter), and the adapter " \
            "fits only those rewritten weights; "


@pytest.mark.parametrize("value", ["pissa", "pissa_niter_4", "olora", "corda", "lora_ga", "OLoRA"])
def test_inits_that_rewrite_base_weights_are_refused_with_peft_conversion(good, hf_config, tmp_path, value):
    folder = copy_of(good, tmp_path)
    edit_config(folder, init_lora_weights=value)
    assert expect_error(folder, hf_config) == (
        f"adapter 't': init_lora_weights=\"{value}\" is not supported: {REWRITING}{CONVERSION_HINT}")
    assert "save_pretrained(output_dir, path_initial_model_for_weight_conversion=<that folder>)" in CONVERSION_HINT


def test_loftq_is_refused(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, init_lora_weights="loftq")
    assert expect_error(folder, hf_config) == (
        "adapter 't': init_lora_weights=\"loftq\" is not supported: peft replaces the base model's weights with a "
        "quantized residual when it loads a LoftQ adapter, and the adapter fits only those weights (peft has no "
        "conversion of LoftQ adapters to plain LoRA)")


@pytest.mark.parametrize("value", ["nonsense", 1, None, "EVA"])
def test_unknown_init_values_are_refused(good, hf_config, tmp_path, value):
    folder = copy_of(good, tmp_path)
    edit_config(folder, init_lora_weights=value)
    assert expect_error(folder, hf_config) == (
        f"adapter 't': init_lora_weights={json.dumps(value)} is not supported; accepted values: true, false, "
        f"\"gaussian\", \"eva\", \"orthogonal\", \"mica\"")


@pytest.mark.parametrize("value", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_inits_that_leave_base_weights_alone_are_accepted(good, hf_config, tmp_path, value):
    folder = copy_of(good, tmp_path)
    edit_config(folder, init_lora_weights=value)
    ad, ref = load(folder, hf_config), load(good[0], hf_config)
    assert ad.weights.keys() == ref.weights.keys()
    assert all(torch.equal(ad.weights[k][0], ref.weights[k][0]) for k in ref.weights)


@pytest.mark.parametrize("value,rewrites", [("pissa", True), ("olora", True), (True, False), (False, False),
                                            ("gaussian", False), ("eva", False), ("orthogonal", False),
                                            ("mica", False)])
def test_peft_rewrites_the_base_weights_exactly_for_the_refused_values(good, base_model, tmp_path, value, rewrites):
    """The oracle: peft's from_pretrained of the same adapter files, base weights before and after."""
    from peft import PeftModel

    folder = copy_of(good, tmp_path)
    edit_config(folder, init_lora_weights=value)
    model = copy.deepcopy(base_model)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    pm = PeftModel.from_pretrained(model, str(folder))
    after = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach()
    assert (not torch.equal(before, after)) == rewrites


# regexes are bounded before anything compiles them (decision 060) ------------------------

BOMB = "(?:(?:(?:a{200}){200}){200})"  # 29 characters; regex.compile unrolls it into 8 million atoms


@pytest.mark.parametrize("field,value", [
    ("target_modules", BOMB),
    ("exclude_modules", BOMB),
    ("rank_pattern", {BOMB: 2}),
    ("alpha_pattern", {BOMB: 2}),
    ("layers_pattern", BOMB),
    ("target_modules", "a{1000}" * 2),
    ("target_modules", "(?:(?:(?:(?:(?:(?:(?:(?:(?:(?:(?:ab)+?)+?)+?)+?)+?)+?)+?)+?)+?)+?)+?"),
])
def test_regex_bombs_are_refused_before_anything_compiles_them(good, hf_config, tmp_path, field, value, monkeypatch):
    folder = copy_of(good, tmp_path)
    edit_config(folder, **{field: value})

    def never(*args, **kwargs):
        raise AssertionError("a refused pattern was compiled")

    monkeypatch.setattr(patterns_module, "regex", SimpleNamespace(compile=never, error=patterns_module.regex.error))
    monkeypatch.setattr(patterns_module, "re", SimpleNamespace(compile=never, error=patterns_module.re.error))
    expect_error(folder, hf_config, f"{field} pattern", f"expands past {patterns_module.MAX_REGEX_SIZE} atoms")


def test_counted_repeats_nested_too_deep_are_refused(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    edit_config(folder, target_modules="(?:" * 5 + "ab" + "){2}" * 5)  # 64 atoms, but 5 deep
    expect_error(folder, hf_config, "target_modules pattern", "nests counted repeats 5 deep; at most 4")


@pytest.mark.parametrize("pattern", [r"q_proj{e<=1}", r"(?:.*\.q_proj){i}", r"x\{2}"])
def test_a_brace_that_is_no_repeat_count_is_refused(good, hf_config, tmp_path, pattern):
    """The regex package reads fuzzy matching where re (peft) reads a literal '{': no pattern may differ."""
    folder = copy_of(good, tmp_path)
    edit_config(folder, target_modules=pattern)
    expect_error(folder, hf_config, "target_modules pattern", "is not a repeat count")


@pytest.mark.parametrize("pattern,size,depth", [
    ("abc", 3, 0), ("(?:ab){3}", 6, 1), ("a+", 2, 1), ("a*", 1, 0), ("a?", 1, 0), ("[abc]", 3, 0),
    ("a|bc", 3, 0), ("(?:(?:a){2,}){3}", 9, 2), (BOMB, patterns_module.MAX_REGEX_SIZE + 1, 3),
])
def test_expanded_size_unrolls_counts_without_expanding_them(pattern, size, depth):
    assert patterns_module.expanded_size(pattern) == (size, depth)


@pytest.mark.parametrize("pattern", [
    r".*\.layers\.\d+\.self_attn\.(q|k|v|o)_proj",
    r"model\.layers\.(?:[0-9]|1[0-5])\.mlp\.(gate|up|down)_proj",
    r"^(?!.*vision).*\.(q_proj|v_proj)$",
    r"(?:^|.*\.)(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$",
    r".*layers\.\d{1,3}\.(self_attn|mlp)\.\w+_proj",
    r"(?i).*\.Q_PROJ",
    r"model\.layers\.(0|1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16|17|18|19|20|21|22|23)\.self_attn\.[qkvo]_proj",
])
def test_real_peft_patterns_pass(pattern):
    patterns_module.check_pattern("target_modules", pattern, "adapter 't'")


def test_a_pattern_peft_cannot_apply_is_refused_naming_the_field(good, hf_config, tmp_path):
    """peft matches rank_pattern keys inside (.*\\.)?(<key>)$: a global flag there is an error in re, and here."""
    folder = copy_of(good, tmp_path)
    edit_config(folder, rank_pattern={"(?i)q_proj": 2})
    expect_error(folder, hf_config, "rank_pattern pattern is not a valid regex as peft applies it")


def test_a_deeply_nested_or_oversized_config_is_refused(good, hf_config, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / CONFIG).write_text("[" * 40_000 + "]" * 40_000)
    expect_error(folder, hf_config, f"{CONFIG} is 80000 bytes; at most {adapter_module.MAX_CONFIG_BYTES}")
    (folder / CONFIG).write_text("[" * 30_000 + "]" * 30_000)
    expect_error(folder, hf_config, f"{CONFIG} nests too deeply")
