"""Quantized checkpoints written from a tiny full-precision one, each exactly as its real tool writes it, and beside
each the same model dequantized as a plain checkpoint (the oracle: transformers + peft run on it).

The dequantized weights are computed here from the integers, zeros and scales before they are packed, so the
engine's readers (loraplex.models.quant.formats) are checked against each tool's packing, not against themselves.
Layout sources:
  compressed-tensors 0.20: compressors/pack_quantized (pack_to_int32: value + 2^(bits-1), element k at bits
    bits*(k % (32/bits)) of word k // (32/bits); zero points packed along dim 0), compressors/naive_quantized
    (int-quantized / float-quantized: the weight cast to int8 / float8_e4m3fn, weight_scale [N, 1] or [1]);
    quantization/lifecycle/forward_helpers._dequantize: (x_q - zero_point) * scale
  quant_method fp8 (Qwen3-FP8, DeepSeek-V3): weight float8_e4m3fn, weight_scale_inv [ceil(N/128), ceil(K/128)], the
    multiplier that dequantizes (DeepSeek's fp8_cast_bf16 weight_dequant)
  AutoGPTQ QuantLinear.pack (v1: zeros - 1 stored) / GPTQModel's gptq_v2 (zeros as they are): qweight [K/8, N] packed
    along K, qzeros [G, N/8] along N, scales [G, N], g_idx [K]; act-order: g_idx[perm[i]] = i // G
  AutoAWQ WQLinear_GEMM.from_linear: qweight [K, N/8], qzeros [G, N/8], nibble i of word c = column 8c + [0, 2, 4, 6,
    1, 3, 5, 7][i]; scales [G, N]
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

# name -> (writer, its keywords); the formats tests write
FORMATS: dict[str, tuple[str, dict]] = {
    "ct-w8a16": ("compressed_tensors_int8", {"packed": True}),
    "ct-w8a8": ("compressed_tensors_int8", {"packed": False}),
    "ct-fp8": ("compressed_tensors_fp8", {}),
    "ct-w4a16": ("compressed_tensors_w4a16", {"group_size": 32, "symmetric": True, "actorder": True}),
    "ct-w4a16-asym": ("compressed_tensors_w4a16", {"group_size": 32, "symmetric": False, "actorder": False}),
    "fp8-block": ("fp8_method", {"block": (128, 128)}),
    "fp8-tensor": ("fp8_method", {"block": None}),
    "gptq": ("gptq", {"group_size": 32, "desc_act": True, "v2": False}),
    "gptq-v2": ("gptq", {"group_size": 32, "desc_act": False, "v2": True}),
    "awq": ("awq", {"group_size": 32}),
}


def _int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    v = v & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool, qmax: int):
    """Per (group, output): scale and zero of asymmetric (or symmetric around 2^(bits-1)) min-max quantization, and
    the integers q [K, N] in 0..qmax, for w [N, K] grouped by g_idx."""
    n, k = w.shape
    scales, zeros = torch.zeros(groups, n), torch.zeros(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if symmetric:
            s, z = torch.maximum(-lo, hi) * 2 / qmax, torch.full((n,), float((qmax + 1) // 2))
        else:
            s = (hi - lo) / qmax
            z = torch.round(-lo / s)
        scales[g], zeros[g] = s.half().float(), z  # scales as the checkpoint stores them (fp16)
    q = torch.clamp(torch.round(w.t() / scales[g_idx]) + zeros[g_idx], 0, qmax)
    return q.to(torch.int64), zeros.to(torch.int64), scales


class Writer:
    """One quantized checkpoint and its dequantized twin from the full-precision model_dir."""

    def __init__(self, model_dir: str, out: Path):
        from safetensors.torch import load_file

        self.src, self.out = Path(model_dir), out
        self.tensors = load_file(str(self.src / "model.safetensors"))
        self.quantized: dict[str, torch.Tensor] = {}
        self.dequantized: dict[str, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(7)

    def layers(self):
        for name, t in self.tensors.items():
            if PROJECTION.match(name):
                yield name[: -len(".weight")], t.float()
            else:
                self.quantized[name] = self.dequantized[name] = t

    def save(self, quantization_config: dict) -> tuple[str, str]:
        from safetensors.torch import save_file

        config = json.loads((self.src / "config.json").read_text())
        for folder, tensors, qc in ((self.out / "model", self.quantized, quantization_config),
                                    (self.out / "dequantized", self.dequantized, None)):
            shutil.copytree(self.src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                      metadata={"format": "pt"})
            (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc} if qc else config))
        return str(self.out / "model"), str(self.out / "dequantized")

    # ---- compressed-tensors -------------------------------------------------------------------------------------
    def compressed_tensors_int8(self, packed: bool) -> tuple[str, str]:
        for prefix, w in self.layers():
            scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
            q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int64)
            if packed:  # pack_to_int32, 8 bits: q + 128, four to a word, element k at bits 8 * (k % 4)
                u = (q + 128).view(q.shape[0], -1, 4)
                self.quantized[prefix + ".weight_packed"] = _int32(sum(u[..., i] << (8 * i) for i in range(4)))
                self.quantized[prefix + ".weight_shape"] = torch.tensor(w.shape)
            else:
                self.quantized[prefix + ".weight"] = q.to(torch.int8)
            self.quantized[prefix + ".weight_scale"] = scale[:, None]
            self.dequantized[prefix + ".weight"] = q.float() * scale[:, None]
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                   "dynamic": False, "actorder": None, "observer": "minmax"}
        acts = None if packed else {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                    "dynamic": True}
        return self.save(_ct("pack-quantized" if packed else "int-quantized", weights, acts))

    def compressed_tensors_fp8(self) -> tuple[str, str]:
        for prefix, w in self.layers():
            scale = (w.abs().amax(1) / 448).clamp(min=1e-8)
            q = (w / scale[:, None]).to(torch.float8_e4m3fn)
            self.quantized[prefix + ".weight"] = q
            self.quantized[prefix + ".weight_scale"] = scale[:, None]
            self.quantized[prefix + ".input_scale"] = torch.tensor([0.02])  # static FP8 activations: not served
            self.dequantized[prefix + ".weight"] = q.float() * scale[:, None]
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
        return self.save(_ct("float-quantized", weights, acts))

    def compressed_tensors_w4a16(self, group_size: int, symmetric: bool, actorder: bool) -> tuple[str, str]:
        for prefix, w in self.layers():
            n, k = w.shape
            g_idx = torch.arange(k) // group_size
            if actorder:  # GPTQ's order: groups over a permutation of the inputs
                perm = torch.randperm(k, generator=self.gen)
                g_idx = torch.empty(k, dtype=torch.int64)
                g_idx[perm] = torch.arange(k) // group_size
            q, z, s = _groups(w, g_idx, k // group_size, symmetric, 15)
            s = s.bfloat16()  # the model's dtype, as llm-compressor saves it
            deq = (q - z[g_idx]).float() * s.float()[g_idx]
            qs = q.t() - 8  # the signed values quantize() returns; pack_to_int32 adds 8 back
            u = (qs + 8).view(n, -1, 8)
            self.quantized[prefix + ".weight_packed"] = _int32(sum(u[..., i] << (4 * i) for i in range(8)))
            self.quantized[prefix + ".weight_scale"] = s.t().contiguous()
            self.quantized[prefix + ".weight_shape"] = torch.tensor([n, k])
            if not symmetric:  # signed zero points (z - 8), packed along the outputs: [N/8, G]
                zu = (z - 8 + 8).t().reshape(n // 8, 8, -1)
                self.quantized[prefix + ".weight_zero_point"] = _int32(sum(zu[:, i] << (4 * i) for i in range(8)))
            if actorder:
                self.quantized[prefix + ".weight_g_idx"] = g_idx.to(torch.int32)
            self.dequantized[prefix + ".weight"] = deq.t()
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                   "group_size": group_size, "dynamic": False, "actorder": "group" if actorder else None}
        return self.save(_ct("pack-quantized", weights, None))

    # ---- quant_method fp8 ---------------------------------------------------------------------------------------
    def fp8_method(self, block: tuple[int, int] | None) -> tuple[str, str]:
        for prefix, w in self.layers():
            n, k = w.shape
            if block is None:
                scale = (w.abs().amax() / 448).reshape(())
                q = (w / scale).to(torch.float8_e4m3fn)
                self.quantized[prefix + ".weight_scale"] = scale
                self.dequantized[prefix + ".weight"] = q.float() * scale
            else:
                bn, bk = block
                rows, cols = -(-n // bn), -(-k // bk)
                scale = torch.zeros(rows, cols)
                full = torch.zeros(n, k)
                for i in range(rows):
                    for j in range(cols):
                        tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                        scale[i, j] = tile.abs().amax() / 448
                        full[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = scale[i, j]
                q = (w / full).to(torch.float8_e4m3fn)
                self.quantized[prefix + ".weight_scale_inv"] = scale
                self.dequantized[prefix + ".weight"] = q.float() * full
            self.quantized[prefix + ".weight"] = q
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        return self.save({**qc, "weight_block_size": list(block)} if block else qc)

    # ---- GPTQ, AWQ ----------------------------------------------------------------------------------------------
    def gptq(self, group_size: int, desc_act: bool, v2: bool) -> tuple[str, str]:
        for prefix, w in self.layers():
            n, k = w.shape
            g_idx = torch.arange(k) // group_size
            if desc_act:
                perm = torch.randperm(k, generator=self.gen)
                g_idx = torch.empty(k, dtype=torch.int64)
                g_idx[perm] = torch.arange(k) // group_size
            q, z, s = _groups(w, g_idx, k // group_size, symmetric=not v2, qmax=15)
            self.dequantized[prefix + ".weight"] = ((q - z[g_idx]).float() * s[g_idx]).t()
            stored = z if v2 else z - 1  # v1: AutoGPTQ's pack subtracts one (symmetric zeros 8 -> 7)
            qw = q.view(k // 8, 8, n)
            self.quantized[prefix + ".qweight"] = _int32(sum(qw[:, j] << (4 * j) for j in range(8)))
            zz = stored.view(-1, n // 8, 8)
            self.quantized[prefix + ".qzeros"] = _int32(sum(zz[..., j] << (4 * j) for j in range(8)))
            self.quantized[prefix + ".scales"] = s.half()
            self.quantized[prefix + ".g_idx"] = g_idx.to(torch.int32)
        return self.save({"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                          "sym": not v2, "checkpoint_format": "gptq_v2" if v2 else "gptq", "damp_percent": 0.01,
                          "true_sequential": True, "static_groups": False, "lm_head": False})

    def awq(self, group_size: int) -> tuple[str, str]:
        for prefix, w in self.layers():
            n, k = w.shape
            g_idx = torch.arange(k) // group_size
            q, z, s = _groups(w, g_idx, k // group_size, symmetric=False, qmax=15)
            self.dequantized[prefix + ".weight"] = ((q - z[g_idx]).float() * s[g_idx]).t()
            for name, ints in (("qweight", q), ("qzeros", z)):
                cols = ints.view(ints.shape[0], n // 8, 8)
                self.quantized[f"{prefix}.{name}"] = _int32(sum(cols[..., AWQ_ORDER[i]] << (4 * i) for i in range(8)))
            self.quantized[prefix + ".scales"] = s.half()
        return self.save({"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                          "version": "gemm", "modules_to_not_convert": None})


def _ct(fmt: str, weights: dict, input_activations: dict | None) -> dict:
    """A compressed-tensors quantization_config of one scheme on every Linear but lm_head (llm-compressor's)."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": input_activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def write_format(model_dir: str, out: Path, name: str) -> tuple[str, str]:
    """FORMATS[name] written from the full-precision model_dir: (quantized checkpoint, dequantized checkpoint)."""
    writer, kwargs = FORMATS[name]
    return getattr(Writer(model_dir, out / name), writer)(**kwargs)


def write_load_quantized(model_dir: str, out: Path, method: str) -> str:
    """The checkpoint the engine serves with `quantization: <method>` (quantized at load), as a plain dequantized
    checkpoint: its projections (and, for int8, lm_head: a tied one untied) through loraplex's quantizer."""
    from safetensors.torch import load_file, save_file

    from loraplex.models.quant import dequantize, quantize

    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for name, t in list(tensors.items()):
        if PROJECTION.match(name):
            tensors[name] = dequantize(quantize(t, method))
    if method == "int8":
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        tensors["lm_head.weight"] = dequantize(quantize(head, "int8"))
        config["tie_word_embeddings"] = False
    folder = out / f"load-{method}"
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
