"""Device-resident LoRA stacks: a fixed number of adapter slots the model reads every step.

Layout per layer and projection (see kernels/reference.py):
  a[layer][module]      [max_loras, max_rank, in_features]   zero-padded past each rank
  b[layer][module]      [max_loras, out_features, max_rank]  zero-padded past each rank
  ranks[layer][module]  int32 [max_loras]   0 where the slot's adapter does not target it
  scales[layer][module] float32 [max_loras]

Stacks exist for all seven projections whether or not any adapter targets them, so the
model never branches on shape. Memory: num_layers * max_loras * max_rank *
sum over the seven projections of (in + out) * element size. LLaMA-2-7B (32 layers,
hidden 4096, intermediate 11008: the sum is 4 * 8192 + 3 * 15104 = 78080) with 8 slots of
rank 16 in fp16 needs 32 * 8 * 16 * 78080 * 2 bytes = about 610 MiB.
"""

from __future__ import annotations

import torch

from .adapter import LoraAdapter
from .shapes import MODULES


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
        self.ranks: list[dict[str, torch.Tensor]] = []
        self.scales: list[dict[str, torch.Tensor]] = []
        for _ in range(num_layers):
            self.a.append({m: torch.zeros(max_loras, max_rank, i, dtype=dtype, device=self.device)
                           for m, (i, _o) in self.shapes.items()})
            self.b.append({m: torch.zeros(max_loras, o, max_rank, dtype=dtype, device=self.device)
                           for m, (_i, o) in self.shapes.items()})
            self.ranks.append({m: torch.zeros(max_loras, dtype=torch.int32, device=self.device)
                               for m in MODULES})
            self.scales.append({m: torch.zeros(max_loras, dtype=torch.float32, device=self.device)
                                for m in MODULES})

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write an adapter into a slot, replacing (and zeroing) whatever the slot held."""
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
        self.clear(slot)
        for (layer, module), (a, b, scale) in adapter.weights.items():
            r = a.shape[0]
            self.a[layer][module][slot, :r].copy_(a)
            self.b[layer][module][slot, :, :r].copy_(b)
            self.ranks[layer][module][slot] = r
            self.scales[layer][module][slot] = scale

    def clear(self, slot: int) -> None:
        """Zero a slot's weights, ranks and scales (the base model for tokens that still point at it)."""
        self._check_slot(slot)
        for layer in range(self.num_layers):
            for m in MODULES:
                self.a[layer][m][slot].zero_()
                self.b[layer][m][slot].zero_()
                self.ranks[layer][m][slot] = 0
                self.scales[layer][m][slot] = 0.0

    def memory_bytes(self) -> int:
        """Device bytes held by all stacks, ranks and scales."""
        total = 0
        for layer in range(self.num_layers):
            for table in (self.a, self.b, self.ranks, self.scales):
                total += sum(t.nbytes for t in table[layer].values())
        return total

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot!r} out of range 0..{self.max_loras - 1}")
