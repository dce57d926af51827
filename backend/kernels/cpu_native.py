"""The native CPU ops (`cpu_native.c`): built once per machine with the C compiler, called through ctypes.

They serve fp32 CPU tensors where torch would take several small ops a call: the residual
add with RMSNorm, SiLU-and-multiply, RoPE on q and k in place, the KV write and paged decode
attention straight from the block table (no gathered copies); the GEMM over weights packed
in panels, fp16, fp32 or int8 (``Panels``, on CPUs with AVX-512 or AVX2+F16C+FMA; faster than FBGEMM's
fp16 and MKL's fp32 at a decode's rows: decision 037; int8 on AMX / VNNI where the CPU has them:
decision 071); the decode step's LoRA deltas (``lora_add``,
BGMV: each adapter's A and B.T read once for its rows); and a decode step's whole forward,
LoRA deltas included (``DecodeForward``). `dispatch` routes a call here when ``serves`` says so and the
library is built; else the torch reference runs. Without a C compiler (``$CC``, else ``cc``)
or when the build fails, one warning is logged and every call takes the reference.
``LORAPLEX_KERNELS=reference`` keeps them off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from loraplex.kernels.cpu_runner import build_once
from loraplex.kernels.launch_args import attention_variant

log = logging.getLogger("loraplex.kernels")
SOURCE = Path(__file__).with_name("cpu_native.c")
# -ffp-contract=off: no fused multiply-adds, so the elementwise ops round as torch's do (RoPE: the same values);
# -fopenmp: the loops marked `omp simd` vectorize (reductions in lanes) without -ffast-math, and the GEMM's and
# decode attention's parallel loops run on torch's own OpenMP runtime (libgomp.so.1, which torch has loaded).
C_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
# the projections whose LoRA stacks lp_decode_forward takes, in its order (LoraSlots keys its stacks by these)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPS = ("add_rms_norm", "silu_mul", "rotate_qk", "write_kv", "paged_attention_decode", "argmax_rows")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # C entry point -> (argument types, return type)
    "lp_add_rms_norm": ([_P, _I, _P, _I, _P, _P, _I, _I, _I, _F], None),
    "lp_silu_mul": ([_P, _I, _P, _I, _P, _I, _I, _I], None),
    "lp_rotate_qk": ([_P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _P, _I], ctypes.c_int),
    "lp_write_kv": ([_P, _P, _P, _I, _P, _I, _P, _I, _I, _I], ctypes.c_int),
    "lp_paged_decode": ([_P, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F], ctypes.c_int),
    "lp_gemm_f16": ([_P, _I, _P, _P, _P, _I, _I, _I, _I], None),
    "lp_gemm_f32": ([_P, _I, _P, _P, _P, _I, _I, _I, _I], None),
    "lp_gemm_i8": ([_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
    "lp_gemm_panel_width": ([], ctypes.c_int),
    "lp_int8_isa": ([], ctypes.c_int),
    "lp_int8_force": ([ctypes.c_int], ctypes.c_int),
    "lp_int8_max_k": ([], ctypes.c_int),
    "lp_int8_parts": ([], ctypes.c_int),
    "lp_int8_amx_min_rows": ([], ctypes.c_int),
    "lp_max_head_dim": ([], ctypes.c_int),
    "lp_set_threads": ([ctypes.c_int], None),
    "lp_threads": ([], ctypes.c_int),
    "lp_decode_forward": ([_P, _P, _P, _P, _P, _P, _P], ctypes.c_int),
    "lp_argmax_rows": ([_P, _I, _I, _I, _P], ctypes.c_int64),
    "lp_advance_decode": ([_P, _P, _P, _P, _I, _I, _I], ctypes.c_int),
    "lp_lora_add": ([_P, _I, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I], ctypes.c_int),
}


def _machine() -> str:
    """What -march=native compiles for: the CPU's model and flags (the cache key must change with them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))


def build(flags: tuple[str, ...] = C_FLAGS) -> Path:
    """The library for this machine (built once into the kernel cache, keyed by compiler, flags, source and CPU);
    other flags (another -march) build another library, for tests."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} is not on PATH; set CC)")
    return build_once("cpu_native", [cc, *flags, SOURCE.read_text(), _machine()],
                      lambda _tmp, out: [cc, *flags, str(SOURCE), "-o", str(out), "-lm"], cc, SOURCE.name)


def load(path: Path) -> ctypes.CDLL:
    """A built library with its entry points' signatures set."""
    lib = ctypes.CDLL(str(path))
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) when it cannot be built here."""
    try:
        return load(build())
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU ops unavailable, using the torch path: %s", exc)
        return None


def set_threads(n: int) -> None:
    """Threads of the native GEMM's and decode attention's parallel loops (process-wide; 0: torch's count)."""
    lib = library()
    if lib is not None:
        lib.lp_set_threads(n)


def threads() -> int:
    """What set_threads gives the native loops now (torch's count when unset); 0 without the library."""
    lib = library()
    return lib.lp_threads() if lib is not None else 0


def _f32(*tensors) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def _heads(x: torch.Tensor) -> bool:
    """[T, H, D] with each row's heads side by side: rows may be strided (views of a fused output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _dense(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def serves(name: str, args: tuple) -> bool:
    """Whether the native op serves this call (dtypes and layouts it was written for)."""
    if name == "add_rms_norm":
        x, delta, weight, _eps = args
        return x.dim() == 2 and _f32(x, weight) and weight.is_contiguous() and (
            delta is None or (delta.shape == x.shape and _f32(delta)))
    if name == "silu_mul":
        gate, up = args
        return gate.dim() == 2 and gate.shape == up.shape and _f32(gate, up)
    if name == "rotate_qk":
        q, k, positions, cos, signed_sin = args
        return (_f32(q, k) and _heads(q) and _heads(k) and _dense(positions, torch.int64) and _dense(cos, torch.float32)
                and _dense(signed_sin, torch.float32) and q.shape[2] <= library().lp_max_head_dim())
    if name == "write_kv":
        k_cache, v_cache, k, v, slot_mapping = args
        return (_dense(k_cache, torch.float32) and _dense(v_cache, torch.float32) and _f32(k, v) and _heads(k)
                and _heads(v) and _dense(slot_mapping, torch.int64))
    if name == "argmax_rows":
        (logits,) = args
        return logits.dim() == 2 and logits.shape[1] > 0 and _f32(logits)
    if name == "paged_attention_decode":
        q, k_cache, v_cache, block_tables, context_lens = args[:5]  # then scale, window, softcap: any it takes
        return (_f32(q) and _heads(q) and _dense(k_cache, torch.float32) and _dense(v_cache, torch.float32)
                and _dense(block_tables, torch.int32) and _dense(context_lens, torch.int32)
                and q.shape[1] % k_cache.shape[2] == 0)
    return False


def add_rms_norm(x, delta, weight, eps):
    """x += delta in place (when given), then RMSNorm(x) * weight as a new tensor."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=torch.float32)
    d_ptr, d_stride = (None, 0) if delta is None else (delta.data_ptr(), delta.stride(0))
    library().lp_add_rms_norm(x.data_ptr(), x.stride(0), d_ptr, d_stride, weight.data_ptr(), out.data_ptr(), n, rows,
                              n, eps)
    return out


def silu_mul(gate, up):
    """silu(gate) * up as a new contiguous tensor."""
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=torch.float32)
    library().lp_silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), n, rows, n)
    return out


def rotate_qk(q, k, positions, cos, signed_sin):
    """q and k rotated in place; returns them."""
    rows, hq, d = q.shape
    rc = library().lp_rotate_qk(q.data_ptr(), q.stride(0), hq, k.data_ptr(), k.stride(0), k.shape[1], d,
                                positions.data_ptr(), rows, cos.data_ptr(), signed_sin.data_ptr(), cos.shape[0])
    if rc:
        raise IndexError(f"rotate_qk: a position is outside the rotary tables ({cos.shape[0]} positions)")
    return q, k


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k, v [T, Hkv, D] into the caches' flat slots; a negative slot is skipped."""
    row = k.shape[1] * k.shape[2]
    cache_rows = k_cache.shape[0] * k_cache.shape[1]
    rc = library().lp_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(),
                               v.stride(0), slot_mapping.data_ptr(), k.shape[0], row, cache_rows)
    if rc:
        raise IndexError(f"write_kv: a slot is past the cache's {cache_rows} rows")


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    """One query per sequence [B, Hq, D] over its cached context (with a window, its last window positions),
    read through its block table -> [B, Hq, D]; softcap soft-caps the scores."""
    window, softcap = attention_variant(window, softcap)
    num_seqs, hq, d = q.shape
    out = torch.empty((num_seqs, hq, d), dtype=torch.float32)
    num_blocks, block_size, hkv, _ = k_cache.shape
    rc = library().lp_paged_decode(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
                                   context_lens.data_ptr(), num_seqs,
                                   hq, hkv, d, block_size, num_blocks, scale, window, softcap)
    if rc == -1:
        raise IndexError("paged_attention_decode: a context passes its block table or the cache's blocks")
    if rc:
        raise MemoryError("paged_attention_decode: no memory for the scores")
    return out


def argmax_rows(logits):
    """(each row's index of its largest logit, int64; whether every logit is finite), in one pass."""
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    bad = library().lp_argmax_rows(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr())
    return out, bad == 0


def advance_decode(positions, slot_mapping, context_lens, block_tables, block_size: int) -> None:
    """reference.advance_decode in one pass over the rows (C-contiguous int64, int64, int32, int32 [rows, width])."""
    rows, width = block_tables.shape
    if library().lp_advance_decode(positions.ctypes.data, slot_mapping.ctypes.data, context_lens.ctypes.data,
                                   block_tables.ctypes.data, rows, width, block_size):
        raise IndexError("advance_decode: a position's block is past its block table")


# the int8 GEMM's paths (lp_int8_isa): none (no vector path), weights converted to fp32, VNNI, AMX (from
# lp_int8_amx_min_rows rows a call; VNNI below), the most this CPU and kernel allow unless force_int8_isa caps it
INT8_NONE, INT8_CVT, INT8_VNNI, INT8_AMX = 0, 1, 2, 3
KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # Panels.kind -> lp_weight.kind


def _padded(t: torch.Tensor | None, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None:
        return None
    out = torch.zeros(rows, dtype=dtype)
    out[:t.shape[0]] = t
    return out


class Panels:
    """A linear layer's weight [N, K] for the native GEMM, its ``kind`` fp16, fp32 or int8: N / NB panels (N padded
    with zero rows), one contiguous stream each ([K, NB]; int8: [KP / 4, NB, 4], K padded to KP, a multiple of 64),
    and its bias in fp32 padded the same way (or None); int8 also has its per-row scale (fp32) and 128 * its row
    sums (int32), padded."""

    __slots__ = ("panels", "bias", "out_features", "in_features", "kind", "scale", "colsum")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, half: bool = True):
        width = library().lp_gemm_panel_width()
        n, k = weight.shape
        rows = -(-n // width) * width
        padded = torch.zeros(rows, k, dtype=torch.float32)
        padded[:n] = weight
        panels = padded.view(rows // width, width, k).transpose(1, 2).contiguous()
        self.panels = panels.half() if half else panels
        self.out_features, self.in_features, self.kind = n, k, self.panels.dtype
        self.bias, self.scale, self.colsum = _padded(bias, rows, torch.float32), None, None

    @property
    def half(self) -> bool:
        return self.kind == torch.float16

    @classmethod
    def int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Panels:
        """W = qweight * scale[:, None] (qweight int8 [N, K], K at most lp_int8_max_k; scale [N]) and bias [N]."""
        lib = library()
        width = lib.lp_gemm_panel_width()
        n, k = qweight.shape
        if k > lib.lp_int8_max_k():
            raise ValueError(f"int8 panels: in_features {k} is past the int8 GEMM's {lib.lp_int8_max_k()}")
        rows, kp = -(-n // width) * width, -(-k // 64) * 64
        padded = torch.zeros(rows, kp, dtype=torch.int8)
        padded[:n, :k] = qweight
        self = cls.__new__(cls)
        self.panels = padded.view(rows // width, width, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.out_features, self.in_features, self.kind = n, k, torch.int8
        self.bias, self.scale = _padded(bias, rows, torch.float32), _padded(scale, rows, torch.float32)
        self.colsum = _padded(qweight.sum(1, dtype=torch.int32) * 128, rows, torch.int32)
        return self


def panels_native() -> bool:
    """Whether weights pack for the native GEMM here (the library built with a vector path for it)."""
    lib = library()
    return lib is not None and lib.lp_gemm_panel_width() > 0


def int8_isa() -> int:
    """The int8 GEMM's path now: INT8_AMX, INT8_VNNI, INT8_CVT (weights converted to fp32) or INT8_NONE (no library
    or no vector path)."""
    lib = library()
    return lib.lp_int8_isa() if lib is not None else INT8_NONE


def force_int8_isa(level: int) -> int:
    """Cap the int8 GEMM's path at level (process-wide; INT8_CVT forces the fallback, INT8_VNNI keeps AMX off,
    INT8_AMX or more restores the best here); returns the path taken."""
    lib = library()
    return lib.lp_int8_force(level) if lib is not None else INT8_NONE


def packed_linear(x, weight: Panels, out=None):
    """x [M, K] fp32 @ W.T + bias -> [M, N] fp32: each weight read as its stored (fp16 or fp32) value, products
    summed in fp32; into `out` (contiguous [M, N] fp32) when given."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if out is None:
        out = torch.empty((m, weight.out_features), dtype=torch.float32)
    elif out.shape != (m, weight.out_features) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"packed_linear: out must be contiguous fp32 {(m, weight.out_features)}")
    bias = None if weight.bias is None else weight.bias.data_ptr()
    lib = library()
    if weight.kind == torch.int8:
        if lib.lp_gemm_i8(x.data_ptr(), x.stride(0), weight.panels.data_ptr(), weight.scale.data_ptr(),
                          weight.colsum.data_ptr(), bias, out.data_ptr(), weight.out_features, m, weight.out_features,
                          k):
            raise MemoryError("packed_linear: no memory for the quantized rows")
        return out
    gemm = lib.lp_gemm_f16 if weight.half else lib.lp_gemm_f32
    gemm(x.data_ptr(), x.stride(0), weight.panels.data_ptr(), bias, out.data_ptr(), weight.out_features, m,
         weight.out_features, k)
    return out


class _Weight(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "bias", "scale", "colsum")] + [("kind", ctypes.c_int64)]

    @classmethod
    def of(cls, panels: Panels) -> _Weight:
        ptrs = [None if t is None else t.data_ptr() for t in (panels.panels, panels.bias, panels.scale, panels.colsum)]
        return cls(*ptrs, KINDS[panels.kind])


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]
    _fields_ += [(name, _Weight) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("window", ctypes.c_int64), ("softcap", ctypes.c_float)]


class _Shapes(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim",
                                                   "intermediate")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("positions", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p), ("context_lens", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("max_blocks", ctypes.c_int64), ("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p),
                ("table_rows", ctypes.c_int64), ("kv_cache", ctypes.c_void_p), ("num_blocks", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("token_slots", ctypes.c_void_p), ("num_slots", ctypes.c_int64),
                ("max_rank", ctypes.c_int64), ("lora_half", ctypes.c_int64)]


class _LoraModule(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("a", "bt", "ranks", "scales")]


def lora_stacks_native(a: torch.Tensor, b_t: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether one projection's slot stacks (A [S, R, in], B.T [S, R, out]: fp32, or fp16 where the vector path
    is built; ranks, scales) suit lora_add."""
    dtype = a.dtype if a.dtype == torch.float32 or (a.dtype == torch.float16 and panels_native()) else None
    return (dtype is not None and _dense(a, dtype) and _dense(b_t, dtype) and _dense(ranks, torch.int32)
            and _dense(scales, torch.float32))


def lora_add(y, x, token_slots, a, b_t, ranks, scales) -> None:
    """y [T, out] += scale * (x[t] @ A[slot].T) @ B[slot].T for each row t on an adapter (token_slots int32, -1:
    none), ranks from ranks[slot]: the decode step's BGMV, rows of one slot read its A and B.T once (stacks that
    lora_stacks_native accepts)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_slots, max_rank, out = b_t.shape
    rc = library().lp_lora_add(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0],
                               token_slots.data_ptr(), a.data_ptr(), b_t.data_ptr(), ranks.data_ptr(),
                               scales.data_ptr(), num_slots, max_rank, a.shape[2], out, int(a.dtype == torch.float16))
    if rc == -1:
        raise IndexError(f"lora_add: an adapter slot is past the {num_slots} slots")
    if rc:
        raise MemoryError("lora_add: no memory for the plan")


class DecodeForward:
    """A decode step's whole forward in one native call (lp_decode_forward): the same ops in the same order as
    LlamaModel.forward takes them one by one, so the same values, without ~20 Python calls a layer; with
    adapters, each projection adds its rows' deltas as lora_add does. layers: per layer {input_norm, post_norm: fp32
    tensors; qkv, o_proj, gate_up, down_proj: Panels, each of any kind; optional window, softcap: its attention's, as
    paged_attention_decode takes them (absent or None: none)}; the tensors must outlive this object (the model holds
    them)."""

    def __init__(self, layers: list[dict], final_norm: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 heads: int, kv_heads: int, head_dim: int, eps: float, scale: float):
        self._layers = (_Layer * len(layers))(*[
            _Layer(w["input_norm"].data_ptr(), w["post_norm"].data_ptr(),
                   *[_Weight.of(w[name]) for name in ("qkv", "o_proj", "gate_up", "down_proj")],
                   *attention_variant(w.get("window"), w.get("softcap")))
            for w in layers])
        hidden = final_norm.shape[0]
        self._shapes = _Shapes(len(layers), hidden, heads, kv_heads, head_dim, layers[0]["down_proj"].in_features,
                               eps, scale)
        self._final_norm, self._cos, self._signed_sin = final_norm, cos, signed_sin
        self._lora = None  # (LoraSlots, its stacks as _LoraModule [layers * 7]) once serves_lora accepted them

    def serves_lora(self, slots) -> bool:
        """Whether this forward can add LoraSlots slots' deltas (CPU stacks in fp32 or fp16; B kept as B.T)."""
        if self._lora is not None and self._lora[0] is slots:
            return True
        if not all(lora_stacks_native(slots.a[i][m], slots.b_t[i][m], slots.ranks[i][m], slots.scales[i][m])
                   for i in range(self._shapes.num_layers) for m in LORA_MODULES):
            return False
        modules = [_LoraModule(slots.a[i][m].data_ptr(), slots.b_t[i][m].data_ptr(), slots.ranks[i][m].data_ptr(),
                               slots.scales[i][m].data_ptr()) for i in range(self._shapes.num_layers) for m in LORA_MODULES]
        self._lora = slots, (_LoraModule * len(modules))(*modules)  # the stacks are filled in place, never moved
        return True

    def __call__(self, h, positions, slot_mapping, block_tables, context_lens, kv_cache, lora_slots=None,
                 token_slots=None) -> torch.Tensor:
        """h [T, hidden] fp32 embeddings (updated in place) -> hidden states after the final norm; writes K/V.
        With lora_slots (which serves_lora accepted) and token_slots (int32 [T], -1: none), each projection
        adds its rows' LoRA deltas."""
        rows = h.shape[0]
        out = torch.empty_like(h)
        lora, slots_ptr, num_slots, max_rank, half = None, None, 0, 0, 0
        if lora_slots is not None:
            if not self.serves_lora(lora_slots):
                raise ValueError("decode forward: these LoRA stacks are not fp32 or fp16 CPU stacks")
            lora, slots_ptr = self._lora[1], token_slots.data_ptr()
            num_slots, max_rank = lora_slots.max_loras, lora_slots.max_rank
            half = int(lora_slots.dtype == torch.float16)
        step = _Step(rows, positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
                     context_lens.data_ptr(), block_tables.stride(0), block_tables.shape[1], self._cos.data_ptr(),
                     self._signed_sin.data_ptr(), self._cos.shape[0], kv_cache.data_ptr(), kv_cache.shape[2],
                     kv_cache.shape[3], slots_ptr, num_slots, max_rank, half)
        rc = library().lp_decode_forward(ctypes.byref(self._shapes), self._layers, self._final_norm.data_ptr(),
                                         ctypes.byref(step), lora, h.data_ptr(), out.data_ptr())
        if rc == -1:
            raise IndexError("decode forward: a position, slot, block or adapter slot is outside its table")
        if rc:
            raise MemoryError("decode forward: no memory for the activations")
        return out
