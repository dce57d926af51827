"""Device-resident LoRA stacks: a fixed number of adapter slots the model reads every step.

Layout per layer and projection (see backend/kernels/reference.py):
  a[layer][module]      [max_loras, max_rank, in_features]   zero-padded past each rank
  b[layer][module]      [max_loras, out_features, max_rank]  zero-padded past each rank (on the CPU a
                        view of [max_loras, max_rank, out_features] stored contiguous: see _b_stack)
  ranks[layer][module]  int32 [max_loras]   0 where the slot's adapter does not target it
  scales[layer][module] float32 [max_loras]
  out_scales[layer][module] float32 [max_loras + 1, out]  DoRA's per-output scale (1.0: plain LoRA, empty
                        slots and the last row, which base rows -1 read); allocated at the first DoRA load

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
from loraplex.lora.shapes import MODULES


class LoraSlots:
    """Fixed-size stacks of LoRA A/B weights, ranks and scales, one row per adapter slot."""

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, int]], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device) -> None:
        if max_loras <= 0 or max_rank <= 0 or num_layers <= 0:
            raise ValueError("num_layers, max_loras and max_rank must be positive")
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
        for _ in range(num_layers):
            self.a.append({m: torch.zeros(max_loras, max_rank, i, dtype=dtype, device=self.device)
                           for m, (i, _o) in self.shapes.items()})
            self.b.append({m: self._b_stack(o) for m, (_i, o) in self.shapes.items()})
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

    def _b_stack(self, out_features: int) -> torch.Tensor:
        """A zeroed B stack [max_loras, out, max_rank]. On the CPU it is a view of B.T stored contiguous
        ([max_loras, max_rank, out]), the layout the torch path's batched matmuls read fastest at a few
        rows an adapter (decision 020); the CUDA kernels read [max_loras, out, max_rank] contiguous."""
        if self.device.type == "cpu":
            stored = torch.zeros(self.max_loras, self.max_rank, out_features, dtype=self.dtype, device=self.device)
            return stored.transpose(1, 2)
        return torch.zeros(self.max_loras, out_features, self.max_rank, dtype=self.dtype, device=self.device)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write an adapter into a slot, replacing (and zeroing) whatever the slot held.

        On a GPU the weights cross to the device as one transfer, ranks and scales as one each.
        """
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > slot max_rank {self.max_rank}")
        for (layer, module), (a, b, _scale) in adapter.weights.items():
            if not 0 <= layer < self.num_layers or module not in self.shapes:
                raise ValueError(f"adapter {adapter.name!r} targets ({layer}, {module}) outside the slots")
            in_f, out_f = self.shapes[module]
            r = a.shape[0]
            if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
                raise ValueError(
                    f"adapter {adapter.name!r} layer {layer} {module}: A {list(a.shape)} / B {list(b.shape)} "
                    f"do not fit [r, {in_f}] / [{out_f}, r]"
                )
        dora = adapter.dora_scales(self.weight_of) if adapter.magnitudes else {}
        held = self.vocab.prepare(adapter)  # its base copies checked before the slot is touched
        self.clear(slot)
        if dora:
            self._write_dora(slot, dora)
        ranks = torch.zeros(self.num_layers, len(MODULES), dtype=torch.int32)
        scales = torch.zeros(self.num_layers, len(MODULES), dtype=torch.float32)
        for ((layer, module), (_a, _b, scale)), (a, b) in zip(adapter.weights.items(), self._on_device(adapter)):
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

    def _on_device(self, adapter: LoraAdapter):
        """The adapter's (A, B) pairs on the slots' device: on CUDA through one packed host-to-device copy."""
        pairs = [(a, b) for a, b, _ in adapter.weights.values()]
        if self.device.type != "cuda" or not pairs:
            return pairs
        flat = torch.cat([t.reshape(-1).to(self.dtype) for pair in pairs for t in pair])
        flat = flat.pin_memory().to(self.device, non_blocking=True)
        out, offset = [], 0
        for a, b in pairs:
            a_dev = flat[offset:offset + a.numel()].view(a.shape)
            offset += a.numel()
            out.append((a_dev, flat[offset:offset + b.numel()].view(b.shape)))
            offset += b.numel()
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
        weights = sum(t.nbytes for table in (self.a, self.b) for layer in table for t in layer.values())
        dora = sum(t.nbytes for layer in self.out_scales or () for t in layer.values())
        weights += self.vocab.memory_bytes()
        return weights + self._ranks.nbytes + self._scales.nbytes + dora

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot!r} out of range 0..{self.max_loras - 1}")
