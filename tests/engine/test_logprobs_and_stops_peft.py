"""Logprobs, stop_token_ids, EOS and min_tokens of the engine, against transformers + peft on the same weights.

The demo model (fp32 on the CPU) and its two adapters. The oracle is peft's own logits:
  - logprobs: log_softmax of the reference's logits at each generated position (teacher-forced on the
    engine's tokens), for the sampled token, its rank and the top-n candidates. vLLM's default: the raw
    model distribution, before temperature and the top-k / top-p masks. Tolerance LOGPROB_ATOL.
  - stops: greedy tokens computed step by step from the reference's logits under vLLM's rules
    (``peft_reference.greedy_with_stops``): a stop id (EOS unless ignore_eos, and stop_token_ids) ends
    generation and is output; while fewer than min_tokens tokens are out, those ids are masked to -inf.
"""

from __future__ import annotations

import pytest
import torch
from peft_reference import greedy_tokens, greedy_with_stops, teacher_forced_logits

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams

# fp32 on both sides: logits agree to ~2e-5 (tests/engine/test_multi_lora.py's LOGIT_ATOL is 1e-4); a
# logprob is a logit minus a logsumexp, so twice that, with room.
LOGPROB_ATOL = 2e-4
TOP_N = 5
MAX_TOKENS = 12
PAIRS = [("Hello there", None), ("The quick brown fox", "demo-a"), ("Tenants", "demo-b")]
EOS_PROMPT = "Once upon a time"  # base model, greedy: three tokens, then EOS (4th token)


@pytest.fixture(scope="module")
def engine(demo):
    adapters = {name: str(demo[name]) for name in ("demo-a", "demo-b")}
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora=adapters))


@pytest.fixture(scope="module")
def paths(demo):
    """(model dir, adapter dir or None) for an adapter name or None."""
    return lambda lora: (str(demo["model"]), str(demo[lora]) if lora else None)


def run(engine: LLMEngine, rid: str, prompt: str, lora: str | None, **params):
    """One request to completion: (prompt ids, tokens, logprob entries, final output)."""
    sampling = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0, "lora_name": lora, **params})
    request = engine.make_request(rid, prompt, sampling)
    outs = engine.generate([request])[rid]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    entries = [e for o in outs for e in (o.logprobs or [])]
    return request.prompt_token_ids, [t for o in outs for t in o.token_ids], entries, outs[-1]


# ---- logprobs -----------------------------------------------------------------------------------


def check_logprobs(tokens, entries, final, ref_logits: torch.Tensor, top_n: int) -> None:
    """Each entry against log_softmax(ref_logits) at its position; the cumulative logprob is their sum."""
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    assert len(entries) == len(tokens) == ref.shape[0]
    total = 0.0
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        want = ref[i]
        got_id, got_lp, got_rank = entry["token"]
        assert got_id == token
        assert abs(got_lp - float(want[token])) <= LOGPROB_ATOL, (i, got_lp, float(want[token]))
        total += float(want[token])
        # rank: 1 + the tokens strictly more likely; exact where no other token is within the tolerance
        above = int((want > want[token] + LOGPROB_ATOL).sum())
        near = int(((want - want[token]).abs() <= LOGPROB_ATOL).sum()) - 1
        assert above + 1 <= got_rank <= above + 1 + near, (i, got_rank, above, near)
        top = entry["top"]
        assert len(top) == top_n
        values, ids = torch.topk(want, top_n)
        for j, (tid, lp) in enumerate(top):
            assert abs(lp - float(values[j])) <= LOGPROB_ATOL, (i, j, lp, float(values[j]))
            assert abs(float(want[tid]) - lp) <= LOGPROB_ATOL, (i, j, tid)  # the id carries that logprob
            gaps = [abs(float(values[j] - values[m])) for m in (j - 1, j + 1) if 0 <= m < top_n]
            if all(g > 2 * LOGPROB_ATOL for g in gaps):
                assert tid == int(ids[j]), (i, j, tid, int(ids[j]))
    assert abs(final.cumulative_logprob - total) <= LOGPROB_ATOL * len(tokens)


@pytest.mark.parametrize("prompt,lora", PAIRS, ids=["base", "demo-a", "demo-b"])
def test_greedy_logprobs_are_log_softmax_of_peft_logits(engine, paths, prompt, lora):
    prompt_ids, tokens, entries, final = run(engine, "lp", prompt, lora, logprobs=TOP_N, ignore_eos=True)
    ref_logits = teacher_forced_logits(*paths(lora), prompt_ids, tokens)
    assert tokens == ref_logits.argmax(-1).tolist()  # greedy: the engine followed peft
    assert all(e["token"][2] == 1 for e in entries)
    check_logprobs(tokens, entries, final, ref_logits, TOP_N)


def test_sampled_logprobs_are_of_the_raw_distribution(engine, paths):
    """With temperature and top-k, logprobs are still of softmax(logits), not of the sampling distribution."""
    prompt, lora = PAIRS[1]
    prompt_ids, tokens, entries, final = run(engine, "lp-sampled", prompt, lora, logprobs=TOP_N, ignore_eos=True,
                                             temperature=1.5, top_k=20, seed=3)
    ref_logits = teacher_forced_logits(*paths(lora), prompt_ids, tokens)
    ranks = [e["token"][2] for e in entries]
    assert all(r <= 20 for r in ranks) and any(r > 1 for r in ranks), ranks  # it sampled, within top-k
    check_logprobs(tokens, entries, final, ref_logits, TOP_N)


def test_logprobs_zero_gives_the_sampled_token_only(engine, paths):
    prompt, lora = PAIRS[2]
    prompt_ids, tokens, entries, final = run(engine, "lp0", prompt, lora, logprobs=0, ignore_eos=True)
    assert all(e["top"] == [] for e in entries)
    check_logprobs(tokens, entries, final, teacher_forced_logits(*paths(lora), prompt_ids, tokens), 0)


# ---- stop_token_ids, EOS, min_tokens ------------------------------------------------------------


def first_new_token(tokens: list[int], eos: int, after: int) -> int:
    """The first index >= after whose token occurs nowhere before it and is not EOS."""
    for j in range(after, len(tokens)):
        if tokens[j] != eos and tokens[j] not in tokens[:j]:
            return j
    raise AssertionError(f"no fresh token after {after} in {tokens}")


@pytest.mark.parametrize("prompt,lora", PAIRS, ids=["base", "demo-a", "demo-b"])
def test_stop_token_ids_end_generation_like_peft(engine, paths, prompt, lora):
    eos = min(engine.eos_token_ids)
    ids = engine.tokenizer(prompt).input_ids
    free = greedy_with_stops(*paths(lora), ids, MAX_TOKENS, set())
    assert free == greedy_tokens(*paths(lora), ids, MAX_TOKENS, ignore_eos=True)  # the oracle's own check
    j = first_new_token(free, eos, 3)
    unused = next(t for t in range(3, 259) if t not in free)
    want = greedy_with_stops(*paths(lora), ids, MAX_TOKENS, {eos, free[j], unused})
    assert want == free[: j + 1]
    _, tokens, _, final = run(engine, "stop-ids", prompt, lora, stop_token_ids=[unused, free[j]])
    assert tokens == want
    assert final.finish_reason == "stop"


def test_eos_ends_generation_like_peft_and_ignore_eos_does_not(engine, paths):
    eos = min(engine.eos_token_ids)
    ids = engine.tokenizer(EOS_PROMPT).input_ids
    want = greedy_with_stops(*paths(None), ids, MAX_TOKENS, {eos})
    assert len(want) < MAX_TOKENS and want[-1] == eos  # the premise: greedy meets EOS early
    _, tokens, _, final = run(engine, "eos", EOS_PROMPT, None)
    assert (tokens, final.finish_reason) == (want, "stop")
    _, tokens, _, final = run(engine, "no-eos", EOS_PROMPT, None, ignore_eos=True)
    assert (tokens, final.finish_reason) == (greedy_with_stops(*paths(None), ids, MAX_TOKENS, set()), "length")
    # ignore_eos leaves stop_token_ids in force, EOS among them
    _, tokens, _, final = run(engine, "eos-as-stop-id", EOS_PROMPT, None, ignore_eos=True, stop_token_ids=[eos])
    assert (tokens, final.finish_reason) == (want, "stop")


def stop_cases(engine, paths):
    """(name, prompt, lora, stop_token_ids, index where greedy first meets a stop id) for EOS and a stop id."""
    eos = min(engine.eos_token_ids)
    ids = engine.tokenizer(EOS_PROMPT).input_ids
    at_eos = greedy_with_stops(*paths(None), ids, MAX_TOKENS, {eos})
    prompt, lora = PAIRS[1]
    free = greedy_with_stops(*paths(lora), engine.tokenizer(prompt).input_ids, MAX_TOKENS, set())
    j = first_new_token(free, eos, 2)
    return [("eos", EOS_PROMPT, None, [], len(at_eos) - 1), ("stop-id", prompt, lora, [free[j]], j)]


def test_min_tokens_up_to_the_stop_lets_it_end_generation(engine, paths):
    """min_tokens <= the stop's index: the stop id is allowed where greedy meets it, as in peft."""
    eos = min(engine.eos_token_ids)
    for name, prompt, lora, stop_ids, at in stop_cases(engine, paths):
        ids = engine.tokenizer(prompt).input_ids
        for min_tokens in (1, at):
            want = greedy_with_stops(*paths(lora), ids, MAX_TOKENS, {eos, *stop_ids}, min_tokens)
            assert len(want) == at + 1
            _, tokens, _, final = run(engine, f"min-{name}", prompt, lora, stop_token_ids=stop_ids,
                                      min_tokens=min_tokens)
            assert (tokens, final.finish_reason) == (want, "stop"), (name, min_tokens)


def test_min_tokens_past_the_stop_never_ends_generation_early(engine, paths):
    """min_tokens = the stop's index + 2: at least min_tokens tokens come out, the first `at` as in peft (the
    stop id at index `at` may not end generation under either reading of min_tokens: masked or only not honoured)."""
    eos = min(engine.eos_token_ids)
    for name, prompt, lora, stop_ids, at in stop_cases(engine, paths):
        ids = engine.tokenizer(prompt).input_ids
        min_tokens = at + 2
        want = greedy_with_stops(*paths(lora), ids, MAX_TOKENS, {eos, *stop_ids}, min_tokens)
        assert len(want) >= min_tokens
        _, tokens, _, _ = run(engine, f"min-past-{name}", prompt, lora, stop_token_ids=stop_ids,
                              min_tokens=min_tokens)
        assert len(tokens) >= min_tokens, (name, tokens)
        assert tokens[:at] == want[:at], name


@pytest.mark.parametrize("extra", [1, 3], ids=["min-at-stop+1", "min-at-stop+3"])
def test_min_tokens_masks_stop_ids_like_peft(engine, paths, extra):
    """vLLM: while fewer than min_tokens tokens are out, EOS and stop_token_ids cannot be sampled."""
    eos = min(engine.eos_token_ids)
    for name, prompt, lora, stop_ids, at in stop_cases(engine, paths):
        ids = engine.tokenizer(prompt).input_ids
        want = greedy_with_stops(*paths(lora), ids, MAX_TOKENS, {eos, *stop_ids}, at + extra)
        _, tokens, _, _ = run(engine, f"min-mask-{name}", prompt, lora, stop_token_ids=stop_ids,
                              min_tokens=at + extra)
        assert tokens == want, (name, tokens, want)
