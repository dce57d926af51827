"""Device-resident LoRA stacks: a fixed number of adapter slots the model reads every step.

Layout per layer and projection (see backend/kernels/reference.py):
  a[layer][module]      [max_loras, max_rank, in_features]   zero-padded past each rank
  b[layer][module]      [max_loras, out_features, max_rank]  zero-padded past each rank (on the CPU a
                        view of [max_loras, max_rank, out_features] stored contiguous: see _b_stack)
  ranks[layer][module]  int32 [max_loras]   0 where the slot's adapter does not target it
  scales[layer][module] float32 [max_loras]
  out_scales[layer][module] float32 [max_loras + 1, out]  DoRA's per-output scale (1.0: plain LoRA, empty
                        slots and the last row, which base rows -1 read); allocated at the first DoRA load

MoE experts (decision 066), for the layers with a sparse block (which hold no dense MLP stacks), at their own
rank R = max_expert_rank (EngineConfig.max_expert_lora_rank, decision 070; 0: no expert stacks at all):
  xa[layer][module]     [max_loras, num_experts, R, in]   module: an expert's gate/up/down_proj
  xb[layer][module]     [max_loras, num_experts, out, R]  (on the CPU a view, as b)
  xranks / xscales[layer][module]  [max_loras * num_experts]: slot s, expert e at s * num_experts + e
so that a routed (token, expert) row is one row of a per-row gather over max_loras * num_experts stacks; and the
router's LoRA, xa[layer]["router"] [max_loras, 1, R, hidden], xb [max_loras, 1, num_experts, R], a token's row at
its slot. Memory: lora/expert_rank.py's expert_stack_bytes.

Stacks exist for all seven projections whether or not any adapter targets them, so the
model never branches on shape. Memory: num_layers * max_loras * max_rank *
sum over the seven projections of (in + out) * element size. LLaMA-2-7B (32 layers,
hidden 4096, intermediate 11008: the sum is 4 * 8192 + 3 * 15104 = 78080) with 8 slots of
rank 16 in fp16 needs 32 * 8 * 16 * 78080 * 2 bytes = about 610 MiB.
"""

from __future__ import annotations

import torch

from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.vocab import VocabSlots
from loraplex.lora.moe_layout import EXPERT_MODULES, ROUTER, ExpertLayout
from loraplex.lora.shapes import MODULES, PARENTS


class LoraSlots:
    """Fixed-size stacks of LoRA A/B weights, ranks and scales, one row per adapter slot."""

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, int]], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device, experts: ExpertLayout | None = None,
                 expert_rank: int | None = None) -> None:
        if max_loras <= 0 or max_rank <= 0 or num_layers <= 0:
            raise ValueError("num_layers, max_loras and max_rank must be positive")
        expert_rank = max_rank if expert_rank is None else expert_rank
        if not 0 <= expert_rank <= max_rank:
            raise ValueError(f"expert_rank {expert_rank} must be in 0..max_rank {max_rank}")
        missing = [m for m in MODULES if m not in shapes]
        if missing:
            raise ValueError(f"shapes lacks modules {missing}")
        self.num_layers = num_layers
        self.shapes = {m: (int(shapes[m][0]), int(shapes[m][1])) for m in MODULES}
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        # ranks and scales of every layer and module in one tensor each: a slot's are set in one copy
        self._ranks = torch.zeros(num_layers, len(MODULES), max_loras, dtype=torch.int32, device=self.device)
        self._scales = torch.zeros(num_layers, len(MODULES), max_loras, dtype=torch.float32, device=self.device)
        self.ranks = [{m: self._ranks[layer, i] for i, m in enumerate(MODULES)} for layer in range(num_layers)]
        # per slot, (layer, module) -> (rank, scale) of what it holds: read on the host, no device op
        self.targets: list[dict[tuple[int, str], tuple[int, float]]] = [{} for _ in range(max_loras)]
        self.scales = [{m: self._scales[layer, i] for i, m in enumerate(MODULES)} for layer in range(num_layers)]
        self.slot_ranks = [0] * max_loras  # the largest rank each slot holds (host)
        sparse = set(experts.layers) if experts is not None else set()
        for layer in range(num_layers):
            dense = {m: io for m, io in self.shapes.items() if not (layer in sparse and PARENTS[m] == "mlp")}
            self.a.append({m: torch.zeros(max_loras, max_rank, i, dtype=dtype, device=self.device)
                           for m, (i, _o) in dense.items()})
            self.b.append({m: self._b_stack(o) for m, (_i, o) in dense.items()})
        self._init_experts(experts, expert_rank if experts is not None else 0)
        # the same stacks as batched-matmul operands for the torch path: A.T [S, in, R], B.T [S, R, out], scales [S, 1, 1]
        self.a_t = [{m: a.transpose(1, 2) for m, a in layer.items()} for layer in self.a]
        self.b_t = [{m: b.transpose(1, 2) for m, b in layer.items()} for layer in self.b]
        self.tile_scales = [{m: t.view(-1, 1, 1) for m, t in layer.items()} for layer in self.scales]
        # DoRA: base_weight(layer, module) -> (W [out, in], bias or None), set by the engine; out_scales is
        # allocated only once a DoRA adapter is loaded, and dora_slots says which slots hold one
        self.base_weight = None
        self.out_scales: list[dict[str, torch.Tensor]] | None = None
        self.dora_slots: set[int] = set()
        self.vocab = VocabSlots(max_loras, device)  # embed_tokens / lm_head parts, sized per adapter (lora/vocab.py)

    def _b_stack(self, out_features: int, *lead: int, rank: int | None = None) -> torch.Tensor:
        """A zeroed B stack [max_loras, *lead, out, rank (max_rank)]. On the CPU it is a view of B.T stored
        contiguous ([max_loras, *lead, rank, out]), the layout the torch path's batched matmuls read fastest at a few
        rows an adapter (decision 020); the CUDA kernels read [max_loras, *lead, out, rank] contiguous."""
        lead, rank = (self.max_loras, *lead), self.max_rank if rank is None else rank
        if self.device.type == "cpu":
            stored = torch.zeros(*lead, rank, out_features, dtype=self.dtype, device=self.device)
            return stored.transpose(-1, -2)
        return torch.zeros(*lead, out_features, rank, dtype=self.dtype, device=self.device)

    def _init_experts(self, experts: ExpertLayout | None, rank: int) -> None:
        """The expert stacks of a MoE model's sparse layers at rank (none for a dense model, or at rank 0)."""
        self.experts = experts  # the model's experts, whether or not the slots hold stacks for them
        self.max_expert_rank = rank
        stacked = experts if rank else None
        n = stacked.num_experts if stacked is not None else 0  # no stacks: empty, 0 bytes
        self.xa: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_layers)]
        self.xb: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_layers)]
        self._xranks = torch.zeros(self.num_layers, len(EXPERT_MODULES), self.max_loras, n, dtype=torch.int32,
                                   device=self.device)
        self._xscales = torch.zeros(self.num_layers, len(EXPERT_MODULES), self.max_loras, n, dtype=torch.float32,
                                    device=self.device)
        routers = self.num_layers if stacked is not None else 0
        self._rranks = torch.zeros(routers, self.max_loras, dtype=torch.int32, device=self.device)
        self._rscales = torch.zeros(routers, self.max_loras, dtype=torch.float32, device=self.device)
        self.expert_targets: list[dict[tuple[int, str], int]] = [{} for _ in range(self.max_loras)]  # -> rank written
        self._expert_holders: list[set[int]] = [set() for _ in range(self.num_layers)]  # slots with layer's experts
        # per (layer, module): (A [S*E, R, in], B [S*E, out, R], ranks [S*E], scales [S*E]), the per-row gather's
        self.expert_stacks: list[dict[str, tuple]] = [{} for _ in range(self.num_layers)]
        if stacked is None:
            return
        for layer in stacked.layers:
            for i, (m, (in_f, out_f)) in enumerate(stacked.shapes().items()):
                a = torch.zeros(self.max_loras, n, rank, in_f, dtype=self.dtype, device=self.device)
                b = self._b_stack(out_f, n, rank=rank)
                self.xa[layer][m], self.xb[layer][m] = a, b
                self.expert_stacks[layer][m] = (a.flatten(0, 1), b.flatten(0, 1), self._xranks[layer, i].view(-1),
                                                self._xscales[layer, i].view(-1))
            a = torch.zeros(self.max_loras, 1, rank, stacked.hidden, dtype=self.dtype, device=self.device)
            b = self._b_stack(n, 1, rank=rank)
            self.xa[layer][ROUTER], self.xb[layer][ROUTER] = a, b
            self.expert_stacks[layer][ROUTER] = (a.flatten(0, 1), b.flatten(0, 1), self._rranks[layer],
                                                 self._rscales[layer])

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write an adapter into a slot, replacing (and zeroing) whatever the slot held.

        On a GPU the weights cross to the device as one transfer, ranks and scales as one each.
        """
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > slot max_rank {self.max_rank}")
        for (layer, module), (a, b, _scale) in adapter.weights.items():
            if not 0 <= layer < self.num_layers or module not in self.a[layer]:
                raise ValueError(f"adapter {adapter.name!r} targets ({layer}, {module}) outside the slots")
            in_f, out_f = self.shapes[module]
            r = a.shape[0]
            if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
                raise ValueError(
                    f"adapter {adapter.name!r} layer {layer} {module}: A {list(a.shape)} / B {list(b.shape)} "
                    f"do not fit [r, {in_f}] / [{out_f}, r]"
                )
        self._check_experts(adapter)
        dora = adapter.dora_scales(self.weight_of) if adapter.magnitudes else {}
        held = self.vocab.prepare(adapter)  # its base copies checked before the slot is touched
        self.clear(slot)
        if dora:
            self._write_dora(slot, dora)
        ranks = torch.zeros(self.num_layers, len(MODULES), dtype=torch.int32)
        scales = torch.zeros(self.num_layers, len(MODULES), dtype=torch.float32)
        moved = self._on_device([t for a, b, _ in adapter.weights.values() for t in (a, b)]
                                + [t for groups in adapter.experts.values() for g in groups for t in (g.a, g.b)])
        pairs = list(zip(moved[0::2], moved[1::2]))
        if adapter.experts:
            self._write_experts(slot, adapter, pairs[len(adapter.weights):])
        for ((layer, module), (_a, _b, scale)), (a, b) in zip(adapter.weights.items(), pairs):
            r = a.shape[0]
            if r:  # recorded before the copy: clear() zeroes exactly what was written
                self.targets[slot][(layer, module)] = (r, float(scale))
            self.a[layer][module][slot, :r].copy_(a)
            self.b[layer][module][slot, :, :r].copy_(b)
            ranks[layer, MODULES.index(module)] = r
            scales[layer, MODULES.index(module)] = scale
        self.slot_ranks[slot] = max((r for r, _scale in self.targets[slot].values()), default=0)
        self._ranks[:, :, slot].copy_(ranks, non_blocking=True)  # staged at once: the host never waits
        self._scales[:, :, slot].copy_(scales, non_blocking=True)
        self.vocab.load(slot, held)

    def weight_of(self, layer: int, module: str) -> torch.Tensor:
        """The base projection's weight [out, in] (DoRA's norms)."""
        if self.base_weight is None:
            raise ValueError("DoRA adapters need the base model's weights (LoraSlots.base_weight is not set)")
        return self.base_weight(layer, module)[0]

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        """The base projection's bias (DoRA scales the output without it)."""
        return None if self.base_weight is None else self.base_weight(layer, module)[1]

    def _write_dora(self, slot: int, dora: dict) -> None:
        if self.out_scales is None:
            self.out_scales = [{m: torch.ones(self.max_loras + 1, o, dtype=torch.float32, device=self.device)
                                for m, (_i, o) in self.shapes.items()} for _ in range(self.num_layers)]
        for (layer, module), s in dora.items():
            self.out_scales[layer][module][slot].copy_(s)
        self.dora_slots.add(slot)

    def _check_experts(self, adapter: LoraAdapter) -> None:
        """ValueError unless the adapter's expert pairs fit the expert stacks."""
        for (layer, module), groups in adapter.experts.items():
            if not (0 <= layer < self.num_layers and module in self.xa[layer]):
                raise ValueError(f"adapter {adapter.name!r} adapts the experts of layer {layer} ({module}), which "
                                 f"the slots hold no expert stacks for (max_expert_rank {self.max_expert_rank})")
            num, in_f, out_f = self.xa[layer][module].shape[1], self.xa[layer][module].shape[3], \
                self.xb[layer][module].shape[2]
            seen: set[int] = set()
            for g in groups:
                n, r = len(g.experts), g.rank
                if (tuple(g.a.shape) != (n, r, in_f) or tuple(g.b.shape) != (n, out_f, r) or r > self.max_expert_rank
                        or not all(0 <= e < num and e not in seen for e in g.experts)):
                    raise ValueError(f"adapter {adapter.name!r} layer {layer} experts' {module}: A {list(g.a.shape)} "
                                     f"/ B {list(g.b.shape)} of experts {list(g.experts)} do not fit [n, r, {in_f}] / "
                                     f"[n, {out_f}, r], r <= max_expert_rank {self.max_expert_rank}, distinct experts < {num}")
                seen.update(g.experts)

    def _write_experts(self, slot: int, adapter: LoraAdapter, pairs) -> None:
        """The adapter's expert pairs (on the device) into the slot's expert stacks, with their ranks and scales."""
        ranks = torch.zeros(self.num_layers, len(EXPERT_MODULES), self._xranks.shape[3], dtype=torch.int32)
        scales = torch.zeros(ranks.shape, dtype=torch.float32)
        router_ranks = torch.zeros(self.num_layers, dtype=torch.int32)
        router_scales = torch.zeros(self.num_layers, dtype=torch.float32)
        groups = [(key, g) for key, gs in adapter.experts.items() for g in gs]
        for ((layer, module), g), (a, b) in zip(groups, pairs):
            r = g.rank
            # recorded before the copy: clear() zeroes what was written
            self.expert_targets[slot][(layer, module)] = max(r, self.expert_targets[slot].get((layer, module), 0))
            self._expert_holders[layer].add(slot)
            rows = torch.tensor(g.experts, dtype=torch.long, device=self.device)
            self.xa[layer][module][slot, :, :r].index_copy_(0, rows, a)
            self.xb[layer][module][slot, :, :, :r].index_copy_(0, rows, b)
            if module == ROUTER:
                router_ranks[layer], router_scales[layer] = r, g.scale
            else:
                ranks[layer, EXPERT_MODULES.index(module), list(g.experts)] = r
                scales[layer, EXPERT_MODULES.index(module), list(g.experts)] = g.scale
        self._xranks[:, :, slot].copy_(ranks, non_blocking=True)
        self._xscales[:, :, slot].copy_(scales, non_blocking=True)
        self._rranks[:, slot].copy_(router_ranks, non_blocking=True)
        self._rscales[:, slot].copy_(router_scales, non_blocking=True)

    def expert_rank(self, layer: int, module: str) -> int:
        """The largest rank any slot holds for layer's experts' module (read on the host)."""
        return max((t.get((layer, module), 0) for t in self.expert_targets), default=0)

    def holds_experts(self, layer: int) -> bool:
        """Whether a slot holds LoRA on layer's experts (read on the host)."""
        return bool(self._expert_holders[layer])

    def _on_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """tensors on the slots' device: on CUDA through one packed host-to-device copy."""
        if self.device.type != "cuda" or not tensors:
            return tensors
        flat = torch.cat([t.reshape(-1).to(self.dtype) for t in tensors])
        flat = flat.pin_memory().to(self.device, non_blocking=True)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out

    def clear(self, slot: int) -> None:
        """Zero a slot's weights, ranks and scales (the base model for tokens that still point at it).

        Only the rows its adapter wrote (its targets' ranks): the rest of every stack stays zero, so a
        slot change costs the adapter's size, not max_lora_rank x 7 modules x layers."""
        self._check_slot(slot)
        for (layer, m), (r, _scale) in self.targets[slot].items():
            self.a[layer][m][slot, :r].zero_()
            self.b[layer][m][slot, :, :r].zero_()
        self._ranks[:, :, slot] = 0
        self._scales[:, :, slot] = 0.0
        for (layer, m), r in self.expert_targets[slot].items():
            self.xa[layer][m][slot, :, :r].zero_()
            self.xb[layer][m][slot, :, :, :r].zero_()
            self._expert_holders[layer].discard(slot)
        if self.expert_targets[slot]:
            self._xranks[:, :, slot] = 0
            self._xscales[:, :, slot] = 0.0
            self._rranks[:, slot] = 0
            self._rscales[:, slot] = 0.0
        self.expert_targets[slot] = {}
        if slot in self.dora_slots:
            for layer in self.out_scales:
                for t in layer.values():
                    t[slot].fill_(1.0)
            self.dora_slots.discard(slot)
        self.targets[slot] = {}
        self.slot_ranks[slot] = 0
        self.vocab.clear(slot)

    def memory_bytes(self) -> int:
        """Device bytes held by all stacks, ranks and scales."""
        weights = sum(t.nbytes for table in (self.a, self.b, self.xa, self.xb) for layer in table for t in layer.values())
        dora = sum(t.nbytes for layer in self.out_scales or () for t in layer.values())
        weights += self.vocab.memory_bytes()
        ranks = sum(t.nbytes for t in (self._ranks, self._scales, self._xranks, self._xscales, self._rranks,
                                       self._rscales))
        return weights + ranks + dora

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot!r} out of range 0..{self.max_loras - 1}")
