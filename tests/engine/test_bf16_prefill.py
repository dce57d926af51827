"""`prefill_dtype=bfloat16` (decision 074): a CPU step's prompt rows multiply a bf16 copy of each packed projection
(oneDNN, AMX where present), every other row stays fp32.

The numerics stated: a bf16 prompt's teacher-forced logprobs within BF16_LOGPROB_ATOL of transformers + peft, its
greedy tokens equal to peft's wherever peft's top-2 margin is over twice that; a decode row in the same step exact
(the fp32 tolerance), as are prompts under bf16_prefill.MIN_ROWS rows. bf16 is refused, naming the knob, where it
cannot run: no bf16 units (the fallback forced here on any CPU), CUDA, weights not in fp32/fp16 panels.
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
from loraplex.kernels import cpu_native
from loraplex.models import bf16_prefill

# bf16 inputs and outputs of every projection of a prompt row: worst seen on the demo model 0.091 (this test), 0.084
# (16 tokens, six prompts, its two adapters); SmolLM2 0.18, W1's model 0.009 (decision 074)
BF16_LOGPROB_ATOL = 0.2
needs_panels = pytest.mark.skipif(not cpu_native.panels_native(), reason="the native packed GEMM is not built here")


def test_prefill_rows_from_the_prompt_mask():
    """Under MIN_ROWS prompt rows: none; all rows: one slice, no fp32 rows; one run beside decodes: a slice; else
    indices."""
    n = bf16_prefill.MIN_ROWS
    assert bf16_prefill.prefill_rows(None) is None
    assert bf16_prefill.prefill_rows(torch.ones(n - 1, dtype=torch.bool)) is None
    every = bf16_prefill.prefill_rows(torch.ones(n, dtype=torch.bool))
    assert every.bf16 == slice(None) and every.fp32 is None
    mask = torch.cat([torch.zeros(2, dtype=torch.bool), torch.ones(n, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)])
    run = bf16_prefill.prefill_rows(mask)
    assert run.bf16 == slice(2, n + 2) and run.fp32.tolist() == [0, 1, n + 2]
    mask[5] = False
    mask[0] = True
    scattered = bf16_prefill.prefill_rows(mask)
    assert torch.equal(scattered.bf16, mask.nonzero().squeeze(1)) and scattered.fp32.tolist() == [1, 5, n + 2]


@needs_panels
@pytest.mark.parametrize("half", [False, True], ids=["fp32-panels", "fp16-panels"])
def test_copies_hold_the_served_weights_and_rows_split_exactly(half):
    """The bf16 copy is the packed weight as stored, rounded to bf16; in a split step the fp32 rows equal the packed
    GEMM's and the bf16 rows kernels.bf16_linear's, bit for bit."""
    torch.manual_seed(0)
    weight, bias = torch.randn(100, 48), torch.randn(100)  # 100 outputs: a part-filled last panel
    packed = kernels.linear_pack(weight, bias, half=half)
    [[(copy, copy_bias)]] = [list(layer.values()) for layer in bf16_prefill.bf16_copies([{"p": packed}])]
    stored = weight.half().float() if half else weight
    assert torch.equal(copy, stored.to(torch.bfloat16)) and torch.equal(copy_bias, bias)
    x = torch.randn(bf16_prefill.MIN_ROWS + 2, 48)
    mask = torch.ones(len(x), dtype=torch.bool)
    mask[[0, 33]] = False
    rows = bf16_prefill.prefill_rows(mask)
    y = bf16_prefill.linear(x, packed, (copy, copy_bias), rows)
    assert torch.equal(y[rows.fp32], kernels.packed_linear(x[rows.fp32], packed))
    assert torch.equal(y[rows.bf16], kernels.bf16_linear(x[rows.bf16], copy, copy_bias))


def test_bfloat16_is_refused_where_it_cannot_run(monkeypatch):
    """No bf16 units (the fallback on a CPU without them, forced here), CUDA, weights not in panels: ValueError
    naming prefill_dtype; float32 (the default) never builds a copy; an unknown value is refused by the config."""
    assert EngineConfig().prefill_dtype == "float32"
    assert not bf16_prefill.enabled("float32", "cpu", torch.float32, None)
    with pytest.raises(ValueError, match="prefill_dtype must be float32 or bfloat16"):
        EngineConfig(prefill_dtype="auto")
    with pytest.raises(ValueError, match="prefill_dtype bfloat16 is a CPU option"):
        bf16_prefill.enabled("bfloat16", "cuda", torch.bfloat16, None)
    monkeypatch.setattr(bf16_prefill, "cpu_bf16_units", lambda: None)
    with pytest.raises(ValueError, match="prefill_dtype bfloat16: this CPU has no bf16 units"):
        bf16_prefill.enabled("bfloat16", "cpu", torch.float32, [])
    monkeypatch.setattr(bf16_prefill, "cpu_bf16_units", lambda: "amx")
    with pytest.raises(ValueError, match="prefill_dtype bfloat16 needs the native packed GEMM"):
        bf16_prefill.enabled("bfloat16", "cpu", torch.float32, None)


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


@needs_panels
def test_prompt_rows_in_bf16_within_tolerance_and_decode_rows_exact(demo, monkeypatch):
    """A decoding request (its prompt under MIN_ROWS: fp32) beside a long prompt: the step that prefills the long
    prompt splits its rows, the decode row exact against peft, the prompt rows within the bf16 tolerance."""
    monkeypatch.setattr(bf16_prefill, "cpu_bf16_units", lambda: "amx")  # oneDNN's bf16 GEMM runs on any CPU
    splits = []
    rows_of = bf16_prefill.prefill_rows
    monkeypatch.setattr(bf16_prefill, "prefill_rows", lambda mask: splits.append(rows_of(mask)) or splits[-1])
    adapters = {"demo-a": str(demo["demo-a"]), "demo-b": str(demo["demo-b"])}
    engine = LLMEngine(EngineConfig(model_dir=str(demo["model"]), device="cpu", dtype="float32", max_model_len=256,
                                    num_kv_blocks=64, max_loras=2, max_lora_rank=16, multi_lora=adapters,
                                    native_threads=1, prefill_dtype="bfloat16"))
    assert engine.model.prefill_weights is not None
    short = {"short": ("Decoding beside a long prompt", "demo-b")}
    long = {"long-b": ("the quick brown fox jumps over the lazy dog " * 3, "demo-b"),
            "long-base": ("pack my box with five dozen liquor jugs " * 3, None)}
    requests, tokens, logprobs = _run(engine, short, long, max_tokens=8)
    split = [s for s in splits if s is not None]
    assert len(split) == 1 and split[0].fp32 is not None and len(split[0].fp32) == 1, "one step split its rows"
    oracle = lambda lora: (str(demo["model"]), adapters.get(lora))  # noqa: E731
    assert_matches_oracle(oracle, short, requests, tokens, logprobs, "decode row beside bf16 prompt rows",
                          atol=LOGPROB_ATOL)
    for rid, (_, lora) in long.items():
        ref = teacher_forced_logits(*oracle(lora), requests[rid].prompt_token_ids, tokens[rid])
        want = torch.log_softmax(ref, -1).gather(1, torch.tensor(tokens[rid])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs[rid]), want, atol=BF16_LOGPROB_ATOL, rtol=0)
        top2 = ref.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_LOGPROB_ATOL
        assert torch.equal(torch.tensor(tokens[rid])[clear], ref.argmax(-1)[clear]), f"{rid}: greedy tokens differ"
