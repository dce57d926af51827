"""The canonical in-memory forms of a quantized linear weight W [N, K] (README.md: the kernels' contract), their
dequantization to fp32, and their concatenation / split along the outputs (fused projections)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """W = qweight * scale[:, None]: qweight int8 [N, K], scale fp32 [N] (symmetric, per output channel)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    method = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def to(self, device) -> "Int8Weight":
        return Int8Weight(self.qweight.to(device), self.scale.to(device))

    def rows(self, start: int, stop: int) -> "Int8Weight":
        return Int8Weight(self.qweight[start:stop].contiguous(), self.scale[start:stop].contiguous())


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """W = float(weight) * scale: weight float8_e4m3fn [N, K]; scale fp32 [1] (per tensor), [N] (per channel), or
    [ceil(N / bn), ceil(K / bk)] with block (bn, bk)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    method = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to(self, device) -> "Fp8Weight":
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device))

    def per_channel(self) -> "Fp8Weight":
        """A per-tensor scale as the per-channel scale it equals (block and per-channel ones unchanged)."""
        if self.block is None and self.scale.numel() == 1:
            return replace(self, scale=self.scale.reshape(1).expand(self.shape[0]).contiguous())
        return self

    def rows(self, start: int, stop: int) -> "Fp8Weight":
        w = self.per_channel()
        if w.block is None:
            return Fp8Weight(w.weight[start:stop].contiguous(), w.scale[start:stop].contiguous())
        bn = w.block[0]
        if start % bn or (stop % bn and stop != w.shape[0]):
            raise ValueError(f"fp8 block scales [{bn}, {w.block[1]}] cannot split rows {start}:{stop}")
        return Fp8Weight(w.weight[start:stop].contiguous(), w.scale[start // bn:-(-stop // bn)].contiguous(), w.block)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]: qweight uint8 [N, K / 2] (even k in the low
    nibble), scales fp16 [N, K / G], zeros uint8 [N, K / G] (0..15). perm (int64 [K] or None): act-order, the
    canonical input j is the checkpoint's input perm[j] (y = x[:, perm] @ W.T)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    method = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], 2 * self.qweight.shape[1]

    def to(self, device) -> "Int4Weight":
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       zeros=self.zeros.to(device), perm=None if self.perm is None else self.perm.to(device))

    def rows(self, start: int, stop: int) -> "Int4Weight":
        return replace(self, qweight=self.qweight[start:stop].contiguous(), scales=self.scales[start:stop].contiguous(),
                       zeros=self.zeros[start:stop].contiguous())


QuantWeight = Int8Weight | Fp8Weight | Int4Weight
FORMS = (Int8Weight, Fp8Weight, Int4Weight)


def is_quantized(weight) -> bool:
    """Whether weight is one of the canonical forms (not a plain tensor)."""
    return isinstance(weight, FORMS)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> the values 0..15 as uint8 [N, K] (even k from the low nibble)."""
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [N, K] (K even) -> uint8 [N, K / 2], even k in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N / bn), ceil(K / bk)] -> one scale per weight [N, K]."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def dequantize(w) -> torch.Tensor:
    """W [N, K] in fp32 (a plain tensor: as fp32). For an act-order Int4Weight, in the checkpoint's input order
    (the weight y = x @ W.T multiplies)."""
    if isinstance(w, torch.Tensor):
        return w.float()
    if isinstance(w, Int8Weight):
        return w.qweight.float() * w.scale.float()[:, None]
    if isinstance(w, Fp8Weight):
        values = w.weight.float()
        if w.block is not None:
            return values * _expand_blocks(w.scale.float(), w.block, w.shape)
        scale = w.scale.float().reshape(-1)
        return values * (scale if scale.numel() == 1 else scale[:, None])
    if isinstance(w, Int4Weight):
        n, k = w.shape
        q = unpack_int4(w.qweight).float().view(n, k // w.group_size, w.group_size)
        values = ((q - w.zeros.float()[..., None]) * w.scales.float()[..., None]).reshape(n, k)
        if w.perm is None:
            return values
        out = torch.empty_like(values)
        out[:, w.perm] = values  # canonical column j is input perm[j]
        return out
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def can_cat(parts: list) -> bool:
    """Whether the forms concatenate along N into one form (fused projections): one type; fp8 with equal blocks,
    each part's N a multiple of the block's rows; int4 with equal group sizes and act-order permutations."""
    first = parts[0]
    if not all(type(p) is type(first) for p in parts):
        return False
    if isinstance(first, Fp8Weight):
        if any(p.block != first.block for p in parts):
            return False
        return first.block is None or all(p.shape[0] % first.block[0] == 0 for p in parts[:-1])
    if isinstance(first, Int4Weight):
        same_perm = all((p.perm is None) == (first.perm is None) for p in parts) and (
            first.perm is None or all(torch.equal(p.perm, first.perm) for p in parts))
        return all(p.group_size == first.group_size for p in parts) and same_perm
    return isinstance(first, Int8Weight)


def cat(parts: list):
    """The forms concatenated along N (ValueError where can_cat says they do not)."""
    if not can_cat(parts):
        raise ValueError(f"quantized weights {[type(p).__name__ for p in parts]} do not concatenate along the outputs")
    first = parts[0]
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]))
    if isinstance(first, Fp8Weight):
        parts = [p.per_channel() for p in parts]
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), first.block)
    return replace(first, qweight=torch.cat([p.qweight for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   zeros=torch.cat([p.zeros for p in parts]))


def split(w, sizes: list[int]) -> list:
    """The form split along N into parts of these sizes."""
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    if starts[-1] != w.shape[0]:
        raise ValueError(f"split sizes {sizes} do not add up to the {w.shape[0]} outputs")
    return [w.rows(a, b) for a, b in zip(starts, starts[1:])]


def nbytes(w) -> int:
    """Bytes the weight's tensors take."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in (getattr(w, f, None) for f in w.__dataclass_fields__)
               if isinstance(t, torch.Tensor))
