"""LoRA on the CPU's native path: decode rows inside the model's one-call decode forward, prefill as the torch path."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels import cpu_native
from loraplex.lora.backends.base import LoraPlan, RowSlots
from loraplex.lora.backends.torch_path import TorchLoraBackend


class NativeRows(RowSlots):
    """Per-row slots that the model's one-call decode forward adds itself (lp_decode_forward)."""

    __slots__ = ()
    one_call = True


class NativeRowsEach(NativeRows):
    """Per-row slots with a DoRA slot among them: the model takes the per-projection path (lp_decode_forward
    has no per-output scale), each projection's deltas added by cpu_native.lora_add, then scaled."""

    __slots__ = ()
    one_call = False


class NativeLoraBackend(TorchLoraBackend):
    """For stacks the native decode forward serves (cpu_native.DecodeForward.serves_lora): a decode step, or a
    step in the decode form, is one slot per row added inside that call (or by cpu_native.lora_add, projection
    by projection); other steps with prefill take the torch path's dense runs and tiles."""

    one_call = True

    def plan(self, seq_slots: np.ndarray, cu: np.ndarray, is_decode: bool, rows_form: bool = False) -> LoraPlan:
        if is_decode or rows_form:
            return self.rows(self.to_tensor(seq_slots if is_decode else np.repeat(seq_slots, np.diff(cu))))
        return super().plan(seq_slots, cu, is_decode)

    def rows(self, token_slots: torch.Tensor) -> NativeRows:
        plan = NativeRows(self, token_slots)
        if plan.dora_rows is not None and bool((plan.dora_rows < self.slots.max_loras).any()):
            return NativeRowsEach(self, token_slots)
        plan.dora_rows = None  # no DoRA slot in these rows: the one call serves them
        return plan

    def apply(self, plan: LoraPlan, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        if not isinstance(plan, NativeRows):
            super().apply(plan, y, x, layer, module)
            return
        s = self.slots
        cpu_native.lora_add(y, x, plan.token_slots, s.a[layer][module], s.b_t[layer][module],
                            s.ranks[layer][module], s.scales[layer][module])
