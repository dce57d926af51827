"""The LoRA compute seam: a backend plans a step's adapter rows once, then adds each projection's deltas.

The runner calls ``plan`` once a step, from each sequence's adapter slot and the step's row
layout; the model calls ``apply`` (through the plan) for every projection it computes. How the
deltas are computed (dense runs, slot tiles, BGMV/SGMV kernels, the native decode call) is the
backend's alone: a new kernel variant, or a per-output scale such as DoRA's, touches one backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

from loraplex import kernels


class LoraPlan:
    """One step's adapter rows, in the form its backend computes them."""

    __slots__ = ("backend", "dora_rows", "seq", "_rows")
    one_call = False  # the model's one-call decode forward adds these deltas itself (RowSlots of a native backend)

    def __init__(self, backend: LoraBackend):
        self.backend = backend
        self.dora_rows = None  # int64 [T]: each row's out_scales row when a DoRA slot is resident (decision 052)
        self.seq = None  # (seq_slots, cu) the plan was made from (host arrays), for row_slots
        self._rows = None

    def row_slots(self) -> torch.Tensor:
        """int32 [T]: each row's adapter slot (-1: the base model), on the model's device; made once a plan."""
        if self._rows is None:
            if self.seq is None:
                raise ValueError("this LoRA plan was made without its sequences' slots (LoraBackend.keep_rows)")
            seq_slots, cu = self.seq
            self._rows = self.backend.to_tensor(np.repeat(seq_slots, np.diff(cu)).astype(np.int32))
        return self._rows

    def apply_experts(self, ys, x: torch.Tensor, layer: int, modules: tuple[str, ...], pair_slots: torch.Tensor) -> None:
        """ys[i] += each routed (token, expert) row's delta for the experts' modules[i] of layer, in place: x [P, in]
        the rows' input, pair_slots int32 [P] slot * num_experts + expert of each row (-1: no adapter). Decision 066."""
        self.backend.apply_experts(self, ys, x, layer, modules, pair_slots)

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """y += each row's adapter delta for module of layer, in place (x: the projection's input)."""
        self.backend.apply(self, y, x, layer, module)
        if self.dora_rows is not None:
            self.backend.scale_dora(y, self.dora_rows, layer, module)

    def apply_group(self, ys, x: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """ys[i] += each row's delta for modules[i] of layer, in place: the modules that read one input x
        (q/k/v, gate/up), which a backend may compute together (decision 057)."""
        self.backend.apply_group(self, ys, x, layer, modules)
        if self.dora_rows is not None:
            for y, module in zip(ys, modules):
                self.backend.scale_dora(y, self.dora_rows, layer, module)


class RowSlots(LoraPlan):
    """One adapter slot per row (int32 [T], -1: the base model)."""

    __slots__ = ("token_slots",)

    def __init__(self, backend: LoraBackend, token_slots: torch.Tensor):
        super().__init__(backend)
        self.token_slots = token_slots
        self._rows = token_slots
        if backend.slots.dora_slots:
            self.dora_rows = backend.dora_index(token_slots)


class LoraBackend(ABC):
    """Computes the deltas of the adapters in one LoraSlots' stacks."""

    one_call = False  # whether its decode plans are added inside the model's one-call decode forward

    def __init__(self, slots, to_tensor: Callable[[np.ndarray], torch.Tensor]):
        self.slots = slots  # LoraSlots
        self.to_tensor = to_tensor  # a host array as a tensor on the model's device

    @abstractmethod
    def plan(self, seq_slots: np.ndarray, cu: np.ndarray, is_decode: bool, rows_form: bool = False) -> LoraPlan:
        """The step's plan: seq_slots (int32 [B], -1: base) is each sequence's slot, cu (int [B+1]) its rows;
        is_decode: one row per sequence; rows_form: a step with prefill that runs in the decode form."""

    @abstractmethod
    def apply(self, plan: LoraPlan, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """y += each row's adapter delta for module of layer, as plan lays the rows out."""

    def apply_group(self, plan: LoraPlan, ys, x: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """ys[i] += the deltas of modules[i], all reading x: by default one apply per module."""
        for y, module in zip(ys, modules):
            self.apply(plan, y, x, layer, module)

    def apply_experts(self, plan: LoraPlan, ys, x: torch.Tensor, layer: int, modules: tuple[str, ...],
                      pair_slots: torch.Tensor) -> None:
        """ys[i] += the experts' modules[i] deltas of routed rows (LoraPlan.apply_experts): a per-row gather over the
        slots' expert stacks, slot * num_experts + expert being one stack (decision 066)."""
        stacks = self.slots.expert_stacks[layer]
        for y, module in zip(ys, modules):
            a, b, ranks, scales = stacks[module]
            v = kernels.lora_shrink_bgmv(x, a, pair_slots, ranks)
            kernels.lora_expand_bgmv(y, v, b, pair_slots, ranks, scales)

    def keep_rows(self, plan: LoraPlan, seq_slots: np.ndarray, cu: np.ndarray) -> LoraPlan:
        """plan, knowing the sequences' slots and rows it was made from (LoraPlan.row_slots)."""
        plan.seq = (seq_slots, cu)
        return plan

    def with_dora(self, plan: LoraPlan, seq_slots: np.ndarray, cu: np.ndarray) -> LoraPlan:
        """plan, with each row's DoRA scale row when a step's rows include a DoRA slot (else unchanged)."""
        dora = self.slots.dora_slots
        if plan.dora_rows is None and dora and any(int(s) in dora for s in np.unique(seq_slots)):
            plan.dora_rows = self.dora_index(self.to_tensor(np.repeat(seq_slots, np.diff(cu)).astype(np.int32)))
        return plan

    def dora_index(self, row_slots: torch.Tensor) -> torch.Tensor:
        """Rows of out_scales for slots per row (-1, the base model, reads the last row: all ones)."""
        return torch.where(row_slots < 0, self.slots.max_loras, row_slots).long()

    def scale_dora(self, y: torch.Tensor, rows: torch.Tensor, layer: int, module: str) -> None:
        """y = s[row] * (y - bias) + bias in place: DoRA's per-output scale of base plus delta, bias unscaled;
        rows of plain LoRA and base rows read ones."""
        s = self.slots.out_scales[layer][module].index_select(0, rows).to(y.dtype)
        bias = self.slots.bias(layer, module)
        if bias is None:
            y.mul_(s)
        else:
            y.sub_(bias).mul_(s).add_(bias)

    def rows(self, token_slots: torch.Tensor) -> RowSlots:
        """A plan of one slot per row, given as a tensor already on the device (the decode graphs' buffer)."""
        return RowSlots(self, token_slots)


def segments(slots: np.ndarray, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row segments of one adapter (int32 starts [G+1], slots [G]): neighbouring sequences that share one merge."""
    change = np.flatnonzero(slots[1:] != slots[:-1]) + 1
    seg_starts = np.concatenate(([0], cu[change], cu[-1:])).astype(np.int32)
    return seg_starts, slots[np.concatenate(([0], change))]


def bgmv(y: torch.Tensor, x: torch.Tensor, slots, token_slots: torch.Tensor, layer: int, module: str) -> None:
    """y += each row's delta by the per-row gather kernels (CUDA, the shim, or the reference on the CPU)."""
    a, b = slots.a[layer][module], slots.b[layer][module]
    ranks, scales = slots.ranks[layer][module], slots.scales[layer][module]
    v = kernels.lora_shrink_bgmv(x, a, token_slots, ranks)
    kernels.lora_expand_bgmv(y, v, b, token_slots, ranks, scales)
