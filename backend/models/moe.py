"""A routed mixture of experts (Mixtral, Qwen3-MoE) in place of a layer's MLP, with per-token expert LoRA.

Routing follows transformers' MixtralTopKRouter / Qwen3MoeTopKRouter: router logits in the model's dtype,
softmax in fp32, the top-k experts, their weights renormalized to sum to 1 (Mixtral always, Qwen3-MoE with
norm_topk_prob), cast back to the model's dtype by Qwen3-MoE only. Each expert then runs over the (token, expert)
rows routed to it, grouped by expert (one GEMM per expert hit, never a loop over tokens); a row's expert LoRA
comes from its token's adapter slot, through the LoRA plan (decision 066). Outputs are summed per token, weighted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.lora.moe_layout import ROUTER, ExpertLayout, expert_layout


class MoeBlock:
    """One layer's router and experts: router [E, H], gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    def __init__(self, layout: ExpertLayout, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
        self.layout = layout
        self.num_experts, self.top_k, self.inter = layout.num_experts, layout.top_k, layout.intermediate
        self.renormalize = layout.renormalize
        self.weights_in_model_dtype = layout.family == "qwen3_moe"  # Qwen3MoeTopKRouter casts them back
        self.router, self.gate_up, self.down = router, gate_up, down

    def route(self, x: torch.Tensor, lora=None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts int64 [T, k]) of each token, as transformers' top-k router computes them; lora
        adds each token's adapter's router delta to the logits."""
        logits = F.linear(x, self.router)
        if lora is not None and lora.backend.slots.expert_rank(layer, ROUTER):
            lora.apply_experts((logits,), x, layer, (ROUTER,), lora.row_slots())
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def __call__(self, x: torch.Tensor, lora, layer: int) -> torch.Tensor:
        """The block's output [T, H] for x [T, H]; lora (a LoraPlan or None) adds each routed row's expert deltas
        from its token's adapter."""
        weights, experts = self.route(x, lora, layer)
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)  # the (token, expert) rows grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order.div(self.top_k, rounding_mode="floor")
        xs = x.index_select(0, tokens)
        rows, inter = xs.shape[0], self.inter
        gate_up = xs.new_empty(rows, 2 * inter)
        self._each_expert(counts, xs, self.gate_up, gate_up)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        pair_slots = None
        if lora is not None and lora.backend.slots.holds_experts(layer):
            slots = lora.row_slots().index_select(0, tokens)
            pair_slots = torch.where(slots >= 0, slots * self.num_experts + flat.index_select(0, order).to(slots.dtype),
                                     -1).to(torch.int32)
            lora.apply_experts((gate, up), xs, layer, ("gate_proj", "up_proj"), pair_slots)
        hidden = F.silu(gate) * up
        out = xs.new_empty(rows, x.shape[1])
        self._each_expert(counts, hidden, self.down, out)
        if pair_slots is not None:
            lora.apply_experts((out,), hidden, layer, ("down_proj",), pair_slots)
        out = (out * weights.view(-1).index_select(0, order)[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)

    @staticmethod
    def _each_expert(counts: list[int], x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows of expert e] = x[those rows] @ weight[e].T, for each expert with rows (x grouped by expert)."""
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(x[start:start + n], weight[e].t(), out=out[start:start + n])
                start += n


def take_moe(weights: dict[str, torch.Tensor], layer: int, config, dtype, device) -> MoeBlock | None:
    """Pop layer's router and experts from the checkpoint's tensors (loader.load_safetensors' names) and return its
    MoeBlock; None for a dense layer (Qwen3-MoE's mlp_only_layers / decoder_sparse_step), whose MLP stays. Reads
    transformers 5's fused experts (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) and the
    per-expert modules of transformers 4.x checkpoints (Mixtral's block_sparse_moe.experts.e.w1/w3/w2, Qwen3-MoE's
    mlp.experts.e.gate_proj/up_proj/down_proj). ValueError naming a tensor that is missing or misshapen."""
    layout = expert_layout(config)
    if layout is None or layer not in layout.layers:
        return None
    p = f"model.layers.{layer}."
    e, h, i = layout.num_experts, layout.hidden, layout.intermediate
    router_name = next((f"{p}{parent}.gate.weight" for parent in (layout.parent, "mlp")
                        if f"{p}{parent}.gate.weight" in weights), f"{p}{layout.parent}.gate.weight")
    router = _take(weights, router_name, (e, h))
    if f"{p}mlp.experts.gate_up_proj" in weights:
        gate_up = _take(weights, f"{p}mlp.experts.gate_up_proj", (e, 2 * i, h))
        down = _take(weights, f"{p}mlp.experts.down_proj", (e, h, i))
    else:
        leaf = {module: name for name, module in layout.leaves.items()}
        base = f"{p}{layout.parent}.experts."
        gate_up = torch.stack([torch.cat([_take(weights, f"{base}{x}.{leaf['gate_proj']}.weight", (i, h)),
                                          _take(weights, f"{base}{x}.{leaf['up_proj']}.weight", (i, h))])
                               for x in range(e)])
        down = torch.stack([_take(weights, f"{base}{x}.{leaf['down_proj']}.weight", (h, i)) for x in range(e)])
    leftover = sorted(k for k in weights if k.startswith(f"{p}{layout.parent}.experts.") or k.startswith(f"{p}mlp.experts."))
    if leftover:
        raise ValueError(f"layer {layer}: unexpected expert tensor {leftover[0]} (the base model has {e} experts)")
    as_model = dict(dtype=dtype, device=device)
    return MoeBlock(layout, router.to(**as_model), gate_up.to(**as_model).contiguous(), down.to(**as_model).contiguous())


def _take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = weights.pop(name, None)
    if t is None:
        raise ValueError(f"the checkpoint has no {name}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
    return t
