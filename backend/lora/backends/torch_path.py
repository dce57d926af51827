"""LoRA on the CPU's torch path (fp32): dense runs for long runs of one adapter, slot tiles for the rest."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.lora.backends.base import LoraBackend, LoraPlan, bgmv, segments
from loraplex.lora.backends.tiles import SlotTiles

# A run of at least this many rows on one adapter (a prefill chunk) adds its LoRA by two dense matmuls;
# shorter runs (decode rows of many adapters) go into slot tiles.
DENSE_LORA_MIN_ROWS = 8
# Routed expert rows up to this many gather their (slot, expert) pairs row by row (a decode step's); more go into
# the kernels' reference tiles of one (slot, expert) each, which read every pair once.
GATHER_EXPERT_ROWS = 32


class TorchPlan(LoraPlan):
    """dense_runs: (first row, end row, slot) of each run added by two dense matmuls (peft's own sum); tiles:
    the other rows in slot tiles, or token_slots (int32 [T], -1: none) for them when tiles would waste too much."""

    __slots__ = ("dense_runs", "tiles", "token_slots")

    def __init__(self, backend: LoraBackend, dense_runs: list[tuple[int, int, int]], tiles: SlotTiles | None = None,
                 token_slots: torch.Tensor | None = None):
        super().__init__(backend)
        self.dense_runs, self.tiles, self.token_slots = dense_runs, tiles, token_slots


class TorchLoraBackend(LoraBackend):
    """The torch path: the same sums as peft where one adapter covers many rows, batched matmuls per slot for
    rows spread over many adapters, and the per-row gather for what tiles would waste."""

    def plan(self, seq_slots: np.ndarray, cu: np.ndarray, is_decode: bool, rows_form: bool = False) -> TorchPlan:
        """The step's plan (_plan), with DoRA's per-row scales when a DoRA slot is in the step."""
        return self.keep_rows(self.with_dora(self._plan(seq_slots, cu, is_decode), seq_slots, cu), seq_slots, cu)

    def _plan(self, seq_slots: np.ndarray, cu: np.ndarray, is_decode: bool) -> TorchPlan:
        """A decode step is one dense run when every row has one adapter, else all tiles (the common case,
        kept cheap); with prefill, runs of DENSE_LORA_MIN_ROWS rows or more (or a lone segment) are dense."""
        if is_decode:
            if seq_slots[0] >= 0 and (seq_slots == seq_slots[0]).all():
                return TorchPlan(self, [(0, len(seq_slots), int(seq_slots[0]))])
            runs, row_slots = [], seq_slots
        else:
            seg_starts, seg_slots = segments(seq_slots, cu)
            lengths = np.diff(seg_starts)
            dense = (seg_slots >= 0) & ((lengths >= DENSE_LORA_MIN_ROWS) | (len(seg_slots) == 1))
            runs = [(int(seg_starts[g]), int(seg_starts[g + 1]), int(seg_slots[g])) for g in np.flatnonzero(dense)]
            if not ((seg_slots >= 0) & ~dense).any():
                return TorchPlan(self, runs)
            row_slots = np.repeat(np.where(dense, -1, seg_slots), lengths)  # -1: base or dense
        rows = np.flatnonzero(row_slots >= 0)
        tiles = SlotTiles.plan(rows, row_slots[rows], self.slots.slot_ranks, self.to_tensor)
        if tiles is None:  # the rows left go through the per-row gather (BGMV)
            return TorchPlan(self, runs, token_slots=self.to_tensor(row_slots))
        return TorchPlan(self, runs, tiles)

    def apply_experts(self, plan: LoraPlan, ys, x: torch.Tensor, layer: int, modules: tuple[str, ...],
                      pair_slots: torch.Tensor) -> None:
        """Few routed rows: each row's pair gathered at the largest rank resident (two bmms and an index_add_
        per module); more rows: the per-row gather of LoraBackend (tiles of one slot and expert)."""
        if x.shape[0] > GATHER_EXPERT_ROWS:
            super().apply_experts(plan, ys, x, layer, modules, pair_slots)
            return
        rows = (pair_slots >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        pairs, xr = pair_slots.index_select(0, rows).long(), x.index_select(0, rows).unsqueeze(1)  # [n, 1, in]
        for y, module in zip(ys, modules):
            rank = self.slots.expert_rank(layer, module)
            if rank == 0:
                continue
            a, b, _ranks, scales = self.slots.expert_stacks[layer][module]
            a_rows = a[:, :rank].index_select(0, pairs).to(x.dtype)  # [n, rank, in]
            b_rows = b.transpose(1, 2)[:, :rank].index_select(0, pairs).to(x.dtype)  # [n, rank, out]
            v = torch.bmm(xr, a_rows.transpose(1, 2)).mul_(scales.index_select(0, pairs).view(-1, 1, 1))
            y.index_add_(0, rows, torch.bmm(v, b_rows).squeeze(1))

    def apply(self, plan: TorchPlan, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        s = self.slots
        a, b = s.a[layer][module], s.b[layer][module]
        for start, end, slot in plan.dense_runs:  # peft's own sum per run of rows, scale * B(A(x))
            target = s.targets[slot].get((layer, module))
            if target is not None:
                rank, scale = target
                rows = slice(start, end)
                a_r, b_r = a[slot, :rank].to(x.dtype), b[slot, :, :rank].to(x.dtype)  # fp16 stacks: lora_dtype
                y[rows].add_(F.linear(F.linear(x[rows], a_r), b_r), alpha=scale)
        if plan.tiles is not None:
            plan.tiles.add(y, x, s.a_t[layer][module], s.b_t[layer][module], s.tile_scales[layer][module])
        elif plan.token_slots is not None:
            bgmv(y, x, s, plan.token_slots, layer, module)
