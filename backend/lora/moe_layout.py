"""A MoE checkpoint's experts as its config describes them (Mixtral, Qwen3-MoE), without torch: which layers
route over how many experts, their shapes, and the names adapters give their modules (decision 066)."""

from __future__ import annotations

from dataclasses import dataclass

EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")  # one expert's projections, as the slots key them
FUSED_PARAMS = ("gate_up_proj", "down_proj")  # transformers 5's expert tensors, in the order the module defines them
ROUTER = "router"  # the router's LoRA in the slots' expert stacks: one pair of [E, hidden] per layer


@dataclass(frozen=True)
class ExpertLayout:
    """A MoE checkpoint's experts: which layers route over how many experts, and the names its adapters use."""

    family: str  # "mixtral" | "qwen3_moe"
    num_experts: int
    top_k: int
    layers: tuple[int, ...]  # decoder layers with a sparse MoE block; the others keep a dense MLP
    hidden: int
    intermediate: int  # one expert's intermediate size
    renormalize: bool  # the top-k routing weights renormalized to sum to 1
    parent: str  # the experts' parent module in transformers 4.x names ("block_sparse_moe" or "mlp")
    leaves: dict  # per-expert module name in transformers 4.x -> EXPERT_MODULES name

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each expert projection."""
        h, i = self.hidden, self.intermediate
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def module_name(self, layer: int, expert: int, module: str) -> str:
        """An expert projection's module name in transformers 4.x, e.g. model.layers.0.block_sparse_moe.experts.3.w1."""
        leaf = next(k for k, v in self.leaves.items() if v == module)
        return f"model.layers.{layer}.{self.parent}.experts.{expert}.{leaf}"

    def param_key(self, layer: int, param: str) -> str:
        """A fused expert tensor's name in transformers 5, e.g. model.layers.0.mlp.experts.gate_up_proj."""
        return f"model.layers.{layer}.mlp.experts.{param}"

    def max_tensors(self) -> int:
        """Most expert tensors an adapter holds: lora_A and lora_B of each expert projection of each expert and of
        each router."""
        return 2 * len(self.layers) * (self.num_experts * len(EXPERT_MODULES) + 1)

    def elements_per_rank(self) -> int:
        """A and B elements per unit of rank over every expert projection (per-expert layout; the fused one holds
        fewer: one A for gate and up) and router."""
        return len(self.layers) * (self.num_experts * sum(i + o for i, o in self.shapes().values())
                                   + self.hidden + self.num_experts)

    def entry_kind(self, entry: str) -> str | None:
        """'expert' or 'router' when a target_modules entry names (a dotted suffix of) a per-expert module or the
        router in transformers 4.x names; None otherwise. Linear in the entry's length."""
        parts = entry.split(".")
        for kind, template in (("expert", ["model", "layers", "<L>", self.parent, "experts", "<E>", "<leaf>"]),
                               ("router", ["model", "layers", "<L>", self.parent, "gate"]),
                               ("router", ["model", "layers", "<L>", "mlp", "gate"])):
            if 0 < len(parts) <= len(template) and all(
                    _fits(part, want, self) for part, want in zip(parts, template[len(template) - len(parts):])):
                return kind
        return None


def _fits(part: str, want: str, layout: ExpertLayout) -> bool:
    if want == "<L>":
        return part.isdigit() and int(part) in layout.layers
    if want == "<E>":
        return part.isdigit() and int(part) < layout.num_experts
    if want == "<leaf>":
        return part in layout.leaves
    return part == want


def expert_layout(hf_config) -> ExpertLayout | None:
    """The experts of a Mixtral or Qwen3-MoE config (a transformers config or config.json's fields); None for a
    dense model. ValueError on expert counts that do not make sense."""
    model_type = getattr(hf_config, "model_type", None)
    num_layers = int(hf_config.num_hidden_layers)
    hidden = int(hf_config.hidden_size)
    if model_type == "mixtral":
        experts = _positive(hf_config, "num_local_experts", 8)
        top_k = _positive(hf_config, "num_experts_per_tok", 2)
        layers, inter = tuple(range(num_layers)), _positive(hf_config, "intermediate_size", None)
        renormalize, parent = True, "block_sparse_moe"
        leaves = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    elif model_type == "qwen3_moe":
        # transformers 5 names it num_local_experts in config.json, 4.x num_experts
        experts = int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0)
        if experts <= 0:
            return None
        top_k = _positive(hf_config, "num_experts_per_tok", 8)
        step = _positive(hf_config, "decoder_sparse_step", 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        inter = _positive(hf_config, "moe_intermediate_size", None)
        renormalize, parent = bool(getattr(hf_config, "norm_topk_prob", False)), "mlp"
        leaves = {m: m for m in EXPERT_MODULES}
    else:
        return None
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok {top_k} is more than the {experts} experts")
    if not layers:
        return None
    return ExpertLayout(model_type, experts, top_k, layers, hidden, inter, renormalize, parent, leaves)


def _positive(cfg, name: str, default) -> int:
    value = getattr(cfg, name, None)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config {name}={value!r} must be a positive integer")
    return value
