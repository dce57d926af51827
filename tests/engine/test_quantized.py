"""Quantized bases (issue 41, decision 072): each checkpoint format, written as its tool writes it, and each
quantization at load, served with LoRA and DoRA adapters exactly as transformers + peft serve the dequantized
weights (greedy tokens equal, each token's logprob within exactness.LOGPROB_ATOL); the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from exactness import assert_matches_oracle, run_greedy_logprobs
from family_checkpoints import DENSE_FAMILIES, SMALL
from quant_checkpoints import write_format, write_load_quantized

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.models.quant import UnsupportedQuantization, dequantize, quantize
from loraplex.models.quant.forms import Fp8Weight, Int4Weight, Int8Weight, cat, split
from loraplex.models.quant.plan import resolve

MAX_TOKENS = 8
PROMPTS = ("The quick brown fox jumps", "ab ab ab ab")
# format -> (base model, the adapter beside the base rows); DoRA where the base weight's norms must be read
# back from a quantized checkpoint (the projections are packed away)
CASES = {
    "ct-w8a16": ("llama", "attn"),
    "ct-w8a8": ("llama", "dora"),
    "ct-fp8": ("llama", "attn"),
    "ct-w4a16": ("llama", "dora"),
    "ct-w4a16-asym": ("llama", "attn"),
    "fp8-block": ("qwen3", "dora"),
    "fp8-tensor": ("llama", "attn"),
    "gptq": ("llama", "dora"),
    "gptq-v2": ("llama", "attn"),
    "awq": ("llama", "dora"),
    "load-int8": ("qwen3", "dora"),  # tied embeddings: lm_head gets its own int8 copy
    "load-fp8": ("llama", "attn"),
    "load-int4": ("llama", "dora"),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[str, dict[str, str]]]:
    """A tiny Llama and a tiny Qwen3 (tied embeddings, q/k norms), each with a LoRA and a DoRA adapter."""
    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    root = tmp_path_factory.mktemp("quant")
    out = {}
    for name, spec in (("llama", {}), ("qwen3", DENSE_FAMILIES["qwen3"])):
        model = str(build_tiny_llama(root / name / "model", **{**SMALL, **spec}))
        out[name] = (model, {
            "attn": str(build_peft_adapter(model, root / name / "attn", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"],
                                           seed=10, b_scale=0.3)),
            "dora": str(build_peft_adapter(model, root / name / "dora", 4, 8, ["q_proj", "v_proj", "down_proj"],
                                           seed=11, b_scale=0.3, use_dora=True))})
    return out


def _engine(model_dir: str, adapters: dict[str, str], **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_model_len=128,
                                  num_kv_blocks=48, block_size=4, max_loras=1, max_lora_rank=8, multi_lora=adapters,
                                  **knobs))


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_base_with_adapters_equals_peft_on_the_dequantized_weights(bases, tmp_path, name):
    base, adapter = CASES[name]
    model_dir, adapters = bases[base]
    if name.startswith("load-"):
        method = name.removeprefix("load-")
        served, oracle_dir = model_dir, write_load_quantized(model_dir, tmp_path, method)
    else:
        method, (served, oracle_dir) = "auto", write_format(model_dir, tmp_path, name)
    engine = _engine(served, {adapter: adapters[adapter]}, quantization=method, quantization_fallback="reference")
    plan = engine.model.quant
    assert plan.quantized and plan.source == ("load" if name.startswith("load-") else "checkpoint"), plan
    if plan.served == "int8" and base == "llama":  # the native decode forward runs the int8 panels
        assert engine.model.native_decode is not None
    batch = {"base": (PROMPTS[0], None), adapter: (PROMPTS[1], adapter)}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, MAX_TOKENS)
    assert_matches_oracle(lambda lora: (oracle_dir, adapters.get(lora)), batch, requests, tokens, logprobs, name)


def test_served_full_precision_would_differ_from_the_oracle(bases, tmp_path):
    """The quantized oracle is not the full-precision model: the int4 weights change the logits beyond the
    tolerance, so the exactness above shows the quantized weights are what is served."""
    from peft_reference import first_logits

    model_dir, _ = bases["llama"]
    _, oracle_dir = write_format(model_dir, tmp_path, "gptq")
    ids = [1, 5, 9, 13]
    assert (first_logits(model_dir, None, ids) - first_logits(oracle_dir, None, ids)).abs().max() > 1e-2


def test_quantization_none_dequantizes_a_quantized_checkpoint(bases, tmp_path):
    model_dir, _ = bases["llama"]
    served, oracle_dir = write_format(model_dir, tmp_path, "awq")
    engine = _engine(served, {}, quantization="none")
    assert not engine.model.quant.quantized and engine.model.quant.source == "dequantized"
    batch = {"r": (PROMPTS[0], None)}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, MAX_TOKENS)
    assert_matches_oracle(lambda lora: (oracle_dir, None), batch, requests, tokens, logprobs, "none")


# ---- refusals --------------------------------------------------------------------------------------------------
def _config(tmp_path: Path, model_dir: str, quantization_config: dict) -> str:
    """A copy of model_dir's config (no weights) carrying quantization_config."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return str(folder)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not served"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits 8"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 4, "strategy": "tensor_group"}}}}, "nvfp4-pack-quantized"),
], ids=["bitsandbytes", "gptq-8bit", "awq-gemv", "nvfp4"])
def test_unknown_or_unsupported_formats_are_refused_naming_them(bases, tmp_path, qc, match):
    from loraplex.models.loader import load_hf_config

    cfg = load_hf_config(_config(tmp_path, bases["llama"][0], qc))
    with pytest.raises(UnsupportedQuantization, match=match) as err:
        resolve("auto", cfg, "cpu", torch.float32)
    assert "the quantized checkpoints served are compressed-tensors" in str(err.value)


def test_formats_the_device_cannot_run_are_refused_naming_them(bases, tmp_path):
    from loraplex.models.loader import load_hf_config

    model_dir = bases["llama"][0]
    plain = load_hf_config(model_dir)
    fp8 = load_hf_config(_config(tmp_path, model_dir, {"quant_method": "fp8", "fmt": "e4m3",
                                                       "weight_block_size": [128, 128]}))
    with pytest.raises(ValueError, match=r"fp8 \(block \[128, 128\]\) \(fp8\) does not run on the CPU: the CPU serves "
                                         "int8 only"):
        resolve("auto", fp8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="quantization int4 does not run on the CPU"):
        resolve("int4", plain, "cpu", torch.float32)
    with pytest.raises(ValueError, match="quantization int8 does not run on CUDA"):
        resolve("int8", plain, "cuda", torch.bfloat16)
    assert resolve("auto", fp8, "cpu", torch.float32, fallback="reference").reference
    with pytest.raises(ValueError, match="requantizing it is not served"):
        resolve("int8", fp8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="weight_dtype float16 and quantization int8"):
        resolve("int8", plain, "cpu", torch.float32, fp16_weights=True)
    with pytest.raises(ValueError, match="mixture of experts"):
        resolve("int8", plain, "cpu", torch.float32, moe=True)


def test_act_order_groups_of_other_sizes_are_refused(bases, tmp_path):
    from safetensors.torch import load_file, save_file

    served, _ = write_format(bases["llama"][0], tmp_path, "gptq")
    weights = load_file(f"{served}/model.safetensors")
    name = "model.layers.0.self_attn.q_proj.g_idx"
    weights[name] = torch.zeros_like(weights[name])  # every input in group 0
    save_file(weights, f"{served}/model.safetensors")
    with pytest.raises(UnsupportedQuantization, match="q_proj: its g_idx puts other than 32 inputs in a group"):
        _engine(served, {}, quantization_fallback="reference")


# ---- the canonical forms ---------------------------------------------------------------------------------------
def test_quantize_dequantize_and_fused_concatenation():
    """Each quantizer's error is within its step; concatenating and splitting forms along the outputs keeps every
    value (per-tensor fp8 scales become per-channel; act-order permutations are undone by dequantize)."""
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    q8 = quantize(w, "int8")
    assert isinstance(q8, Int8Weight) and ((dequantize(q8) - w).abs() <= q8.scale[:, None] / 2 + 1e-6).all()
    q4 = quantize(w, "int4")
    assert isinstance(q4, Int4Weight) and q4.group_size == 128 and q4.qweight.shape == (96, 128)
    step = q4.scales.float().repeat_interleave(128, 1)
    err = (dequantize(q4) - w).abs()
    assert (err <= step * 1.001).all() and err.mean() < step.mean() / 3  # the zero's rounding: a step at the ends
    for form in (q8, q4, quantize(w, "fp8")):
        assert torch.equal(dequantize(cat(split(form, [32, 64]))), dequantize(form))
    tensor = Fp8Weight(w[:32].to(torch.float8_e4m3fn), torch.tensor([0.5]))
    both = cat([tensor, quantize(w[32:], "fp8")])
    assert both.scale.shape == (96,) and torch.equal(dequantize(both)[:32], dequantize(tensor))
    perm = torch.randperm(256)
    permuted = Int4Weight(q4.qweight, q4.scales, q4.zeros, 128, perm)
    x = torch.randn(3, 256)
    torch.testing.assert_close(x @ dequantize(permuted).t(), x[:, perm] @ dequantize(q4).t())


def test_int4_through_the_cuda_kernel_on_the_cpu_shim(bases, tmp_path, monkeypatch):
    """LORAPLEX_KERNELS=shim: the quantized layers run quant_linear.cu's kernels on the CPU (an act-order GPTQ
    checkpoint: its inputs gathered by perm first), exact against peft on the dequantized weights, never through
    their torch reference (the kernels against it, fp8 included: tests/kernels/test_quant_kernels.py)."""
    import collections

    from loraplex.kernels import cpu_runner, dispatch

    monkeypatch.setenv(dispatch.ENV, "shim")
    monkeypatch.setattr(dispatch, "MODE", dispatch.read_mode())
    launches = collections.Counter()
    launch, torch_path = cpu_runner.CpuRunner.launch, dispatch.torch_path

    def counting(self, family, name, grid, block, args):
        launches[family] += 1
        return launch(self, family, name, grid, block, args)

    def forbidden(name, tensor):
        assert name not in ("fp8_linear", "w4a16_linear"), f"{name} took the torch path in shim mode"
        return torch_path(name, tensor)

    monkeypatch.setattr(cpu_runner.CpuRunner, "launch", counting)
    monkeypatch.setattr(dispatch, "torch_path", forbidden)
    model_dir, adapters = bases["llama"]
    served, oracle_dir = write_format(model_dir, tmp_path, "gptq")
    engine = _engine(served, {"attn": adapters["attn"]})  # no fallback: the shim serves int4 on the CPU
    batch = {"base": (PROMPTS[0], None), "attn": (PROMPTS[1], "attn")}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, 2)
    assert_matches_oracle(lambda lora: (oracle_dir, adapters.get(lora)), batch, requests, tokens, logprobs, "shim")
    assert launches["quant"] > 0, launches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_session.sh: engine_tests)")
@pytest.mark.parametrize("name", ["fp8-block", "gptq", "ct-w4a16-asym", "load-fp8"])
def test_cuda_quantized_base_in_cuda_graphs_equals_peft(bases, tmp_path, name):
    """On the GPU: fp8 (block scales, q/k/v unfused) and int4 (act-order GPTQ, asymmetric W4A16) through
    quant_linear.cu, decode steps replaying CUDA graphs with base and LoRA / DoRA rows in one batch (the SGLang
    case), equal to peft on the dequantized weights; fp32 activations, so the oracle's tolerance holds."""
    base, adapter = CASES[name]
    model_dir, adapters = bases[base]
    if name.startswith("load-"):
        method = name.removeprefix("load-")
        served, oracle_dir = model_dir, write_load_quantized(model_dir, tmp_path, method)
    else:
        method, (served, oracle_dir) = "auto", write_format(model_dir, tmp_path, name)
    engine = LLMEngine(EngineConfig(model_dir=served, device="cuda", dtype="float32", max_model_len=128,
                                    num_kv_blocks=48, block_size=4, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                                    multi_lora={adapter: adapters[adapter]}, quantization=method))
    assert engine.model.quant.quantized and not engine.model.quant.reference and engine.runner.graphs is not None
    batch = {"base": (PROMPTS[0], None), adapter: (PROMPTS[1], adapter), f"{adapter}-2": (PROMPTS[0], adapter)}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, MAX_TOKENS)
    assert_matches_oracle(lambda lora: (oracle_dir, adapters.get(lora)), batch, requests, tokens, logprobs, name,
                          atol=1e-3)
