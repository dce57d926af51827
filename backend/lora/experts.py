"""LoRA on MoE experts: an adapter's expert tensors in either layout, checked against the base model's experts.

Two layouts reach us (decision 066):

- per-expert modules, as transformers 4.x and vLLM name them: ``layers.L.mlp.experts.E.gate_proj|up_proj|down_proj``
  (Qwen3-MoE) or ``layers.L.block_sparse_moe.experts.E.w1|w3|w2`` (Mixtral: w1 gate, w3 up, w2 down), each a pair
  A [r, in], B [out, r];
- peft's ``target_parameters`` on transformers 5's fused expert tensors (peft's ParamWrapper), saved as
  ``layers.L.mlp.experts[.base_layer].lora_A|lora_B.weight``: A [E * r, in] (expert e: rows e*r .. e*r + r - 1),
  B [out, r * E] (expert e: columns k * E + e); gate_up_proj's out is [gate; up] (2I), and a wrapper nests
  inside the next one in the order the experts module defines its parameters (gate_up_proj innermost).

The router (``layers.L.mlp.gate``, Mixtral 4.x ``block_sparse_moe.gate``; peft's ``all-linear`` includes it, on
transformers 5 as ``target_parameters: gate.weight``) is one pair A [r, hidden], B [E, r] in either layout.

Both become, per (layer, expert projection), groups of experts of one rank and scale, A [n, r, in] and B [n, out, r]
(ExpertLora): the adapted experts only, unpadded, so that an adapter holds what its file holds and no more. A
gate_up_proj pair maps onto the gate and up projections with one A and B's two halves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loraplex.exceptions import AdapterError
from loraplex.lora.moe_layout import EXPERT_MODULES, FUSED_PARAMS, ROUTER, ExpertLayout, expert_layout  # noqa: F401

_PER_EXPERT = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.(lora_\w+?)(?:\.weight)?$")
_FUSED = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(\w+)\.experts\.((?:base_layer\.)*)(lora_\w+?)(?:\.weight)?$")
_ROUTER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(\w+)\.gate\.(lora_\w+?)(?:\.weight)?$")


@dataclass(slots=True)
class ExpertLora:
    """Experts of one rank and scale in one expert projection of one layer: their A [n, r, in] and B [n, out, r]."""

    experts: tuple[int, ...]
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def take_expert_tensors(tensors: dict[str, torch.Tensor], layout: ExpertLayout, num_layers: int,
                        where: str) -> dict[str, torch.Tensor]:
    """Remove the expert and router tensors from ``tensors`` and return them; AdapterError for shared experts."""
    taken = {}
    for name in list(tensors):
        if ".shared_expert" in name:
            raise AdapterError(f"{where}: tensor {name}: LoRA on shared experts is not served")
        if is_expert_tensor(name, layout):
            taken[name] = tensors.pop(name)
    return taken


def is_expert_tensor(name: str, layout: ExpertLayout) -> bool:
    """Whether an adapter tensor is LoRA on the experts (either layout) or on the router."""
    short = name.removeprefix("base_model.model.")
    router = _ROUTER.match(short)
    return ".experts." in f".{short}" or (router is not None and router.group(2) in (layout.parent, "mlp"))


def refuse_experts(names, layout: ExpertLayout, settings, where: str) -> None:
    """AdapterError naming max_expert_lora_rank when an adapter's tensors (names: its safetensors header's) or its
    target_parameters adapt the experts or the router: the server holds no expert stacks (decision 070)."""
    found = min((n for n in names if is_expert_tensor(n, layout)), default=None)
    what = f"tensor {found}" if found is not None else (
        f"target_parameters {settings.target_parameters}" if settings.target_parameters else None)
    if what is not None:
        raise AdapterError(f"{where}: {what} adapts the MoE experts or router, but this server serves LoRA on "
                           f"attention and dense layers only (max_expert_lora_rank is 0): use an adapter without "
                           f"expert or router LoRA, or ask the operator to set max_expert_lora_rank")


def parse_experts(tensors: dict[str, torch.Tensor], layout: ExpertLayout, settings, where: str, rx,
                  max_lora_rank: int, dtype, knob: str = "max_lora_rank") -> dict[tuple[int, str], list[ExpertLora]]:
    """The expert LoRA of an adapter's expert tensors (take_expert_tensors), checked against its config (settings:
    adapter._Settings) and the layout: (layer, EXPERT_MODULES name or ROUTER) -> its experts, grouped by rank and
    scale (the router: one group of "expert" 0). max_lora_rank: the expert stacks' rank, knob the setting that
    bounds it (named in messages)."""
    per_expert, fused, router = {}, {}, {}
    for name, t in tensors.items():
        short = name.removeprefix("base_model.model.")
        m = _ROUTER.match(short)
        if m is not None:
            layer, kind = int(m.group(1)), m.group(3)
            if kind == "lora_magnitude_vector":
                raise AdapterError(f"{where}: tensor {name}: DoRA (use_dora) on the MoE router is not supported")
            _check_kind(name, kind, where)
            _check_layer(name, layer, layout, where)
            _put(router, layer, kind, name, t, where)
            continue
        m = _PER_EXPERT.match(short)
        if m is not None:
            layer, parent, expert, leaf, kind = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4), m.group(5)
            _check_kind(name, kind, where)
            if parent != layout.parent or leaf not in layout.leaves:
                raise AdapterError(f"{where}: tensor {name}: unknown expert module {parent}.experts.{expert}.{leaf}; "
                                   f"this base model's experts are {layout.parent}.experts.<e>."
                                   f"{{{','.join(layout.leaves)}}}")
            _check_layer(name, layer, layout, where)
            if expert >= layout.num_experts:
                raise AdapterError(f"{where}: tensor {name} is for expert {expert}, but the base model has "
                                   f"{layout.num_experts} experts (0..{layout.num_experts - 1})")
            _put(per_expert, (layer, layout.leaves[leaf], expert), kind, name, t, where)
            continue
        m = _FUSED.match(short)
        if m is None or m.group(2) != "mlp":
            raise AdapterError(f"{where}: unexpected tensor name {name}")
        layer, depth, kind = int(m.group(1)), m.group(3).count("base_layer."), m.group(4)
        _check_kind(name, kind, where)
        _check_layer(name, layer, layout, where)
        _put(fused, (layer, depth), kind, name, t, where)
    if per_expert and fused:
        raise AdapterError(f"{where}: the adapter mixes per-expert modules ({_first(per_expert)}) and fused expert "
                           f"parameters ({_first(fused)})")
    if settings.use_dora and (per_expert or fused):
        raise AdapterError(f"{where}: DoRA (use_dora) on MoE experts is not supported (tensor "
                           f"{_first(per_expert or fused)})")
    out = {}
    limit = (max_lora_rank, knob)
    if fused or settings.target_parameters:
        out = _fused_experts(fused, layout, settings, where, rx, limit, dtype)
    elif per_expert:
        out = _per_expert(per_expert, layout, settings, where, rx, limit, dtype)
    out.update(_router(router, layout, settings, where, rx, limit, dtype))
    return out


def _first(groups: dict) -> str:
    """The first tensor name of grouped tensors (for messages)."""
    return min(name for found in groups.values() for name, _ in found.values())


def _check_kind(name: str, kind: str, where: str) -> None:
    if kind == "lora_magnitude_vector":
        raise AdapterError(f"{where}: tensor {name}: DoRA (use_dora) on MoE experts is not supported")
    if kind not in ("lora_A", "lora_B"):
        raise AdapterError(f"{where}: tensor {name}: {kind} is not supported on MoE experts (plain LoRA only)")


def _check_rank(full: str, r: int, limit: tuple[int, str], where: str) -> None:
    if r > limit[0]:
        raise AdapterError(f"{where}: {full} has rank {r}, above the server's {limit[1]} {limit[0]}")


def _check_layer(name: str, layer: int, layout: ExpertLayout, where: str) -> None:
    if layer not in layout.layers:
        raise AdapterError(f"{where}: tensor {name} is for experts of layer {layer}, which has none (the base "
                           f"model's MoE layers are {_span(layout.layers)})")


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}..{layers[-1]}" if list(layers) == list(range(layers[0], layers[-1] + 1)) else str(list(layers))


def _put(groups: dict, key, kind: str, name: str, t: torch.Tensor, where: str) -> None:
    slot = groups.setdefault(key, {})
    ab = kind[-1]
    if ab in slot:
        raise AdapterError(f"{where}: duplicate tensors for lora_{ab}: {slot[ab][0]} and {name}")
    slot[ab] = (name, t)


def _pair(found: dict, what: str, where: str):
    if set(found) != {"A", "B"}:
        have = next(iter(found))
        raise AdapterError(f"{where}: incomplete LoRA pair for {what}: {found[have][0]} present, "
                           f"lora_{'B' if have == 'A' else 'A'} missing")
    return found["A"], found["B"]


def _per_expert(groups: dict, layout: ExpertLayout, s, where: str, rx, limit: tuple[int, str],
                dtype) -> dict[tuple[int, str], list[ExpertLora]]:
    """Per-expert modules: each targeted expert projection's own pair, stacked with the experts of its rank and
    scale."""
    from loraplex.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, _checked, _rank_alpha, lora_scale

    match = Targets(s, rx)
    targeted = {(layer, module, e) for layer in layout.layers for e in range(layout.num_experts)
                for module in EXPERT_MODULES if match(layout.module_name(layer, e, module))}
    for key in sorted(set(groups) - targeted):
        raise AdapterError(f"{where}: tensor {_first({key: groups[key]})} is for "
                           f"{layout.module_name(key[0], key[2], key[1])}, which {CONFIG_FILE} does not target "
                           f"(target_modules / layers_to_transform / exclude_modules)")
    for key in sorted(targeted - set(groups)):
        raise AdapterError(f"{where}: {CONFIG_FILE} targets {layout.module_name(key[0], key[2], key[1])} but "
                           f"{WEIGHTS_FILE} has no lora_A / lora_B tensors for it")
    out = {}
    shapes = layout.shapes()
    for layer in layout.layers:
        for module in EXPERT_MODULES:
            keys = [(layer, module, e) for e in range(layout.num_experts) if (layer, module, e) in groups]
            if not keys:
                continue
            in_f, out_f = shapes[module]
            pairs = {}
            for key in keys:
                full = layout.module_name(layer, key[2], module)
                r, alpha = _rank_alpha(s, full, rx)
                _check_rank(full, r, limit, where)
                (a_name, a), (b_name, b) = _pair(groups[key], full, where)
                pairs[key[2]] = (_checked(a_name, a, (r, in_f), dtype, where), _checked(b_name, b, (out_f, r), dtype, where),
                                 r, lora_scale(alpha, r, s.use_rslora))
            by_rank: dict[tuple[int, float], list[int]] = {}
            for e, (_a, _b, r, scale) in pairs.items():
                by_rank.setdefault((r, scale), []).append(e)
            out[(layer, module)] = [
                ExpertLora(tuple(experts), torch.stack([pairs[e][0] for e in experts]),
                           torch.stack([pairs[e][1] for e in experts]), scale)
                for (_r, scale), experts in by_rank.items()]
    return out


def _fused_experts(groups: dict, layout: ExpertLayout, s, where: str, rx, limit: tuple[int, str],
                   dtype) -> dict[tuple[int, str], list[ExpertLora]]:
    """peft's target_parameters on the fused expert tensors: each wrapper's A [E*r, in] and B [out, r*E]."""
    from loraplex.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, _checked, _rank_alpha, lora_scale

    params, _router_layers = targeted_params(s.target_parameters or [], layout, where)
    for layer, depth in sorted(groups):
        if depth >= len(params.get(layer, ())):
            raise AdapterError(
                f"{where}: tensor {_first({0: groups[(layer, depth)]})} is for a parameter of "
                f"{layout.param_key(layer, '')[:-1]} that {CONFIG_FILE}'s target_parameters do not select "
                f"(they select {', '.join(params.get(layer, ())) or 'none'} of its gate_up_proj, down_proj)")
    e, h, i = layout.num_experts, layout.hidden, layout.intermediate
    dims = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}  # (in, out) as peft's ParamWrapper sees them
    out = {}
    for layer, selected in params.items():
        for index, param in enumerate(selected):
            full = layout.param_key(layer, param)
            found = groups.get((layer, len(selected) - 1 - index))  # the first-defined parameter is innermost
            if found is None:
                raise AdapterError(f"{where}: {CONFIG_FILE} targets {full} (target_parameters) but {WEIGHTS_FILE} "
                                   f"has no lora_A / lora_B tensors for it")
            r, alpha = _rank_alpha(s, full, rx)
            _check_rank(full, r, limit, where)
            (a_name, a), (b_name, b) = _pair(found, full, where)
            in_f, out_f = dims[param]
            a = _checked(a_name, a, (e * r, in_f), dtype, where).view(e, r, in_f)
            b = _checked(b_name, b, (out_f, r * e), dtype, where).view(out_f, r, e).permute(2, 0, 1)  # [E, out, r]
            every, scale = tuple(range(e)), lora_scale(alpha, r, s.use_rslora)
            if param == "down_proj":
                out[(layer, "down_proj")] = [ExpertLora(every, a, b.contiguous(), scale)]
            else:  # [gate; up]: one A, B's halves
                out[(layer, "gate_proj")] = [ExpertLora(every, a, b[:, :i].contiguous(), scale)]
                out[(layer, "up_proj")] = [ExpertLora(every, a, b[:, i:].contiguous(), scale)]
    return out


def _router(groups: dict, layout: ExpertLayout, s, where: str, rx, limit: tuple[int, str],
            dtype) -> dict[tuple[int, str], list[ExpertLora]]:
    """LoRA on the router of each layer: A [r, hidden], B [E, r], whether target_parameters (gate.weight) or
    target_modules (the router module of transformers 4.x) select it."""
    from loraplex.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, _checked, _rank_alpha, lora_scale

    _params, by_params = targeted_params(s.target_parameters or [], layout, where)
    match = Targets(s, rx)
    by_modules = {layer for layer in layout.layers if match(f"model.layers.{layer}.{layout.parent}.gate")}
    for layer in sorted(set(groups) - by_params - by_modules):
        raise AdapterError(f"{where}: tensor {_first({0: groups[layer]})} is for the router of layer {layer}, which "
                           f"{CONFIG_FILE} does not target (target_parameters gate.weight / target_modules gate)")
    required = by_params | (by_modules if groups else set())  # target_modules' names may be transformers 5's
    for layer in sorted(required - set(groups)):
        raise AdapterError(f"{where}: {CONFIG_FILE} targets the router of layer {layer} but {WEIGHTS_FILE} has no "
                           f"lora_A / lora_B tensors for it")
    if groups and s.use_dora:
        raise AdapterError(f"{where}: DoRA (use_dora) on the MoE router is not supported (tensor {_first(groups)})")
    out = {}
    for layer, found in sorted(groups.items()):
        key = (f"model.layers.{layer}.mlp.gate.weight" if layer in by_params
               else f"model.layers.{layer}.{layout.parent}.gate")
        r, alpha = _rank_alpha(s, key, rx)
        _check_rank(key, r, limit, where)
        (a_name, a), (b_name, b) = _pair(found, key, where)
        a = _checked(a_name, a, (r, layout.hidden), dtype, where)
        b = _checked(b_name, b, (layout.num_experts, r), dtype, where)
        out[(layer, ROUTER)] = [ExpertLora((0,), a[None], b[None], lora_scale(alpha, r, s.use_rslora))]
    return out


def targeted_params(entries: list[str], layout: ExpertLayout, where: str) -> tuple[dict[int, list[str]], set[int]]:
    """The fused expert tensors target_parameters select, per layer in the order the module defines them (peft
    matches an entry that equals a parameter's name or ends it after a dot, in every layer), and the layers whose
    router (mlp.gate.weight) they select; AdapterError for an entry that selects nothing served."""
    selected: dict[int, list[str]] = {}
    routers: set[int] = set()
    for entry in entries:
        hits = 0
        for layer in layout.layers:
            if _suffix_of(entry, f"model.layers.{layer}.mlp.gate.weight"):
                routers.add(layer)
                hits += 1
            for param in FUSED_PARAMS:
                if _suffix_of(entry, layout.param_key(layer, param)):
                    hits += 1
                    selected.setdefault(layer, [])
                    if param not in selected[layer]:
                        selected[layer].append(param)
        if not hits:
            raise AdapterError(f"{where}: target_parameters entry {entry!r} selects none of the experts' "
                               f"gate_up_proj and down_proj (mlp.experts.gate_up_proj / mlp.experts.down_proj) nor "
                               f"the router's weight (mlp.gate.weight), the only parameters LoRA is served on")
    return {layer: sorted(params, key=FUSED_PARAMS.index) for layer, params in sorted(selected.items())}, routers


def _suffix_of(entry: str, key: str) -> bool:
    return key == entry or key.endswith("." + entry)


class Targets:
    """peft's check_target_module_exists for many module names: list entries looked up by dotted suffix (a set
    lookup per suffix, not a scan of the list per name)."""

    def __init__(self, s, rx):
        self.s, self.rx = s, rx
        self.targets = None if isinstance(s.target_modules, str) else frozenset(s.target_modules or ())
        ex = s.exclude_modules
        self.excludes = frozenset(ex) if ex and not isinstance(ex, str) else None

    def __call__(self, key: str) -> bool:
        s, rx = self.s, self.rx
        parts = key.split(".")
        suffixes = {".".join(parts[i:]) for i in range(len(parts))}
        if isinstance(s.exclude_modules, str) and s.exclude_modules:
            if rx.fullmatch("exclude_modules", s.exclude_modules, key):
                return False
        elif self.excludes and suffixes & self.excludes:
            return False
        if self.targets is None:
            return s.target_modules == "all-linear" or rx.fullmatch("target_modules", s.target_modules, key) is not None
        if key in self.targets:
            return True
        if not suffixes & self.targets:
            return False
        return rx.in_layers(s.layers_to_transform, s.layers_pattern, key)
