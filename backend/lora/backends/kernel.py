"""LoRA by the BGMV/SGMV kernels: per-row slots for decode, adapter segments for prefill (CUDA, or the shim)."""

from __future__ import annotations

import numpy as np
import torch

from loraplex import kernels
from loraplex.lora.backends.base import LoraBackend, LoraPlan, RowSlots, bgmv, segments


class Segments(LoraPlan):
    """Rows in segments of one adapter each: starts int32 [G+1], slots int32 [G]."""

    __slots__ = ("seg_starts", "seg_slots")

    def __init__(self, backend: LoraBackend, seg_starts: torch.Tensor, seg_slots: torch.Tensor):
        super().__init__(backend)
        self.seg_starts, self.seg_slots = seg_starts, seg_slots


class KernelLoraBackend(LoraBackend):
    """Punica's two forms: a decode step gathers each row's adapter (BGMV), a step with prefill runs one
    adapter per segment of rows (SGMV); shrink to the rank, then expand and add in place."""

    def plan(self, seq_slots: np.ndarray, cu: np.ndarray, is_decode: bool, rows_form: bool = False) -> LoraPlan:
        if is_decode:
            return RowSlots(self, self.to_tensor(seq_slots))
        seg_starts, seg_slots = segments(seq_slots, cu)
        plan = Segments(self, self.to_tensor(seg_starts), self.to_tensor(seg_slots))
        plan = self.keep_rows(plan, seq_slots, cu)
        return self.with_dora(plan, seq_slots, cu)  # DoRA: an elementwise per-row scale after expand

    fuse_groups = True  # a decode step's q/k/v and gate/up in one shrink and one expand launch each

    def apply_group(self, plan: LoraPlan, ys, x: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """Per-row plans: the group's shrinks in one launch and its expands in another (decision 057); other
        plans, one apply per module."""
        if not (self.fuse_groups and isinstance(plan, RowSlots)):
            super().apply_group(plan, ys, x, layer, modules)
            return
        s = self.slots
        a, b = [s.a[layer][m] for m in modules], [s.b[layer][m] for m in modules]
        ranks, scales = [s.ranks[layer][m] for m in modules], [s.scales[layer][m] for m in modules]
        v = kernels.lora_shrink_bgmv_group(x, a, plan.token_slots, ranks)
        kernels.lora_expand_bgmv_group(v, list(ys), b, plan.token_slots, ranks, scales)

    def apply(self, plan: LoraPlan, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        s = self.slots
        if isinstance(plan, RowSlots):
            bgmv(y, x, s, plan.token_slots, layer, module)
            return
        a, b = s.a[layer][module], s.b[layer][module]
        ranks, scales = s.ranks[layer][module], s.scales[layer][module]
        v = kernels.lora_shrink_sgmv(x, a, plan.seg_starts, plan.seg_slots, ranks)
        kernels.lora_expand_sgmv(y, v, b, plan.seg_starts, plan.seg_slots, ranks, scales)
