"""DoRA adapters (use_dora) against peft: y = s * (W x + scale B A x) + bias, s = m / ||W + scale B A|| per output
row, computed once at adapter load (decision 052). Greedy tokens equal peft's, DoRA alone and in one batch with a
plain LoRA adapter and the base model, on the native CPU path, the torch path and the kernels on the shim."""

from __future__ import annotations


import pytest
import torch

import peft_reference as ref
from tiny_llama import run_greedy
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kernels import dispatch
from loraplex.lora.backends import native

# Qwen2: q/k/v carry a bias, which DoRA leaves unscaled. Head dim 32: a kernel instantiation for the shim.
MODEL = dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
MAX_TOKENS = 6
BATCH = [("dora", "dora", "The quick brown fox"), ("lora", "lora", "Hello world"), ("base", None, "1, 2, 3,")]


def build_dora(model_dir: str, out, seed: int):
    """A peft DoRA adapter on every projection whose magnitudes differ from the merged norms (s != 1)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).float()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"],
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", init_lora_weights=False, use_dora=True)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
            if "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.7, 1.3))
    peft_model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    root = tmp_path_factory.mktemp("dora-model")
    model_dir = str(build_tiny_llama(root / "model", **MODEL))
    adapters = {"dora": build_dora(model_dir, root / "dora", 41),
                "lora": str(build_peft_adapter(model_dir, root / "lora", 8, 16, ["q_proj", "v_proj", "down_proj"],
                                               42, b_scale=0.3))}
    return model_dir, adapters


def run(model_dir, adapters, batch):
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", multi_lora=adapters,
                                    max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=8))
    requests, tokens = run_greedy(engine, [(rid, lora, prompt, 1) for rid, lora, prompt in batch], MAX_TOKENS)
    return engine, requests, tokens


@pytest.mark.parametrize("mode", ["auto", "reference", "shim"])
@pytest.mark.parametrize("batch", [BATCH[:1], BATCH], ids=["dora-alone", "mixed"])
def test_dora_matches_peft(tiny, monkeypatch, mode, batch):
    monkeypatch.setenv(dispatch.ENV, mode)
    monkeypatch.setattr(dispatch, "MODE", dispatch.read_mode())
    model_dir, adapters = tiny
    each = []
    monkeypatch.setattr(native.NativeRowsEach, "__init__",
                        lambda self, *a: (each.append(1), native.NativeRows.__init__(self, *a))[1])
    engine, requests, tokens = run(model_dir, adapters, batch)
    assert engine.lora_slots.dora_slots  # the DoRA adapter is resident, its scales in the stack
    native_backend = isinstance(engine.runner.lora, native.NativeLoraBackend)
    assert native_backend == (mode == "auto") and bool(each) == native_backend  # DoRA rows left the one call
    for rid, req in requests.items():
        lora = req.params.lora_name
        want = ref.greedy_tokens(model_dir, adapters[lora] if lora else None, req.prompt_token_ids, MAX_TOKENS)
        assert tokens[rid, 0] == want, (mode, rid)
    ids = requests["dora"].prompt_token_ids
    dora, base = (ref.first_logits(model_dir, adapters["dora"], ids), ref.first_logits(model_dir, None, ids))
    assert float((dora - base).abs().max()) > 1e-2  # DoRA moves the logits (the test is not vacuous)


def test_dora_scale_is_computed_once_at_load(tiny):
    """The output scale equals peft's m / ||W + scale B A|| and is computed once per adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.lora.adapter import load_peft_adapter
    from loraplex.models.loader import load_hf_config

    model_dir, adapters = tiny
    cfg = load_hf_config(model_dir)
    adapter = load_peft_adapter(adapters["dora"], "dora", cfg, 8)
    assert len(adapter.magnitudes) == 2 * 7
    base = AutoModelForCausalLM.from_pretrained(model_dir).float()
    calls = []

    def weight(layer, module):
        calls.append((layer, module))
        parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return getattr(getattr(base.model.layers[layer], parent), module).weight

    scales = adapter.dora_scales(weight)
    assert adapter.dora_scales(weight) is scales and len(calls) == 14  # once per module, then kept
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir).float(), adapters["dora"])
    q = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    with torch.no_grad():
        norm = q.lora_magnitude_vector["default"].get_weight_norm(
            q.base_layer.weight, q.lora_B["default"].weight @ q.lora_A["default"].weight, q.scaling["default"])
        want = q.lora_magnitude_vector["default"].weight / norm
    torch.testing.assert_close(scales[(1, "q_proj")], want.float(), rtol=1e-6, atol=1e-6)


LOGIT_ATOL = 1e-4  # fp32, logits O(10): as tests/engine/test_multi_lora.py


@pytest.mark.parametrize("mode", ["reference", "shim"])
def test_dora_logits_match_peft(tiny, monkeypatch, mode):
    """Prefill (SGMV) and decode (BGMV) logits of DoRA, plain LoRA and base rows in one batch, within LOGIT_ATOL."""
    from test_multi_lora import engine_logits

    monkeypatch.setenv(dispatch.ENV, mode)
    monkeypatch.setattr(dispatch, "MODE", dispatch.read_mode())
    model_dir, adapters = tiny
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", multi_lora=adapters,
                                    max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=8))
    rows = [(engine.tokenizer(p).input_ids, lora) for _, lora, p in BATCH]
    prefill, nxt, decode = engine_logits(engine, rows)
    worst = 0.0
    for i, (ids, lora) in enumerate(rows):
        folder = adapters[lora] if lora else None
        for got, want in ((prefill[i], ref.first_logits(model_dir, folder, ids)),
                          (decode[i], ref.first_logits(model_dir, folder, ids + [nxt[i]]))):
            torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
            worst = max(worst, float((got - want).abs().max()))
    print(f"{mode}: max |engine - peft| logit difference {worst:.2e}")


def test_a_dora_adapter_with_an_infinite_output_scale_fails_its_request_alone(tiny, tmp_path):
    """A magnitude of 3e38 over a row norm under 1 is an infinite scale: refused naming the module, others served."""
    import shutil

    from safetensors.torch import load_file, save_file

    from loraplex.engine.request import SamplingParams

    model_dir, adapters = tiny
    bad = tmp_path / "bad"
    shutil.copytree(adapters["dora"], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    name = next(n for n in tensors if n.endswith("layers.0.self_attn.q_proj.lora_magnitude_vector"))
    tensors[name] = torch.full_like(tensors[name], 3e38)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                                    multi_lora={**adapters, "bad": str(bad)}, max_loras=2, max_lora_rank=8,
                                    num_kv_blocks=64, block_size=8))
    params = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for rid, lora in (("bad", "bad"), ("lora", "lora")):
        engine.add_request(engine.make_request(rid, "Hello world", SamplingParams(lora_name=lora, **params)))
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    error = str(outputs["bad"][-1].error)
    assert outputs["bad"][-1].finished and "DoRA on model.layers.0.self_attn.q_proj" in error and "not finite" in error
    assert sum(len(o.token_ids) for o in outputs["lora"]) == MAX_TOKENS and outputs["lora"][-1].error is None
    assert not engine.lora_slots.dora_slots and engine.adapters.pinned_count() == 0
