"""DoRA adapters (use_dora) at parse and upload: magnitudes are validated like lora_A / lora_B (shape against the
base model, finite values, the tensor count bound), and an upload through the store takes the same checks."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load, save
from tiny_llama import tiny_config
from transformers import LlamaForCausalLM

from loraplex.exceptions import AdapterError, AdapterStoreError
from loraplex.lora.adapter import max_adapter_tensors, parse_peft_adapter
from loraplex.lora.vocab import MAX_VOCAB_TENSORS
from loraplex.lora.store import AdapterStore
from loraplex.tenancy.tenants import Tenant

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ACME = Tenant("acme", b"a")


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def dora(cfg, tmp_path_factory):
    """(adapter_config.json bytes, safetensors tensors) of a DoRA adapter on every projection."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=ALL, use_dora=True,
                                                         init_lora_weights=False))
    folder = tmp_path_factory.mktemp("dora")
    pm.save_pretrained(str(folder))
    return (folder / "adapter_config.json").read_bytes(), load((folder / "adapter_model.safetensors").read_bytes())


def _magnitude(tensors) -> str:
    return next(n for n in sorted(tensors) if n.endswith("layers.1.self_attn.q_proj.lora_magnitude_vector"))


def test_dora_adapter_parses_with_its_magnitudes(cfg, dora):
    config, tensors = dora
    assert len(tensors) == 3 * 2 * 7 == max_adapter_tensors(cfg, dora=True) - MAX_VOCAB_TENSORS
    assert max_adapter_tensors(cfg, dora=True) > max_adapter_tensors(cfg)
    adapter = parse_peft_adapter(config, save(tensors), "d", cfg, 16)
    assert len(adapter.magnitudes) == 14 and adapter.output_scales is None  # scales: at slot load
    torch.testing.assert_close(adapter.magnitudes[(1, "q_proj")], tensors[_magnitude(tensors)])
    assert adapter.nbytes() > sum(a.nbytes + b.nbytes for a, b, _ in adapter.weights.values())


@pytest.mark.parametrize(("edit", "error"), [
    (lambda t: t.fill_(float("nan")), "NaN or infinite"),
    (lambda t: t[:-1], "has shape"),
    (None, "no lora_magnitude_vector"),
])
def test_bad_magnitudes_are_refused(cfg, dora, edit, error):
    config, tensors = dora
    tensors = dict(tensors)
    name = _magnitude(tensors)
    if edit is None:
        del tensors[name]
    else:
        tensors[name] = edit(tensors[name].clone()).contiguous()
    with pytest.raises(AdapterError, match=error):
        parse_peft_adapter(config, save(tensors), "d", cfg, 16)


def test_magnitude_without_use_dora_is_refused(cfg, dora):
    config, tensors = dora
    plain = config.replace(b'"use_dora": true', b'"use_dora": false')
    with pytest.raises(AdapterError, match=f"has at most {28 + MAX_VOCAB_TENSORS}"):  # plain LoRA's count: unparsed
        parse_peft_adapter(plain, save(tensors), "d", cfg, 16)
    one_q = plain.replace(b'"use_dora": false', b'"use_dora": false, "layers_to_transform": [1]')
    one = {n: t for n, t in tensors.items() if ".layers.1." in n}  # 21 tensors: within the count
    with pytest.raises(AdapterError, match="does not set use_dora"):
        parse_peft_adapter(one_q, save(one), "d", cfg, 16)


def test_upload_accepts_dora_and_applies_the_same_checks(cfg, dora, tmp_path):
    config, tensors = dora
    store = AdapterStore(tmp_path / "store")
    stored = store.upload(ACME, "dora", config.decode(), save(tensors), cfg, 16)
    assert stored.rank == 4 and set(stored.target_modules) == set(ALL)
    bad = dict(tensors)
    bad[_magnitude(bad)] = torch.full_like(bad[_magnitude(bad)], float("inf"))
    with pytest.raises(AdapterStoreError, match="NaN or infinite"):
        store.upload(ACME, "dora2", config.decode(), save(bad), cfg, 16)


def _scales_of(cfg, config, tensors):
    """DoRA's output scales of an adapter over zero base weights (W = 0: the norms are those of scale * B A)."""
    from loraplex.lora.shapes import module_shapes

    shapes = module_shapes(cfg)
    adapter = parse_peft_adapter(config, save(tensors), "d", cfg, 16)
    return adapter.dora_scales(lambda layer, module: torch.zeros(shapes[module][1], shapes[module][0]))


@pytest.mark.parametrize(("edit", "error"), [
    ({"magnitude": 3e38, "b": 1e-6}, "the output scale lora_magnitude_vector / ||W + scale * B A|| is not finite"),
    ({"b": 0.0}, "(a magnitude out of range, or a row norm of 0)"),
    ({"a": 1e30, "b": 1e30}, "a row norm of W + scale * B A is not finite"),
])
def test_non_finite_dora_scales_are_refused_naming_the_module(cfg, dora, edit, error):
    config, tensors = dora
    tensors = dict(tensors)
    mag = _magnitude(tensors)
    prefix = mag[: -len("lora_magnitude_vector")]
    if "magnitude" in edit:
        tensors[mag] = torch.full_like(tensors[mag], edit["magnitude"])
    for part in ("a", "b"):
        if part in edit:
            name = f"{prefix}lora_{part.upper()}.weight"
            tensors[name] = torch.full_like(tensors[name], edit[part])
    with pytest.raises(AdapterError) as info:
        _scales_of(cfg, config, tensors)
    assert "DoRA on model.layers.1.self_attn.q_proj" in str(info.value) and error in str(info.value)


def test_finite_dora_scales_pass(cfg, dora):
    config, tensors = dora
    scales = _scales_of(cfg, config, tensors)
    assert len(scales) == 14 and all(bool(torch.isfinite(s).all()) for s in scales.values())
