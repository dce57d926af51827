"""Loading and validating one PEFT LoRA adapter from disk (safetensors only, never pickle).

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, as
`PeftModel.save_pretrained` writes them. The tensors decide what is loaded; the config
gives rank, alpha and which modules the adapter targets, and the two must agree with each
other and with the base model (every mismatch is an AdapterError naming the tensor).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from loraplex.exceptions import AdapterError
from loraplex.lora.experts import ExpertLora, expert_layout, parse_experts, refuse_experts, take_expert_tensors
from loraplex.lora.patterns import MAX_REGEX_CHARS, REGEX_BUDGET_SECONDS, Patterns, check_pattern  # noqa: F401
from loraplex.lora.vocab import (CONFIG_NAMES, MAX_VOCAB_TENSORS, MODULES_TO_SAVE_REASON, VOCAB_MODULES,
                                 VocabAdapter, check_vocab_header, parse_vocab, vocab_module)
from loraplex.lora.shapes import (MODULES, PARENTS, checkpoint_modules, module_path, module_shapes,
                                  normalize_target)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# Config options that change what the adapter computes and that this server does not implement.
_UNSUPPORTED = (
    ("fan_in_fan_out", "fan_in_fan_out=true"),
    ("lora_bias", "lora_bias=true"),
    ("use_qalora", "QALoRA (use_qalora=true)"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("layer_replication", "layer_replication"),
    ("use_bdlora", "BD-LoRA (use_bdlora)"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config)"),
    ("monteclora_config", "MonteCLoRA (monteclora_config)"),
)

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")

MAX_CONFIG_BYTES = 64 * 1024  # adapter_config.json (peft writes about 1 KiB)
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound on the JSON header
HEADER_ALLOWANCE = 64 * 1024  # header bytes allowed beyond HEADER_BYTES_PER_TENSOR per tensor (__metadata__)
HEADER_BYTES_PER_TENSOR = 1024  # one tensor's entry (peft writes about 130 bytes)

# init_lora_weights values whose weights are used as saved: peft leaves the base weights alone.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# init_lora_weights values with which peft rewrites the base weights (at load, or before training).
CONVERTIBLE_INITS = ("pissa", "olora", "corda", "lora_ga")  # 'pissa_niter_<n>' and 'corda*' too
CONVERSION_HINT = ("convert it to a plain LoRA adapter with peft: keep the adapter as saved right after "
                   "initialization, before training, and save the trained one with "
                   "save_pretrained(output_dir, path_initial_model_for_weight_conversion=<that folder>) "
                   "(peft's PiSSA/CorDA/OLoRA/LoRA-GA to LoRA conversion; the rank doubles)")

# Bytes per element of each safetensors dtype.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}

log = logging.getLogger("loraplex.lora")


@dataclass(slots=True)
class LoraAdapter:
    """One validated adapter in host memory: per (layer, module) A [r, in], B [out, r], scale."""

    name: str
    path: str
    digest: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    # DoRA (use_dora): per (layer, module) the saved magnitude m [out]; empty for plain LoRA
    magnitudes: dict[tuple[int, str], torch.Tensor] = dataclass_field(default_factory=dict)
    vocab: VocabAdapter | None = None  # LoRA on embed_tokens / lm_head, trainable tokens (lora/vocab.py)
    # DoRA's output scale s = m / ||W + scale * B A|| (row norms) per (layer, module), computed once from the
    # base weights when the adapter first enters a slot (dora_scales), then kept with the adapter
    output_scales: dict[tuple[int, str], torch.Tensor] | None = None
    # MoE experts: per (layer, expert projection) its experts' A and B, by rank (lora/experts.py, decision 066)
    experts: dict[tuple[int, str], list[ExpertLora]] = dataclass_field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes held by the adapter's A and B tensors (and DoRA magnitudes)."""
        shared = {id(t): t.nbytes for groups in self.experts.values() for g in groups for t in (g.a, g.b)}
        return (sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())
                + sum(m.nbytes for m in self.magnitudes.values()) + sum(shared.values()))

    def dora_scales(self, base_weight) -> dict[tuple[int, str], torch.Tensor]:
        """DoRA's per-output scale of each targeted module (computed once; base_weight(layer, module) -> W
        [out, in]); empty for plain LoRA. Like peft: s = m / ||W + scale * B A||_row, in float32."""
        if self.output_scales is None:
            scales = {}
            for key in self.magnitudes:
                try:
                    scales[key] = dora_output_scale(base_weight(*key), *self.weights[key], self.magnitudes[key])
                except ValueError as exc:
                    raise AdapterError(f"adapter {self.name!r}: DoRA on {module_path(*key)}: {exc}") from None
            self.output_scales = scales
        return self.output_scales


def dora_output_scale(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                      magnitude: torch.Tensor) -> torch.Tensor:
    """m / ||W + scale * B A|| over the input dim, per output feature (peft's DoraLinearLayer.get_weight_norm);
    ValueError unless the norms and the scales are finite."""
    merged = weight.detach().float().cpu() + scale * (b.float() @ a.float())
    norms = torch.linalg.norm(merged, dim=1)
    if not bool(torch.isfinite(norms).all()):
        raise ValueError("a row norm of W + scale * B A is not finite in float32 (lora_A / lora_B out of range)")
    out = magnitude.float() / norms
    if not bool(torch.isfinite(out).all()):
        raise ValueError("the output scale lora_magnitude_vector / ||W + scale * B A|| is not finite in float32 "
                         "(a magnitude out of range, or a row norm of 0)")
    return out.contiguous()


@dataclass(slots=True)
class _Settings:
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    layers_to_transform: list[int] | None
    layers_pattern: list[str] | None
    use_dora: bool = False
    target_parameters: list[str] | None = None  # peft's LoRA on raw parameters: MoE experts' fused tensors only


def adapter_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """Content digest (sha256 hex) of an adapter's config and weights files."""
    h = hashlib.sha256()
    h.update(len(config_bytes).to_bytes(8, "little"))  # length prefix: the two files cannot alias
    h.update(config_bytes)
    h.update(weights_bytes)
    return h.hexdigest()


def looks_like_pickle(data: bytes) -> bool:
    """True for a pickle stream or a torch.save zip archive (what adapter_model.bin holds)."""
    return data[:4] == b"PK\x03\x04" or (data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def max_adapter_tensors(hf_config, dora: bool = False) -> int:
    """Most tensors an adapter of this base model holds: lora_A and lora_B (and with DoRA its magnitude) of
    every projection of every layer, and of every expert's projections on a MoE model."""
    layout = expert_layout(hf_config)
    experts = layout.max_tensors() if layout is not None else 0
    return (3 if dora else 2) * int(hf_config.num_hidden_layers) * len(MODULES) + experts + MAX_VOCAB_TENSORS


def uses_dora(config_bytes: bytes) -> bool:
    """Whether an adapter_config.json sets use_dora: true (False for anything unparsable: parsing reports it)."""
    try:
        cfg = json.loads(config_bytes)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(cfg, dict) and cfg.get("use_dora") is True


def max_header_bytes(max_tensors: int) -> int:
    """Most bytes of a safetensors header listing at most ``max_tensors`` tensors (and a __metadata__)."""
    return HEADER_ALLOWANCE + HEADER_BYTES_PER_TENSOR * max_tensors


def check_safetensors_header(data: bytes, max_tensors: int | None = None) -> dict[str, dict]:
    """Check a safetensors file's header against its real size before any tensor is parsed.

    Returns the tensor entries (name -> {dtype, shape, data_offsets}); raises AdapterError
    unless the header length is sane (at most max_header_bytes(max_tensors) when given, checked
    before the JSON is parsed), the header is a JSON object of at most ``max_tensors`` tensors,
    and the tensors have elements and byte ranges that are in range, do not overlap, match
    dtype size x shape and cover the data exactly.
    """
    def bad(why: str) -> AdapterError:
        if looks_like_pickle(data):
            return AdapterError(f"{WEIGHTS_FILE} is a pickle file (torch.save / {PICKLE_FILE}), not safetensors; "
                                f"pickle is refused (arbitrary code execution), convert the adapter to {WEIGHTS_FILE}")
        return AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {why}")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n < 2 or n > MAX_HEADER_BYTES:
        raise bad(f"header length {n} is not between 2 and {MAX_HEADER_BYTES}")
    if max_tensors is not None and n > max_header_bytes(max_tensors):
        raise bad(f"header length {n} is more than an adapter of this base model needs "
                  f"({max_header_bytes(max_tensors)} bytes for at most {max_tensors} tensors)")
    if 8 + n > len(data):
        raise bad(f"header length {n} runs past the end of the {len(data)}-byte file")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ must map strings to strings")
    if max_tensors is not None and len(header) > max_tensors:
        raise bad(f"the header lists {len(header)} tensors; an adapter of this base model has at most "
                  f"{max_tensors} (lora_A and lora_B of each projection of each layer, its experts and vocabulary parts)")
    size = len(data) - 8 - n
    spans = []
    for tensor, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {tensor!r}: expected dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise bad(f"tensor {tensor!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"tensor {tensor!r}: shape must be a list of non-negative integers")
        if math.prod(shape) == 0:
            raise bad(f"tensor {tensor!r}: shape {shape} has no elements")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size):
            raise bad(f"tensor {tensor!r}: data_offsets {offsets!r} are outside the {size} data bytes")
        if math.prod(shape) * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
            raise bad(f"tensor {tensor!r}: {dtype} {shape} needs {math.prod(shape) * DTYPE_SIZES[dtype]} bytes, "
                      f"data_offsets give {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], tensor))
    end = 0
    for begin, stop, tensor in sorted(spans):
        if begin != end:
            raise bad(f"tensor {tensor!r}: data_offsets start at {begin}, expected {end} "
                      f"({'overlapping' if begin < end else 'a gap in the'} data)")
        end = stop
    if end != size:
        raise bad(f"the tensors cover {end} of the {size} data bytes")
    return header


def load_peft_adapter(path, name: str, hf_config, max_lora_rank: int, dtype=torch.float32,
                      max_expert_rank: int | None = None) -> LoraAdapter:
    """Read, validate and convert a PEFT LoRA adapter folder for the given base model (max_expert_rank: see
    parse_peft_adapter)."""
    folder = Path(path)
    where = f"adapter {name!r}"  # no server path in messages that reach clients
    log.debug("loading %s from %s", where, folder)
    if not folder.is_dir():
        raise AdapterError(f"{where}: directory does not exist")
    config_path = folder / CONFIG_FILE
    weights_path = folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterError(f"{where}: missing {CONFIG_FILE}")
    if not weights_path.is_file():
        if (folder / PICKLE_FILE).exists():
            raise AdapterError(
                f"{where}: only {PICKLE_FILE} found; pickle files are refused (arbitrary code "
                f"execution), convert the adapter to {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{where}: missing {WEIGHTS_FILE}")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: {CONFIG_FILE} is {config_path.stat().st_size} bytes; at most "
                           f"{MAX_CONFIG_BYTES} are allowed")
    return parse_peft_adapter(config_path.read_bytes(), weights_path.read_bytes(), name, hf_config, max_lora_rank,
                              dtype, path=str(folder), max_expert_rank=max_expert_rank)


def parse_peft_adapter(config_bytes: bytes, weights_bytes: bytes, name: str, hf_config, max_lora_rank: int,
                       dtype=torch.float32, path: str = "", max_expert_rank: int | None = None) -> LoraAdapter:
    """Validate and convert a PEFT LoRA adapter given as its two files' bytes (see load_peft_adapter).
    max_expert_rank: the largest rank of LoRA on a MoE model's experts and router (the slots' expert stacks,
    EngineConfig.max_expert_lora_rank, decision 070); None: max_lora_rank; 0: such an adapter is refused."""
    where = f"adapter {name!r}"
    digest = adapter_digest(config_bytes, weights_bytes)
    patterns = Patterns(where)
    settings = _parse_config(config_bytes, where)
    num_layers = int(hf_config.num_hidden_layers)
    shapes = module_shapes(hf_config)
    named = checkpoint_modules(hf_config)  # what the adapter's names may be -> our modules each holds
    order = list(named)
    layout = _expert_layout(hf_config, where)
    if settings.target_parameters and layout is None:
        raise AdapterError(f"{where}: target_parameters (LoRA on raw parameters) is supported on the experts of a "
                           f"MoE base model only; this base model has none")
    targeted = _targeted_modules(settings, num_layers, where, patterns, order, layout)
    try:
        header = check_safetensors_header(weights_bytes, max_adapter_tensors(hf_config, settings.use_dora))
    except AdapterError as exc:
        raise AdapterError(f"{where}: {exc}") from None
    check_vocab_header(header, hf_config, max_lora_rank, where)  # before any tensor is allocated
    if layout is not None and max_expert_rank == 0:
        refuse_experts(header, layout, settings, where)  # before any tensor is allocated
    try:
        tensors = load_safetensors(weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is not a valid safetensors file: {exc}") from exc
    expert_tensors = take_expert_tensors(tensors, layout, num_layers, where) if layout is not None else {}
    vocab_tensors = {n: tensors.pop(n) for n in list(tensors) if vocab_module(n) is not None}
    vocab = parse_vocab(json.loads(config_bytes), vocab_tensors,
                        lambda m: settings.target_modules != "all-linear" and _is_targeted(settings, m, patterns),
                        lambda m: _rank_alpha(settings, m, patterns),
                        lambda alpha, r: lora_scale(alpha, r, settings.use_rslora), hf_config, max_lora_rank, dtype,
                        settings.use_dora, where)
    pairs = _pair_tensors(tensors, num_layers, where, order)

    for key in sorted(pairs, key=lambda k: (k[0], order.index(k[1]))):
        if key not in targeted:
            tensor_name = min(name for name, _ in pairs[key].values())
            raise AdapterError(
                f"{where}: tensor {tensor_name} is for {module_path(*key)}, which "
                f"{CONFIG_FILE} does not target (target_modules / layers_to_transform / exclude_modules)"
            )

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    magnitudes: dict[tuple[int, str], torch.Tensor] = {}
    max_rank = 0
    for layer, module in sorted(targeted, key=lambda k: (k[0], order.index(k[1]))):
        full = module_path(layer, module)
        r, alpha = _rank_alpha(settings, full, patterns)
        if r > max_lora_rank:
            raise AdapterError(
                f"{where}: {full} has rank {r}, above the server's max_lora_rank {max_lora_rank}"
            )
        found = pairs.get((layer, module), {})
        if set(found) - {"M"} != {"A", "B"}:
            if not found:
                raise AdapterError(
                    f"{where}: {CONFIG_FILE} targets {full} but {WEIGHTS_FILE} has no "
                    f"lora_A / lora_B tensors for it"
                )
            have = next(k for k in ("A", "B", "M") if k in found)
            missing = "B" if have == "A" else "A"
            raise AdapterError(
                f"{where}: incomplete LoRA pair for {full}: {found[have][0]} present, lora_{missing} missing"
            )
        in_f, out_f = shapes[named[module][0]][0], sum(shapes[m][1] for m in named[module])
        a_name, a = found["A"]
        b_name, b = found["B"]
        a = _checked(a_name, a, (r, in_f), dtype, where)
        b = _checked(b_name, b, (out_f, r), dtype, where)
        scale = lora_scale(alpha, r, settings.use_rslora)
        weights[(layer, module)] = (a, b, scale)
        max_rank = max(max_rank, r)
        if settings.use_dora:
            if "M" not in found:
                raise AdapterError(f"{where}: use_dora is set but {WEIGHTS_FILE} has no lora_magnitude_vector "
                                   f"for {full}")
            magnitudes[(layer, module)] = _checked(found["M"][0], found["M"][1], (out_f,), torch.float32, where)
        elif "M" in found:
            raise AdapterError(f"{where}: tensor {found['M'][0]} is a DoRA magnitude but {CONFIG_FILE} does not "
                               f"set use_dora")

    _split_fused(weights, magnitudes, named, shapes)
    max_rank = max(max_rank, vocab.rank if vocab is not None else 0)
    experts = {}
    if layout is not None:
        limit = max_lora_rank if max_expert_rank is None else max_expert_rank
        knob = "max_expert_lora_rank" if limit < max_lora_rank else "max_lora_rank"
        experts = parse_experts(expert_tensors, layout, settings, where, patterns, limit, dtype, knob)
        if not weights and not experts and vocab is None:
            raise AdapterError(f"{where}: {CONFIG_FILE} targets none of the modules {', '.join(order)}, nor the "
                               f"experts ({', '.join(layout.leaves)} per expert, or target_parameters)")
        max_rank = max([max_rank] + [g.rank for groups in experts.values() for g in groups])
    return LoraAdapter(name=name, path=path, digest=digest, rank=max_rank, weights=weights, magnitudes=magnitudes,
                       experts=experts, vocab=vocab)


def _expert_layout(hf_config, where: str):
    """The base model's experts (lora/experts.py), None for a dense model."""
    try:
        return expert_layout(hf_config)
    except ValueError as exc:
        raise AdapterError(f"{where}: the base model's experts: {exc}") from None


def _split_fused(weights: dict, magnitudes: dict, named: dict[str, tuple[str, ...]], shapes: dict) -> None:
    """A pair on a fused checkpoint projection (Phi-3's qkv_proj) as one pair per module it holds, in place: the
    same A, B's rows (and DoRA's magnitudes, whose row norms are per output) cut along the output."""
    for (layer, fused), (a, b, scale) in list(weights.items()):
        parts = named[fused]
        if len(parts) == 1:
            continue
        widths = [shapes[m][1] for m in parts]
        del weights[(layer, fused)]
        for m, piece in zip(parts, b.split(widths)):
            weights[(layer, m)] = (a, piece.contiguous(), scale)
        if (layer, fused) in magnitudes:
            for m, piece in zip(parts, magnitudes.pop((layer, fused)).split(widths)):
                magnitudes[(layer, m)] = piece.contiguous()


def lora_scale(alpha: float, r: int, use_rslora: bool) -> float:
    """LoRA output scale: alpha / sqrt(r) with rsLoRA, else alpha / r."""
    return float(alpha) / (math.sqrt(r) if use_rslora else r)


def _checked(tensor_name, t, expected, dtype, where) -> torch.Tensor:
    if tuple(t.shape) != expected:
        raise AdapterError(
            f"{where}: tensor {tensor_name} has shape {list(t.shape)}, expected {list(expected)}"
        )
    if not t.dtype.is_floating_point:
        raise AdapterError(f"{where}: tensor {tensor_name} has dtype {t.dtype}, expected a floating-point dtype")
    if not bool(torch.isfinite(t).all()):
        raise AdapterError(f"{where}: tensor {tensor_name} contains NaN or infinite values")
    out = t.to(dtype).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise AdapterError(f"{where}: tensor {tensor_name} overflows {dtype}")
    return out


def _parse_config(config_bytes: bytes, where: str) -> _Settings:
    if len(config_bytes) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: {CONFIG_FILE} is {len(config_bytes)} bytes; at most {MAX_CONFIG_BYTES} are allowed")
    try:
        cfg = json.loads(config_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise AdapterError(f"{where}: {CONFIG_FILE} nests too deeply") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {peft_type!r}; only 'LORA' adapters are supported")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"{where}: bias={bias!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{where}: {MODULES_TO_SAVE_REASON}")
    for key, what in _UNSUPPORTED:
        if cfg.get(key):
            raise AdapterError(f"{where}: {what} is not supported")
    _check_init(cfg.get("init_lora_weights", True), where)

    r = cfg.get("r", 8)
    if not _is_int(r) or r <= 0:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    use_dora = cfg.get("use_dora", False)
    if not isinstance(use_dora, bool):
        raise AdapterError(f"{where}: use_dora must be true or false, got {use_dora!r}")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")

    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        isinstance(k, str) and _is_int(v) and v > 0 for k, v in rank_pattern.items()
    ):
        raise AdapterError(f"{where}: rank_pattern must map module patterns to positive integers")
    if not isinstance(alpha_pattern, dict) or not all(
        isinstance(k, str) and _is_number(v) for k, v in alpha_pattern.items()
    ):
        raise AdapterError(f"{where}: alpha_pattern must map module patterns to numbers")

    target_parameters = cfg.get("target_parameters") or None
    if target_parameters is not None and not _is_str_list(target_parameters):
        raise AdapterError(f"{where}: target_parameters must be a list of parameter names")
    target_modules = cfg.get("target_modules")
    if target_modules is None and target_parameters:
        target_modules = []  # peft: target_parameters alone
    if target_modules is None:
        raise AdapterError(f"{where}: target_modules is not set")
    if not isinstance(target_modules, str) and not _is_str_list(target_modules):
        raise AdapterError(f"{where}: target_modules must be a list of names or a regex string")
    exclude = cfg.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, str) and not _is_str_list(exclude):
        raise AdapterError(f"{where}: exclude_modules must be a list of names or a regex string")

    layers = cfg.get("layers_to_transform")
    if _is_int(layers):
        layers = [layers]
    elif layers is not None and not (isinstance(layers, list) and all(_is_int(i) for i in layers)):
        raise AdapterError(f"{where}: layers_to_transform must be an integer or a list of integers")
    if layers == []:
        layers = None  # peft: an empty list means every layer
    pattern = cfg.get("layers_pattern")
    if isinstance(pattern, str):
        pattern = [pattern] if pattern else None
    elif pattern is not None and not _is_str_list(pattern):
        raise AdapterError(f"{where}: layers_pattern must be a string or a list of strings")

    regexes = [("rank_pattern", k) for k in rank_pattern] + [("alpha_pattern", k) for k in alpha_pattern]
    regexes += [("layers_pattern", p) for p in pattern or []]
    regexes += [(field, v) for field, v in (("target_modules", target_modules), ("exclude_modules", exclude))
                if isinstance(v, str)]
    for field, pattern in regexes:
        check_pattern(field, pattern, where)

    return _Settings(
        r=r,
        alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern),
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        target_modules=target_modules,
        exclude_modules=exclude,
        layers_to_transform=layers,
        layers_pattern=pattern or None,
        use_dora=use_dora,
        target_parameters=target_parameters,
    )


def _check_init(init, where: str) -> None:
    """Refuse init_lora_weights values with which peft serves an adapter on rewritten base weights."""
    if any(init is plain if isinstance(plain, bool) else init == plain for plain in PLAIN_INITS):
        return
    shown = _json(init)
    lowered = init.lower() if isinstance(init, str) else ""
    if lowered == "loftq":
        raise AdapterError(f"{where}: init_lora_weights={shown} is not supported: peft replaces the base model's "
                           f"weights with a quantized residual when it loads a LoftQ adapter, and the adapter fits "
                           f"only those weights (peft has no conversion of LoftQ adapters to plain LoRA)")
    if lowered.startswith(("pissa", "corda")) or lowered in CONVERTIBLE_INITS:
        raise AdapterError(f"{where}: init_lora_weights={shown} is not supported: with it peft rewrites the base "
                           f"model's weights (subtracting the initial adapter), and the adapter fits only those "
                           f"rewritten weights; {CONVERSION_HINT}")
    raise AdapterError(f"{where}: init_lora_weights={shown} is not supported; accepted values: "
                       f"{', '.join(map(_json, PLAIN_INITS))}")


def _json(value) -> str:
    """A config value as an error shows it: JSON, at most 80 characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:80] + "..."


def _targeted_modules(s: _Settings, num_layers: int, where: str, rx: Patterns,
                      modules=MODULES, layout=None) -> set[tuple[int, str]]:
    """(layer, module) pairs the config selects, matched on full names the way peft does (modules: the names the
    checkpoint's projections have; layout: a MoE model's experts, whose layers have no dense MLP and whose
    per-expert modules lora/experts.py matches)."""
    if s.layers_to_transform is not None:
        for i in s.layers_to_transform:
            if not 0 <= i < num_layers:
                raise AdapterError(
                    f"{where}: layers_to_transform lists layer {i}, but the base model has "
                    f"{num_layers} layers (0..{num_layers - 1})"
                )
    sparse = set(layout.layers) if layout is not None else set()
    names = {module_path(layer, m): (layer, m) for layer in range(num_layers) for m in modules
             if not (layer in sparse and PARENTS[m] == "mlp")}
    if isinstance(s.target_modules, list):
        for entry in s.target_modules:
            if entry in CONFIG_NAMES:
                continue  # embed_tokens / lm_head: lora/vocab.py's
            kind = layout.entry_kind(entry) if layout is not None else None  # an expert's module, or the router
            if kind is None and not any(full == entry or full.endswith("." + entry) for full in names):
                experts = f", the experts' {', '.join(layout.leaves)} and the router gate" if layout is not None else ""
                raise AdapterError(
                    f"{where}: unknown target module {entry!r} in target_modules; supported modules "
                    f"are {', '.join(modules)}{experts}"
                )
    targeted = {pair for full, pair in names.items() if _is_targeted(s, full, rx)}
    if not targeted and layout is None and not _targets_vocab(s, rx):
        raise AdapterError(f"{where}: {CONFIG_FILE} targets none of the modules {', '.join(modules)}")
    return targeted


def _targets_vocab(s: _Settings, rx: Patterns) -> bool:
    """Whether a config targets embed_tokens or lm_head (lora/vocab.py's; all-linear leaves them, as peft)."""
    return s.target_modules != "all-linear" and any(_is_targeted(s, m, rx) for m in VOCAB_MODULES)


def _is_targeted(s: _Settings, key: str, rx: Patterns) -> bool:
    """peft's check_target_module_exists for one full module name."""
    ex = s.exclude_modules
    if ex:
        if isinstance(ex, str):
            if rx.fullmatch("exclude_modules", ex, key):
                return False
        elif key in ex or any(key.endswith("." + e) for e in ex):
            return False
    tm = s.target_modules
    if isinstance(tm, str):
        return tm == "all-linear" or rx.fullmatch("target_modules", tm, key) is not None
    if key in tm:
        return True
    if not any(key.endswith("." + t) for t in tm):
        return False
    return rx.in_layers(s.layers_to_transform, s.layers_pattern, key)


def _rank_alpha(s: _Settings, key: str, rx: Patterns) -> tuple[int, float]:
    """Rank and alpha of one module after rank_pattern / alpha_pattern (peft's get_pattern_key)."""
    r, alpha = s.r, s.alpha
    for pattern, value in s.rank_pattern.items():
        if rx.match("rank_pattern", rf"(.*\.)?({pattern})$", key):
            r = value
            break
    for pattern, value in s.alpha_pattern.items():
        if rx.match("alpha_pattern", rf"(.*\.)?({pattern})$", key):
            alpha = value
            break
    return r, alpha


def _pair_tensors(tensors: dict[str, torch.Tensor], num_layers: int, where: str, modules=MODULES):
    """Group tensors by (layer, module) -> {'A'|'B': (tensor name, tensor)}."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for tensor_name, t in tensors.items():
        parts = tensor_name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)
        if idx is None:
            raise AdapterError(
                f"{where}: unexpected tensor {tensor_name}: not a LoRA weight "
                f"(full-weight modules such as modules_to_save are not supported)"
            )
        kind = parts[idx]
        if kind in ("lora_embedding_A", "lora_embedding_B"):
            raise AdapterError(f"{where}: tensor {tensor_name}: LoRA on embeddings is not supported")
        if kind not in ("lora_A", "lora_B", "lora_magnitude_vector"):
            raise AdapterError(f"{where}: tensor {tensor_name}: {kind} is not supported (plain LoRA or DoRA only)")
        rest = parts[idx + 1 :]
        if kind == "lora_magnitude_vector" and rest in ([], ["weight"]):
            rest = ["weight"]  # peft saves DoRA's magnitude as <module>.lora_magnitude_vector
        if rest[-1:] == ["bias"]:
            raise AdapterError(f"{where}: tensor {tensor_name}: LoRA bias (lora_bias) is not supported")
        if not (rest == ["weight"] or (len(rest) == 2 and rest[1] == "weight")):
            raise AdapterError(f"{where}: unexpected tensor name {tensor_name}")
        prefix = parts[:idx]
        if prefix[:2] == ["base_model", "model"]:
            prefix = prefix[2:]
        module_name = ".".join(prefix)
        m = _LAYER_RE.search(module_name)
        if m is None:
            raise AdapterError(
                f"{where}: tensor {tensor_name} targets {module_name!r}, which is not a decoder-layer "
                f"projection; supported modules are {', '.join(modules)}"
            )
        layer = int(m.group(1))
        try:
            module = normalize_target(m.group(2), modules)
        except ValueError as exc:
            raise AdapterError(f"{where}: tensor {tensor_name}: {exc}") from exc
        if m.group(2) != f"{PARENTS[module]}.{module}":
            raise AdapterError(f"{where}: tensor {tensor_name}: unknown module path {module_name!r}")
        if layer >= num_layers:
            raise AdapterError(
                f"{where}: tensor {tensor_name} is for layer {layer}, but the base model has "
                f"{num_layers} layers (0..{num_layers - 1})"
            )
        slot = pairs.setdefault((layer, module), {})
        ab = "M" if kind == "lora_magnitude_vector" else kind[-1]
        if ab in slot:
            raise AdapterError(
                f"{where}: duplicate tensors for {module_path(layer, module)} lora_{ab}: "
                f"{slot[ab][0]} and {tensor_name}"
            )
        slot[ab] = (tensor_name, t)
    return pairs


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)
