"""A checkpoint's quantization format, read from its config's `quantization_config`, and its linear layers' tensors
read into the canonical forms (README.md has each format's layout and its source)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from loraplex.models.quant.forms import Fp8Weight, Int4Weight, Int8Weight

# what a refusal says is served
SERVED = ("compressed-tensors (int8 W8A16/W8A8 per channel, fp8 per tensor/channel/block, 4-bit W4A16 pack-quantized), "
          "fp8 (per tensor or weight_block_size), gptq (4-bit, v1 or v2, act-order), awq (4-bit GEMM)")
# the checkpoint tensors of a quantized linear layer besides .weight (they keep their stored dtype at load)
AUX_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape",
                "weight_zero_point", "weight_g_idx", "weight_scale_inv")
# scales of what stays full precision here (static activation scales, fp8 KV-cache scales): read by no step
IGNORED_SUFFIXES = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale",
                    "kv_scale")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i] (AutoAWQ's pack)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j is in nibble AWQ_REVERSE_ORDER[j]


class UnsupportedQuantization(ValueError):
    """A quantization_config (method, bits, layout) this server does not serve."""


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{what} is not served; the quantized checkpoints served are {SERVED}")


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """How a checkpoint's linear layers are quantized: method (the canonical form: int8, fp8 or int4), the
    config's quant_method, a label naming both for logs and metrics, and what its readers need."""

    method: str
    quant_method: str
    label: str
    bits: int = 0  # compressed-tensors pack-quantized: bits per packed value
    block: tuple[int, int] | None = None  # fp8 block scales (rows, columns)
    group_size: int = 0  # int4: inputs per group (0: per channel)
    gptq_v1: bool = False  # GPTQ's v1 checkpoints store zero - 1


def _config_dict(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def detect(hf_config) -> CheckpointFormat | None:
    """The checkpoint's format from its config (None: not quantized); UnsupportedQuantization naming what is not
    served."""
    qc = _config_dict(hf_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "gptq": _gptq, "awq": _awq}
    if method not in readers:
        raise _refuse(f"quantization_config.quant_method {method!r}")
    return readers[method](qc)


def _compressed_tensors(qc: dict) -> CheckpointFormat:
    fmt = qc.get("format")
    where = f"compressed-tensors format {fmt!r}"
    if qc.get("sparsity_config") or qc.get("transform_config"):
        raise _refuse(f"{where} with a sparsity or transform config")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(f"{where} with quantization_status {qc.get('quantization_status')!r} (not compressed)")
    schemes = [g.get("weights") for g in (qc.get("config_groups") or {}).values()]
    if not schemes or any(s is None for s in schemes) or any(s != schemes[0] for s in schemes):
        raise _refuse(f"{where} without one weight scheme shared by every config group")
    w = schemes[0]
    kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 0)), w.get("strategy")
    symmetric, dynamic = w.get("symmetric", True), w.get("dynamic", False)
    what = f"{where}: {kind} weights of {bits} bits, strategy {strategy!r}"
    if dynamic:
        raise _refuse(f"{what}, dynamic")
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and strategy in ("group", "channel"):
        if w.get("actorder") not in (None, "group", "weight", "static"):
            raise _refuse(f"{what}, actorder {w.get('actorder')!r}")
        group = int(w.get("group_size") or 0) if strategy == "group" else 0
        return CheckpointFormat("int4", "compressed-tensors", f"compressed-tensors W4A16 ({_groups(group)}"
                                f"{'' if symmetric else ', asymmetric'})", bits=4, group_size=group)
    if fmt in ("pack-quantized", "int-quantized", "naive-quantized") and kind == "int" and bits == 8:
        if strategy not in ("channel", "tensor") or not symmetric:
            raise _refuse(f"{what}{'' if symmetric else ', asymmetric'} (int8 is served per channel, symmetric)")
        a8 = "W8A8" if qc["config_groups"] and any((g.get("input_activations") or None) is not None
                                                   for g in qc["config_groups"].values()) else "W8A16"
        return CheckpointFormat("int8", "compressed-tensors", f"compressed-tensors int8 {a8} (per {strategy})",
                                bits=8 if fmt == "pack-quantized" else 0)
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        if strategy not in ("tensor", "channel", "block") or not symmetric:
            raise _refuse(f"{what}{'' if symmetric else ', asymmetric'}")
        block = tuple(int(b) for b in w["block_structure"]) if strategy == "block" else None
        return CheckpointFormat("fp8", "compressed-tensors", f"compressed-tensors fp8 (per {strategy}"
                                f"{f' {list(block)}' if block else ''})", block=block)
    raise _refuse(what)


def _groups(group_size: int) -> str:
    return f"group {group_size}" if group_size else "per channel"


def _fp8(qc: dict) -> CheckpointFormat:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fp8 checkpoint of fmt {qc.get('fmt')!r} (e4m3 only)")
    block = qc.get("weight_block_size")
    block = tuple(int(b) for b in block) if block else None
    if block is not None and len(block) != 2:
        raise _refuse(f"fp8 weight_block_size {list(block)}")
    return CheckpointFormat("fp8", "fp8", f"fp8 ({f'block {list(block)}' if block else 'per tensor'})", block=block)


def _gptq(qc: dict) -> CheckpointFormat:
    bits = int(qc.get("bits", 0))
    fmt = qc.get("checkpoint_format", "gptq")
    if bits != 4:
        raise _refuse(f"gptq with bits {bits} (4 only)")
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise _refuse(f"gptq checkpoint_format {fmt!r}")
    group = int(qc.get("group_size", 128))
    group = 0 if group == -1 else group
    act = ", act-order" if qc.get("desc_act") else ""
    return CheckpointFormat("int4", "gptq", f"gptq int4 ({_groups(group)}{act}, {fmt})", group_size=group,
                            gptq_v1=fmt == "gptq")


def _awq(qc: dict) -> CheckpointFormat:
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(f"awq with bits {bits} (4 only)")
    if version != "gemm":
        raise _refuse(f"awq version {version!r} (the GEMM layout only)")
    if not qc.get("zero_point", True):
        raise _refuse("awq without zero_point")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return CheckpointFormat("int4", "awq", f"awq int4 (group {group}, gemm)", group_size=group)


def is_quant_tensor(name: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor belongs to a quantized layer's encoding and must keep its stored dtype at
    load: an integer or fp8 tensor, or one of the formats' scale / zero / index tensors."""
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in AUX_SUFFIXES or leaf in IGNORED_SUFFIXES or not tensor.is_floating_point()
            or tensor.dtype.itemsize == 1)


def read_quantized(tensors: dict[str, torch.Tensor], fmt: CheckpointFormat) -> list[str]:
    """In place: each quantized linear layer's tensors -> its canonical form at <layer>.weight; the scales of what
    stays full precision dropped. Returns the layers read. UnsupportedQuantization for a quantized embedding or
    MoE expert, or tensors that do not match the format."""
    marker = {"gptq": "qweight", "awq": "qweight"}.get(fmt.quant_method)
    layers = []
    for name in sorted(tensors):
        leaf = name.rsplit(".", 1)[-1]
        t = tensors.get(name)
        if t is None:
            continue
        prefix = name[: -len(leaf) - 1]
        quantized = (leaf == marker if marker else
                     leaf == "weight_packed" or (leaf == "weight" and (not t.is_floating_point() or t.element_size() == 1)))
        if not quantized:
            continue
        if ".experts." in name or prefix.endswith("embed_tokens"):
            raise _refuse(f"a quantized {'MoE expert' if '.experts.' in name else 'embedding'} ({name})")
        reader = {"gptq": _read_gptq, "awq": _read_awq}.get(fmt.quant_method, _read_compressed)
        try:
            form = reader(tensors, prefix, fmt)
        except KeyError as exc:
            raise UnsupportedQuantization(f"{fmt.label}: {prefix} lacks the tensor {exc.args[0]}") from None
        tensors[prefix + ".weight"] = form
        layers.append(prefix)
    for name in [n for n in tensors if n.rsplit(".", 1)[-1] in IGNORED_SUFFIXES]:
        del tensors[name]
    return layers


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> its eight 4-bit values [..., W, 8], value i from bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.to(torch.int32)[..., None] >> shifts) & 15


def _int4_form(q_kn: torch.Tensor, zeros_gn: torch.Tensor, scales_gn: torch.Tensor, g_idx, group: int,
               prefix: str) -> Int4Weight:
    """An Int4Weight from q [K, N], zeros [K/G, N] and scales [K/G, N] (the GPTQ / AWQ orientation)."""
    k, n = q_kn.shape
    groups = scales_gn.shape[0]
    if k % groups or k % 2:
        raise UnsupportedQuantization(f"{prefix}: {k} inputs in {groups} groups")
    group = k // groups
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k) // group):
            counts = torch.bincount(g_idx, minlength=groups)
            if g_idx.numel() != k or counts.numel() != groups or not bool((counts == group).all()):
                raise UnsupportedQuantization(f"{prefix}: its g_idx puts other than {group} inputs in a group "
                                              "(act-order groups must each hold group_size inputs)")
            perm = torch.sort(g_idx, stable=True).indices
            q_kn = q_kn[perm]
    q = q_kn.t().to(torch.uint8)
    return Int4Weight(q[:, 0::2] | (q[:, 1::2] << 4), scales_gn.t().half().contiguous(),
                      zeros_gn.t().to(torch.uint8).contiguous(), group, perm)


def _read_gptq(tensors: dict, prefix: str, fmt: CheckpointFormat) -> Int4Weight:
    # AutoGPTQ / GPTQModel pack: qweight [K/8, N] (input k at bits 4*(k%8) of row k//8), qzeros [K/G, N/8]
    # (output n at bits 4*(n%8) of column n//8; v1 checkpoints store zero - 1), scales [K/G, N], g_idx [K]
    qweight, qzeros = tensors.pop(prefix + ".qweight"), tensors.pop(prefix + ".qzeros")
    scales, g_idx = tensors.pop(prefix + ".scales"), tensors.pop(prefix + ".g_idx", None)
    k8, n = qweight.shape
    q = _unpack_words(qweight).permute(0, 2, 1).reshape(k8 * 8, n)
    zeros = _unpack_words(qzeros).reshape(qzeros.shape[0], -1)[:, :n]
    if fmt.gptq_v1:
        zeros = zeros + 1  # v1's stored zero - 1 (0 stored as 15 reads 16, as GPTQ's own kernels read it)
    return _int4_form(q, zeros, scales, g_idx, fmt.group_size, prefix)


def _read_awq(tensors: dict, prefix: str, fmt: CheckpointFormat) -> Int4Weight:
    # AutoAWQ's GEMM pack: qweight [K, N/8], qzeros [K/G, N/8], nibble i of word c holds column 8c + AWQ_ORDER[i];
    # scales [K/G, N]; zeros as stored
    order = list(AWQ_REVERSE_ORDER)
    qweight, qzeros, scales = (tensors.pop(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales"))
    q = _unpack_words(qweight)[..., order].reshape(qweight.shape[0], -1)
    zeros = _unpack_words(qzeros)[..., order].reshape(qzeros.shape[0], -1)
    return _int4_form(q, zeros, scales, None, fmt.group_size, prefix)


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> its bytes uint8 [R, 4W], in memory order (little-endian: the low byte first)."""
    if sys.byteorder != "little":
        raise UnsupportedQuantization("packed checkpoints are read on little-endian hosts only")
    return words.contiguous().view(torch.uint8)


def _read_compressed(tensors: dict, prefix: str, fmt: CheckpointFormat):
    """compressed-tensors (pack-quantized, int-quantized, naive-quantized, float-quantized) and fp8 checkpoints."""
    pop = tensors.pop
    if prefix + ".weight_packed" in tensors:
        return _read_packed(tensors, prefix, fmt)
    weight = pop(prefix + ".weight")
    if fmt.method == "int8":
        if weight.dtype != torch.int8:
            raise UnsupportedQuantization(f"{prefix}.weight is {weight.dtype}, not int8 ({fmt.label})")
        zero = pop(prefix + ".weight_zero_point", None)
        if zero is not None and bool(zero.ne(0).any()):
            raise UnsupportedQuantization(f"{prefix}: int8 with zero points ({fmt.label}: symmetric only)")
        scale = pop(prefix + ".weight_scale").float().reshape(-1)
        return Int8Weight(weight, scale.expand(weight.shape[0]).contiguous() if scale.numel() == 1 else scale)
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedQuantization(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn ({fmt.label})")
    if prefix + ".weight_scale_inv" in tensors:  # quant_method fp8: the dequantization multiplier, DeepSeek's name
        scale = pop(prefix + ".weight_scale_inv")
    else:
        scale = pop(prefix + ".weight_scale")
    scale = scale.float()
    if fmt.block is not None:
        bn, bk = fmt.block
        want = (-(-weight.shape[0] // bn), -(-weight.shape[1] // bk))
        if tuple(scale.shape) != want:
            raise UnsupportedQuantization(f"{prefix}: block scales {tuple(scale.shape)}, want {want} for {fmt.label}")
        return Fp8Weight(weight, scale.contiguous(), fmt.block)
    scale = scale.reshape(-1)
    if scale.numel() not in (1, weight.shape[0]):
        raise UnsupportedQuantization(f"{prefix}: {scale.numel()} scales for {weight.shape[0]} outputs ({fmt.label})")
    return Fp8Weight(weight, scale.contiguous())


def _read_packed(tensors: dict, prefix: str, fmt: CheckpointFormat):
    # compressed-tensors pack_to_int32: value k of a row at bits bits*(k % (32/bits)) of word k // (32/bits),
    # stored as q + 2^(bits-1); zero points packed the same way along the outputs (dim 0)
    packed, scale = tensors.pop(prefix + ".weight_packed"), tensors.pop(prefix + ".weight_scale")
    shape = tensors.pop(prefix + ".weight_shape", None)
    n = packed.shape[0]
    k = int(shape[1]) if shape is not None else packed.shape[1] * 32 // fmt.bits
    raw = _bytes(packed)
    if fmt.bits == 8:
        q = (raw[:, :k].to(torch.int16) - 128).to(torch.int8)
        return Int8Weight(q.contiguous(), scale.float().reshape(-1).expand(n).contiguous())
    if k % 2:
        raise UnsupportedQuantization(f"{prefix}: an odd input size {k}")
    qweight = raw[:, : k // 2].contiguous()  # two values a byte, the even k low: the canonical packing
    groups = scale.shape[1] if scale.dim() == 2 else 1
    zp = tensors.pop(prefix + ".weight_zero_point", None)
    if zp is None:
        zeros = torch.full((n, groups), 8, dtype=torch.uint8)
    else:
        zeros = _unpack_words(zp.reshape(zp.shape[0], -1).t()).reshape(groups, -1)[:, :n].t().to(torch.uint8)
    g_idx = tensors.pop(prefix + ".weight_g_idx", None)
    q = torch.stack([qweight & 15, qweight >> 4], -1).reshape(n, k)
    return _int4_form(q.t(), zeros.t(), scale.reshape(n, groups).t(), g_idx, fmt.group_size, prefix)
