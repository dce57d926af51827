"""`weight_dtype=float16` and `lora_dtype=float16` on the CPU: fp16 weights, computed in fp32.

The oracle is transformers + peft on the very weights the engine multiplies: the checkpoint
with every matrix rounded to fp16 (and back to fp32), the adapters as they are; with
`lora_dtype=float16`, the adapters rounded and the checkpoint as it is. Logits must agree
within the fp32 tolerance of the fp32 engine, tokens exactly.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import peft_reference as ref
import pytest
from test_multi_lora import LOGIT_ATOL, LOGIT_BATCHES, logits_match_peft, make_engine

from loraplex.config import EngineConfig
from loraplex.engine.request import SamplingParams


def _rounded_copy(src: str, dst, keep=lambda tensor: False) -> str:
    """Folder src copied to dst with its safetensors' tensors rounded to fp16 (and back), but those keep says."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for path in Path(dst).glob("*.safetensors"):
        tensors = {k: v if keep(v) else v.half().float() for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def rounded(lora_family, tmp_path_factory):
    """rounded(arch) -> the family with its checkpoint's matrices rounded to fp16 (the oracle's weights)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            family = lora_family(arch)
            folder = _rounded_copy(family.model_dir, tmp_path_factory.mktemp(f"rounded-{arch}") / "model",
                                   keep=lambda tensor: tensor.dim() != 2)
            cache[arch] = family, dataclasses.replace(family, model_dir=folder)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def rounded_adapters(lora_family, tmp_path_factory):
    """rounded_adapters(arch) -> the family with its adapters' weights rounded to fp16 (the oracle's adapters)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            family = lora_family(arch)
            folders = {name: _rounded_copy(path, tmp_path_factory.mktemp(f"rounded-{arch}-{name}"))
                       for name, path in family.adapters.items()}
            cache[arch] = dataclasses.replace(family, adapters=folders)
        return cache[arch]

    return get


def _batch_decodes_as_peft(engine, model_dir: str, adapters: dict[str, str]) -> None:
    """LOGIT_BATCHES[0] decoded together (the fused q/k/v and gate/up outputs take each row's adapter): each row's
    8 greedy tokens are peft's on model_dir and adapters."""
    batch = LOGIT_BATCHES[0]
    requests = [engine.make_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                  lora_name=name))
                for i, (prompt, name) in enumerate(batch)]
    outs = engine.generate(requests)
    for i, (prompt, name) in enumerate(batch):
        ids = engine.tokenizer(prompt).input_ids
        got = [t for o in outs[f"r{i}"] for t in o.token_ids]
        adapter = adapters[name] if name else None
        assert got == ref.greedy_tokens(model_dir, adapter, ids, 8, True), (name, prompt)


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias"])
def test_fp16_weights_match_peft_on_the_rounded_weights(rounded, arch, kernel_mode):
    from loraplex.kernels.cpu_native import Panels

    family, oracle = rounded(arch)
    engine = make_engine(family, weight_dtype="float16")
    assert engine.model.packed is not None and engine.model.layers[0]["q_proj"] is None  # no fp32 copy kept
    native = isinstance(engine.model.packed[0]["qkv"], Panels)
    assert native == (kernel_mode == "auto")  # auto: the native GEMM; reference: FBGEMM
    moved = 0.0
    for ids, name, want, _ in logits_match_peft(engine, family, oracle.model_dir):
        adapter = family.adapters[name] if name else None
        moved = max(moved, float((ref.first_logits(family.model_dir, adapter, ids) - want).abs().max()))
    assert moved > 10 * LOGIT_ATOL  # the rounding is visible: the oracle is not the fp32 model
    _batch_decodes_as_peft(engine, oracle.model_dir, family.adapters)


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias"])
def test_fp16_adapters_match_peft_on_the_rounded_adapters(lora_family, rounded_adapters, arch, kernel_mode):
    import torch

    family, oracle = lora_family(arch), rounded_adapters(arch)
    engine = make_engine(family, lora_dtype="float16")
    slots = engine.runner.lora_slots
    assert slots.a[0]["q_proj"].dtype == torch.float16 and slots.b_t[0]["down_proj"].dtype == torch.float16
    native = engine.model.native_decode
    assert (native is not None and native.serves_lora(slots)) == (kernel_mode == "auto")  # else the torch path
    logits_match_peft(engine, oracle, family.model_dir)
    _batch_decodes_as_peft(engine, family.model_dir, oracle.adapters)


def test_fp16_adapters_are_a_cpu_fp32_option(lora_family):
    with pytest.raises(ValueError, match="lora_dtype must be auto or float16"):
        EngineConfig(model_dir="x", lora_dtype="bfloat16")
    with pytest.raises(ValueError, match="lora_dtype float16 is a CPU option with dtype float32"):
        make_engine(lora_family("llama-gqa"), lora_dtype="float16", dtype="bfloat16")


def test_fp16_weights_are_a_cpu_fp32_option(lora_family):
    with pytest.raises(ValueError, match="weight_dtype must be auto or float16"):
        EngineConfig(model_dir="x", weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU option with dtype float32"):
        make_engine(lora_family("llama-gqa"), weight_dtype="float16", dtype="bfloat16")


def _decode_step(model, block_size: int):
    """A decode step of three sequences (contexts 1, 6 and 17) over a random cache: (ids, attn, kv)."""
    import torch

    from loraplex.models.llama import AttentionBatch

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(model.allocate_kv_cache(12, block_size).shape, generator=gen)
    lens = [1, 6, 17]
    tables = torch.tensor([[3, 0, 0, 0, 0], [5, 7, 0, 0, 0], [0, 1, 2, 4, 6]], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size
                          for b, p in enumerate(positions.tolist())])
    attn = AttentionBatch(positions, slots, tables, torch.tensor(lens, dtype=torch.int32),
                          torch.arange(4, dtype=torch.int32), True)
    return torch.tensor([5, 17, 3]), attn, kv


def _one_call_and_per_op(model, ids, attn, kv, one_call_lora=None, per_op_lora=None):
    """(hidden, kv) of the step in one native call, then op by op (the native forward set aside)."""
    fused_kv, per_op_kv = kv.clone(), kv.clone()
    fused = model.forward(ids, attn, fused_kv, one_call_lora)
    native, model.native_decode = model.native_decode, None
    try:
        per_op = model.forward(ids, attn, per_op_kv, per_op_lora)
    finally:
        model.native_decode = native
    return (fused, fused_kv), (per_op, per_op_kv)


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias"])
def test_native_decode_forward_gives_the_per_op_values(lora_family, arch):
    """A base-model decode step in one native call (DecodeForward) against the same model op by op."""
    import torch

    engine = make_engine(lora_family(arch), weight_dtype="float16")
    model = engine.model
    if model.native_decode is None:
        pytest.skip("no native fp16 GEMM on this CPU")
    ids, attn, kv = _decode_step(model, 4)
    (fused, fused_kv), (per_op, per_op_kv) = _one_call_and_per_op(model, ids, attn, kv)
    assert torch.equal(fused, per_op) and torch.equal(fused_kv, per_op_kv)
    assert not torch.equal(fused_kv, kv)  # the new K/V were written


@pytest.mark.parametrize("weight_dtype", ["auto", "float16"])
@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias"])
def test_native_decode_forward_adds_each_rows_adapter_as_the_torch_path_does(lora_family, arch, weight_dtype):
    """Rows on two adapters and the base model, in one native call (its BGMV) against the torch path's slot
    tiles op by op: the same sums in another order, so within fp32 rounding; the base row exactly alike."""
    import numpy as np
    import torch

    from loraplex.lora.backends import NativeRows, TorchLoraBackend

    family = lora_family(arch)
    engine = make_engine(family, weight_dtype=weight_dtype)
    model, runner = engine.model, engine.runner
    if model.native_decode is None:
        pytest.skip("no native GEMM on this CPU")
    names = sorted(family.adapters)[:2]
    engine.generate([engine.make_request(n, "Hi", SamplingParams(max_tokens=1, lora_name=n)) for n in names])
    slots = np.array([engine.adapters.slot_of(names[0]), -1, engine.adapters.slot_of(names[1])], np.int32)
    ids, attn, kv = _decode_step(model, 4)
    one_call = runner.lora.plan(slots, np.arange(4), True)
    assert isinstance(one_call, NativeRows)
    tiles = TorchLoraBackend(runner.lora_slots, torch.from_numpy).plan(slots, np.arange(4), True)
    assert tiles.tiles is not None
    (fused, fused_kv), (per_op, per_op_kv) = _one_call_and_per_op(model, ids, attn, kv, one_call, tiles)
    (base, _), _ = _one_call_and_per_op(model, ids, attn, kv)
    torch.testing.assert_close(fused, per_op, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_kv, per_op_kv, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[1], base[1])  # the base model's row gets nothing
    for row in (0, 2):  # and the adapters' rows moved
        assert (fused[row] - base[row]).abs().max() > 1e-3
    bad = runner.lora.rows(torch.tensor([0, runner.lora_slots.max_loras, -1], dtype=torch.int32))
    with pytest.raises(IndexError, match="adapter slot"):
        model.forward(ids, attn, kv.clone(), bad)
