"""Int8 weights in the native CPU GEMM (decision 071): packed_linear over kernels.linear_pack_int8 against
x @ (qweight * scale).T + bias in float64, on each path the CPU has (VNNI with two-part activations; weights
converted to fp32), an AVX2 build of the same source, and the one-call decode forward with int8 panels against
the same ops one by one.

Tolerance, per output y[r, n] (w = qweight[n] * scale[n]):
  both paths: (K + 4) * 2^-23 * sum_k |x[r, k] w[k]| (fp32 rounding of the sums)
  VNNI adds: max|x[r]| / (2 * 127 * 254^(P - 1)) * sum_k |w[k]|: each activation is split into P int8 parts,
  s_1 q_1 + ... + s_P q_P, with an error of at most s_P / 2 (P = lp_int8_parts(): 3, about 6e-8 max|x[r]|)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import loraplex.kernels as kernels
from loraplex.kernels import cpu_native, dispatch, reference

pytestmark = pytest.mark.skipif(dispatch.MODE != "auto" or cpu_native.int8_isa() == cpu_native.INT8_NONE,
                                reason="no native int8 GEMM (LORAPLEX_KERNELS not auto, no compiler or no vector path)")
PATHS = {"amx": cpu_native.INT8_AMX, "vnni": cpu_native.INT8_VNNI, "cvt": cpu_native.INT8_CVT}
# (rows, in_features, out_features): tails of k (not a multiple of 4, 32 or 64), partial panels, odd N, N = 1
# and rows below, at and past AMX's whole tiles (AMX serves calls of lp_int8_amx_min_rows rows or more)
SHAPES = [(1, 64, 64), (1, 577, 130), (2, 3, 1), (3, 70, 33), (4, 1, 65), (5, 130, 129), (7, 255, 63),
          (10, 64, 64), (16, 96, 200), (23, 130, 17), (64, 577, 130)]


@pytest.fixture(params=list(PATHS))
def path(request):
    """Each int8 path this library has, forced for the test."""
    best = cpu_native.int8_isa()
    if PATHS[request.param] > best:
        pytest.skip(f"{request.param}: not built on this CPU")
    assert cpu_native.force_int8_isa(PATHS[request.param]) == PATHS[request.param]
    yield request.param
    cpu_native.force_int8_isa(best)


def int8_layer(n, k, gen, bias=True):
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    return q, scale, (torch.randn(n, generator=gen) if bias else None)


def check(got, x, q, scale, bias, path, lib=None):
    """got against the float64 product within the tolerance of the module docstring."""
    w = q.double() * scale.double()[:, None]
    x = x.double()
    want = x @ w.T + (0 if bias is None else bias.double())
    tol = (x.shape[1] + 4) * 2.0**-23 * (x.abs() @ w.abs().T) + 1e-30
    if path in ("vnni", "amx"):
        parts = (lib or cpu_native.library()).lp_int8_parts()
        tol += x.abs().amax(1, keepdim=True) / (2 * 127 * 254 ** (parts - 1)) * w.abs().sum(1)[None]
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"worst error {float((err / tol).max()):.3g}x the tolerance"


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_packed_linear_int8_matches_the_dequantized_product(path, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    q, scale, bias = int8_layer(n, k, gen, bias=m % 2 == 1)
    packed = kernels.linear_pack_int8(q, scale, bias)
    assert isinstance(packed, cpu_native.Panels) and packed.kind == torch.int8
    x = torch.randn(m, k + 3, generator=gen)[:, :k]  # strided rows
    check(kernels.packed_linear(x, packed), x, q, scale, bias, path)


@pytest.mark.parametrize("threads", [1, 2])
def test_extreme_activations(path, threads):
    """A zero row, one huge element, all negative, subnormal values, 1e30 and 1e34-sized rows: each within its
    own row's tolerance (rows do not share scales); a row holding inf or NaN gives non-finite outputs and leaves
    the other rows alone. n * k is large enough for the panels to be spread over the threads."""
    gen = torch.Generator().manual_seed(11)
    n, k = 520, 577
    q, scale, bias = int8_layer(n, k, gen)
    x = torch.randn(9, k, generator=gen)
    x[0] = 0
    x[1, 100] = 1e4
    x[2] = -x[2].abs()
    x[3] = torch.randn(k, generator=gen) * 1e-39  # subnormal: scaled in double
    x[4, 7] = 1e30
    x[5] = torch.randn(k, generator=gen) * 1e34
    x[6, 5], x[7, 9] = float("inf"), float("nan")
    packed = kernels.linear_pack_int8(q, scale, bias)
    before = cpu_native.threads()
    cpu_native.set_threads(threads)
    try:
        got = kernels.packed_linear(x, packed)
    finally:
        cpu_native.set_threads(before)
    finite = [0, 1, 2, 3, 4, 5, 8]
    check(got[finite], x[finite], q, scale, bias, path)
    assert not got[6:8].isfinite().any()
    assert got[0].equal(bias)  # a zero row: exactly the bias


def test_into_out_and_the_rows_left_alone(path):
    gen = torch.Generator().manual_seed(12)
    q, scale, bias = int8_layer(70, 33, gen)
    x = torch.randn(3, 33, generator=gen)
    out = torch.full((3, 70), float("nan"))
    packed = kernels.linear_pack_int8(q, scale, bias)
    assert kernels.packed_linear(x, packed, out) is out
    check(out, x, q, scale, bias, path)
    with pytest.raises(ValueError, match="out must be contiguous fp32"):
        kernels.packed_linear(x, packed, torch.empty(3, 71))


def test_fused_projections_are_concatenated_rows():
    """q/k/v as one int8 GEMM (rows and scales concatenated) equal the three GEMMs (same path, same values)."""
    gen = torch.Generator().manual_seed(13)
    parts = [int8_layer(n, 96, gen) for n in (64, 32, 32)]
    x = torch.randn(5, 96, generator=gen)
    fused = kernels.linear_pack_int8(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                                     torch.cat([p[2] for p in parts]))
    one = kernels.packed_linear(x, fused)
    assert torch.equal(one, torch.cat([kernels.packed_linear(x, kernels.linear_pack_int8(*p)) for p in parts], 1))


def test_reference_mode_packs_for_torch(monkeypatch):
    monkeypatch.setattr(dispatch, "MODE", "reference")
    gen = torch.Generator().manual_seed(14)
    q, scale, bias = int8_layer(33, 70, gen)
    packed = kernels.linear_pack_int8(q, scale.half(), bias)
    assert isinstance(packed, reference.Int8Linear)
    x = torch.randn(4, 70, generator=gen)
    check(kernels.packed_linear(x, packed), x, q, scale.half().float(), bias, "vnni")


@pytest.mark.parametrize(("args", "name"), [
    ((torch.zeros(4, 8), torch.ones(4)), "qweight"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(5)), "scale"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, dtype=torch.int32)), "scale"),
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), torch.ones(3)), "bias"),
])
def test_bad_arguments_are_refused_by_name(args, name):
    with pytest.raises(ValueError, match=f"linear_pack_int8: {name} must be"):
        kernels.linear_pack_int8(*args)


def test_in_features_past_the_int32_sums_are_refused():
    limit = cpu_native.library().lp_int8_max_k()
    with pytest.raises(ValueError, match=f"in_features {limit + 1} is past"):
        cpu_native.Panels.int8(torch.zeros(1, limit + 1, dtype=torch.int8), torch.ones(1))


def _avx2_flags() -> tuple[str, ...] | None:
    """Flags building the source for AVX2 (with AVX-VNNI where this CPU has it), or None when it cannot run here."""
    try:
        flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split())
    except (OSError, StopIteration):
        return None
    if not {"avx2", "fma", "f16c", "bmi2"} <= flags:
        return None
    march = ("-march=x86-64-v3", *(("-mavxvnni",) if "avx_vnni" in flags else ()))
    return tuple(f for f in cpu_native.C_FLAGS if not f.startswith("-march")) + march


def test_an_avx2_build_serves_int8_and_fp16(monkeypatch):
    """The same source built for AVX2 (8 lanes, 32-column panels): its int8 paths (VNNI on 256 bits where the CPU
    has AVX-VNNI, and the fp32 fallback) and its fp16 panels, through the same Python wrappers."""
    flags = _avx2_flags()
    if flags is None:
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    lib = cpu_native.load(cpu_native.build(flags))
    assert lib.lp_gemm_panel_width() == 32
    monkeypatch.setattr(cpu_native, "library", lambda: lib)
    gen = torch.Generator().manual_seed(15)
    q, scale, bias = int8_layer(75, 131, gen)
    x = torch.randn(7, 131, generator=gen)
    paths = [p for p in PATHS if PATHS[p] <= lib.lp_int8_isa()]
    assert ("vnni" in paths) == ("-mavxvnni" in flags) and "cvt" in paths
    for p in paths:
        lib.lp_int8_force(PATHS[p])
        check(cpu_native.packed_linear(x, cpu_native.Panels.int8(q, scale, bias)), x, q, scale, bias, p, lib)
    weight = torch.randn(75, 131, generator=gen)
    got = cpu_native.packed_linear(x, cpu_native.Panels(weight, bias))
    torch.testing.assert_close(got, torch.addmm(bias, x, weight.half().float().T), rtol=1e-5, atol=1e-4)


# ---- the one-call decode forward over int8 panels ----

HIDDEN, HEADS, KV_HEADS, D, INTER, EPS, BLOCK = 64, 4, 2, 16, 96, 1e-6, 4
MODULES = cpu_native.LORA_MODULES


def _decode_model(gen, kinds):
    """Two layers whose projections are int8 panels (or another kind per the kinds list), and a LoRA slot stack."""
    layers = []
    sizes = {"qkv": ((HEADS + 2 * KV_HEADS) * D, HIDDEN), "o_proj": (HIDDEN, HEADS * D),
             "gate_up": (2 * INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    for kind in kinds:
        layer = {"input_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
                 "post_norm": 1 + 0.1 * torch.randn(HIDDEN, generator=gen)}
        for name, (n, k) in sizes.items():
            q, scale, bias = int8_layer(n, k, gen, bias=name == "qkv")
            scale = scale * 3 * k**-0.5
            layer[name] = (kernels.linear_pack_int8(q, scale, bias) if kind == "int8" else
                           cpu_native.Panels(q.float() * scale[:, None], bias, half=kind == "fp16"))
        layers.append(layer)
    ins = {"q_proj": HIDDEN, "k_proj": HIDDEN, "v_proj": HIDDEN, "o_proj": HEADS * D, "gate_proj": HIDDEN,
           "up_proj": HIDDEN, "down_proj": INTER}
    outs = {"q_proj": HEADS * D, "k_proj": KV_HEADS * D, "v_proj": KV_HEADS * D, "o_proj": HIDDEN,
            "gate_proj": INTER, "up_proj": INTER, "down_proj": HIDDEN}
    slots, rank = 2, 4
    lora = SimpleNamespace(a=[], b_t=[], ranks=[], scales=[], max_loras=slots, max_rank=rank, dtype=torch.float16)
    for _ in kinds:
        lora.a.append({m: (0.1 * torch.randn(slots, rank, ins[m], generator=gen)).half() for m in MODULES})
        lora.b_t.append({m: (0.1 * torch.randn(slots, rank, outs[m], generator=gen)).half() for m in MODULES})
        lora.ranks.append({m: torch.tensor([rank, 2], dtype=torch.int32) for m in MODULES})
        lora.scales.append({m: torch.tensor([0.5, 2.0]) for m in MODULES})
    return layers, lora


@pytest.mark.parametrize("kinds", [("int8", "int8"), ("int8", "fp16")], ids=["int8", "int8+fp16"])
def test_decode_forward_over_int8_panels_gives_the_per_op_values(path, kinds):
    """lp_decode_forward with int8 projections (and LoRA deltas in fp32 from fp16 stacks) equals packed_linear,
    lora_add and the layer ops one by one, bit for bit; a layer of another kind beside it keeps its own kind."""
    gen = torch.Generator().manual_seed(16)
    layers, lora = _decode_model(gen, kinds)
    final_norm = torch.ones(HIDDEN)
    angles = torch.outer(torch.arange(64.0), 10000 ** (-torch.arange(0, D, 2) / D))
    cos, signed_sin = torch.cat([angles.cos()] * 2, 1), torch.cat([-angles.sin(), angles.sin()], 1)
    tables = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [4, 5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([9, 2, 15], dtype=torch.int32)
    positions = lens.long() - 1
    slot_mapping = torch.stack([tables[b, p // BLOCK].long() * BLOCK + p % BLOCK for b, p in enumerate(positions)])
    token_slots = torch.tensor([1, -1, 0], dtype=torch.int32)
    kv = torch.randn(len(layers), 2, 8, BLOCK, KV_HEADS, D, generator=gen)
    h = torch.randn(3, HIDDEN, generator=gen)

    def adapt(y, x, i, modules):
        at = 0
        for m in modules:
            n = lora.b_t[i][m].shape[2]
            cpu_native.lora_add(y[:, at:at + n], x, token_slots, lora.a[i][m], lora.b_t[i][m], lora.ranks[i][m],
                                lora.scales[i][m])
            at += n
        return y

    def per_op(kv):
        x, delta, t = h.clone(), None, 3
        for i, layer in enumerate(layers):
            normed = cpu_native.add_rms_norm(x, delta, layer["input_norm"], EPS)
            qkv = adapt(cpu_native.packed_linear(normed, layer["qkv"]), normed, i, MODULES[:3])
            q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], 1)
            q, k, v = q.view(t, HEADS, D), k.view(t, KV_HEADS, D), v.view(t, KV_HEADS, D)
            cpu_native.rotate_qk(q, k, positions, cos, signed_sin)
            cpu_native.write_kv(kv[i, 0], kv[i, 1], k, v, slot_mapping)
            o = cpu_native.paged_attention_decode(q, kv[i, 0], kv[i, 1], tables, lens, D**-0.5).reshape(t, -1)
            proj = adapt(cpu_native.packed_linear(o, layer["o_proj"]), o, i, MODULES[3:4])
            normed = cpu_native.add_rms_norm(x, proj, layer["post_norm"], EPS)
            gu = adapt(cpu_native.packed_linear(normed, layer["gate_up"]), normed, i, MODULES[4:6])
            act = cpu_native.silu_mul(*gu.split([INTER, INTER], 1))
            delta = adapt(cpu_native.packed_linear(act, layer["down_proj"]), act, i, MODULES[6:])
        return cpu_native.add_rms_norm(x, delta, final_norm, EPS)

    forward = cpu_native.DecodeForward(layers, final_norm, cos, signed_sin, HEADS, KV_HEADS, D, EPS, D**-0.5)
    assert forward.serves_lora(lora)
    one_call_kv, per_op_kv = kv.clone(), kv.clone()
    got = forward(h.clone(), positions, slot_mapping, tables, lens, one_call_kv, lora, token_slots)
    want = per_op(per_op_kv)
    assert torch.equal(got, want) and torch.equal(one_call_kv, per_op_kv)
    base = forward(h.clone(), positions, slot_mapping, tables, lens, kv.clone())  # the adapters change the rows
    assert (got[[0, 2]] - base[[0, 2]]).abs().max() > 1e-3 and torch.equal(got[1], base[1])


def test_decode_forward_paths_agree_within_the_tolerance():
    """The VNNI and fp32-converted int8 paths of one decode step differ only by the activation split's error."""
    if cpu_native.int8_isa() < cpu_native.INT8_VNNI:
        pytest.skip("no VNNI here")
    gen = torch.Generator().manual_seed(17)
    layers, _ = _decode_model(gen, ("int8", "int8"))
    angles = torch.outer(torch.arange(64.0), 10000 ** (-torch.arange(0, D, 2) / D))
    cos, signed_sin = torch.cat([angles.cos()] * 2, 1), torch.cat([-angles.sin(), angles.sin()], 1)
    forward = cpu_native.DecodeForward(layers, torch.ones(HIDDEN), cos, signed_sin, HEADS, KV_HEADS, D, EPS, D**-0.5)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    args = (torch.tensor([5]), torch.tensor([5]), tables, torch.tensor([6], dtype=torch.int32))
    kv = torch.randn(2, 2, 2, BLOCK, KV_HEADS, D, generator=gen)
    h = torch.randn(1, HIDDEN, generator=gen)
    best = cpu_native.int8_isa()
    try:
        outs = []
        for level in (cpu_native.INT8_VNNI, cpu_native.INT8_CVT):
            cpu_native.force_int8_isa(level)
            outs.append(forward(h.clone(), *args, kv.clone()))
    finally:
        cpu_native.force_int8_isa(best)
    assert 0 < (outs[0] - outs[1]).abs().max() < 1e-5 * outs[1].abs().max()


def test_each_rows_values_do_not_depend_on_the_call():
    """A row gives the same values alone (VNNI) and among 23 rows (AMX where the CPU has it, VNNI otherwise):
    the int32 sums are exact on both, so a batch's composition never changes a row's output."""
    if cpu_native.int8_isa() < cpu_native.INT8_VNNI:
        pytest.skip("no VNNI here")
    gen = torch.Generator().manual_seed(18)
    q, scale, bias = int8_layer(200, 577, gen)
    packed = kernels.linear_pack_int8(q, scale, bias)
    x = torch.randn(23, 577, generator=gen)
    together = kernels.packed_linear(x, packed)
    assert all(torch.equal(together[i], kernels.packed_linear(x[i:i + 1], packed)[0]) for i in (0, 5, 22))


def test_two_threads_give_the_one_threads_values(path):
    """Rows quantized and panels computed on two threads (m * k past the threshold of both): the same values."""
    gen = torch.Generator().manual_seed(19)
    q, scale, bias = int8_layer(300, 577, gen)
    packed = kernels.linear_pack_int8(q, scale, bias)
    x = torch.randn(130, 577, generator=gen)
    before, outs = cpu_native.threads(), []
    try:
        for threads in (1, 2):
            cpu_native.set_threads(threads)
            outs.append(kernels.packed_linear(x, packed))
    finally:
        cpu_native.set_threads(before)
    assert torch.equal(outs[0], outs[1])
    check(outs[1], x, q, scale, bias, path)
