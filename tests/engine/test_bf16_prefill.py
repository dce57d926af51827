"""`prefill_dtype` bf16x3 and bfloat16 (decision 074): a CPU step's prompt rows multiply the packed fp32/fp16 panels on
AMX-BF16 tiles, x and W split into bf16 parts (two: three products; one), every other row stays on the packed GEMM.

The numerics stated: a prompt's teacher-forced logprobs within BF16X3_LOGPROB_ATOL (bf16x3) or BF16_LOGPROB_ATOL
(bfloat16) of transformers + peft, greedy tokens equal to peft's (bf16x3; bfloat16: wherever peft's top-2 margin
is over twice its tolerance); a decode row in the same step exact (the fp32 tolerance), as are prompts under
bf16_prefill.MIN_ROWS rows. Both are refused, naming the knob, where they cannot run: no AMX-BF16 tiles (the
fallback forced here on any CPU), CUDA, weights not in fp32/fp16 panels.
"""

from __future__ import annotations

import pytest
import torch
from exactness import LOGPROB_ATOL, assert_matches_oracle
from peft_reference import teacher_forced_logits

from loraplex import kernels
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.models import bf16_prefill

# worst seen on the demo model (16 tokens, six prompts of 41-106 tokens, its two adapters; decision 074): bf16x3
# 2.2e-4, bfloat16 0.066; on SmolLM2 2.2e-4 and 0.31
BF16X3_LOGPROB_ATOL = 5e-4
BF16_LOGPROB_ATOL = 0.2
needs_tiles = pytest.mark.skipif(not bf16_prefill.tiles_available(), reason="no AMX-BF16 tiles here")


def test_prefill_rows_from_the_prompt_mask():
    """Under MIN_ROWS prompt rows: none; all rows: one slice, none left to the packed GEMM; one run beside decodes: a
    slice; else indices."""
    n = bf16_prefill.MIN_ROWS
    assert bf16_prefill.prefill_rows(None) is None
    assert bf16_prefill.prefill_rows(torch.ones(n - 1, dtype=torch.bool)) is None
    every = bf16_prefill.prefill_rows(torch.ones(n, dtype=torch.bool))
    assert every.tiles == slice(None) and every.packed is None
    mask = torch.cat([torch.zeros(2, dtype=torch.bool), torch.ones(n, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)])
    run = bf16_prefill.prefill_rows(mask)
    assert run.tiles == slice(2, n + 2) and run.packed.tolist() == [0, 1, n + 2]
    mask[5] = False
    mask[0] = True
    scattered = bf16_prefill.prefill_rows(mask)
    assert torch.equal(scattered.tiles, mask.nonzero().squeeze(1)) and scattered.packed.tolist() == [1, 5, n + 2]


@needs_tiles
@pytest.mark.parametrize("half", [False, True], ids=["fp32-panels", "fp16-panels"])
def test_tiles_gemm_error_bounds_and_split_rows(half):
    """Against float64 on the stored weights, relative to sum |x| |w| per output: two parts within 2^-15, one part
    within 2^-7 (M, N, K off the tiles' multiples; a bias; an outlier); a split step's packed rows equal the packed
    GEMM's and its tile rows bf16_linear's, bit for bit."""
    torch.manual_seed(0)
    m, n, k = bf16_prefill.MIN_ROWS + 3, 100, 70
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    x[1, 2] = 3e4
    packed = kernels.linear_pack(weight, bias, half=half)
    stored = (weight.half().float() if half else weight).double()
    want = x.double() @ stored.T + bias.double()
    scale = x.double().abs() @ stored.abs().T + bias.double().abs()
    for parts, bound in ((2, 2.0**-15), (1, 2.0**-7)):
        error = ((kernels.bf16_linear(x, packed, parts).double() - want).abs() / scale).max().item()
        assert error <= bound, (parts, error)
    mask = torch.ones(m, dtype=torch.bool)
    mask[[0, 33]] = False
    rows = bf16_prefill.prefill_rows(mask)
    y = bf16_prefill.linear(x, packed, 2, rows)
    assert torch.equal(y[rows.packed], kernels.packed_linear(x[rows.packed], packed))
    assert torch.equal(y[rows.tiles], kernels.bf16_linear(x[rows.tiles], packed, 2))


def test_bf16_modes_are_refused_where_they_cannot_run(monkeypatch):
    """No tiles (the fallback on a CPU without AMX-BF16, forced here), CUDA, weights not in panels: ValueError naming
    prefill_dtype; float32 (the default) is the packed GEMM; an unknown value is refused by the config."""
    assert EngineConfig().prefill_dtype == "float32"
    assert bf16_prefill.parts("float32", "cpu", torch.float32, None) == 0
    with pytest.raises(ValueError, match="prefill_dtype must be float32, bf16x3 or bfloat16"):
        EngineConfig(prefill_dtype="auto")
    with pytest.raises(ValueError, match="prefill_dtype bf16x3 is a CPU option"):
        bf16_prefill.parts("bf16x3", "cuda", torch.bfloat16, None)
    monkeypatch.setattr(bf16_prefill, "tiles_available", lambda: False)
    for mode in ("bf16x3", "bfloat16"):
        with pytest.raises(ValueError, match=f"prefill_dtype {mode} needs AMX-BF16 tiles"):
            bf16_prefill.parts(mode, "cpu", torch.float32, [])
    monkeypatch.setattr(bf16_prefill, "tiles_available", lambda: True)
    with pytest.raises(ValueError, match="prefill_dtype bfloat16 needs the native packed GEMM"):
        bf16_prefill.parts("bfloat16", "cpu", torch.float32, None)


def test_engine_without_tiles_refuses_bf16_and_serves_float32(demo, monkeypatch):
    """The forced fallback through the engine: bf16x3 refused at start, float32 packs no tile path."""
    monkeypatch.setattr(bf16_prefill, "tiles_available", lambda: False)
    config = dict(model_dir=str(demo["model"]), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="prefill_dtype bf16x3 needs AMX-BF16 tiles"):
        LLMEngine(EngineConfig(**config, prefill_dtype="bf16x3"))
    assert LLMEngine(EngineConfig(**config)).model.prefill_parts == 0


def _run(engine, first: dict, then: dict, max_tokens: int):
    """first's requests stepped once (their prompts prefilled), then's added beside them, all stepped to the end:
    (id -> Request, id -> tokens, id -> each token's logprob)."""
    requests, tokens, logprobs = {}, {}, {}

    def add(batch):
        for rid, (prompt, lora) in batch.items():
            params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0,
                      **({"lora_name": lora} if lora else {})}
            requests[rid] = engine.make_request(rid, prompt, SamplingParams.from_dict(params), "t")
            engine.add_request(requests[rid])
            tokens[rid], logprobs[rid] = [], []

    def step():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
            logprobs[out.request_id] += [entry["token"][1] for entry in out.logprobs or []]

    add(first)
    step()
    add(then)
    while engine.has_work():
        step()
    return requests, tokens, logprobs


@needs_tiles
@pytest.mark.parametrize("mode, atol", [("bf16x3", BF16X3_LOGPROB_ATOL), ("bfloat16", BF16_LOGPROB_ATOL)])
def test_prompt_rows_on_tiles_within_tolerance_and_decode_rows_exact(demo, monkeypatch, mode, atol):
    """A decoding request (its prompt under MIN_ROWS: the packed GEMM) beside two long prompts: the step that
    prefills them splits its rows, the decode row exact against peft, the prompt rows within the mode's tolerance."""
    splits = []
    rows_of = bf16_prefill.prefill_rows
    monkeypatch.setattr(bf16_prefill, "prefill_rows", lambda mask: splits.append(rows_of(mask)) or splits[-1])
    adapters = {"demo-a": str(demo["demo-a"]), "demo-b": str(demo["demo-b"])}
    engine = LLMEngine(EngineConfig(model_dir=str(demo["model"]), device="cpu", dtype="float32", max_model_len=256,
                                    num_kv_blocks=64, max_loras=2, max_lora_rank=16, multi_lora=adapters,
                                    native_threads=1, prefill_dtype=mode))
    assert engine.model.prefill_parts == bf16_prefill.PARTS[mode]
    short = {"short": ("Decoding beside a long prompt", "demo-b")}
    long = {"long-b": ("the quick brown fox jumps over the lazy dog " * 3, "demo-b"),
            "long-base": ("pack my box with five dozen liquor jugs " * 3, None)}
    requests, tokens, logprobs = _run(engine, short, long, max_tokens=8)
    split = [s for s in splits if s is not None]
    assert len(split) == 1 and split[0].packed is not None and len(split[0].packed) == 1, "one step split its rows"
    oracle = lambda lora: (str(demo["model"]), adapters.get(lora))  # noqa: E731
    assert_matches_oracle(oracle, short, requests, tokens, logprobs, "decode row beside prompt rows on the tiles",
                          atol=LOGPROB_ATOL)
    for rid, (_, lora) in long.items():
        ref = teacher_forced_logits(*oracle(lora), requests[rid].prompt_token_ids, tokens[rid])
        want = torch.log_softmax(ref, -1).gather(1, torch.tensor(tokens[rid])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs[rid]), want, atol=atol, rtol=0)
        top2 = ref.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > (0 if mode == "bf16x3" else 2 * atol)
        assert torch.equal(torch.tensor(tokens[rid])[clear], ref.argmax(-1)[clear]), f"{rid}: greedy tokens differ"
