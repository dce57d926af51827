"""worker/grammar_mask.py: its torch unpacking of xgrammar's bitmask against xgrammar's own apply, its fills on
the fill threads against each matcher's own fill and xgrammar's batched fill, and the matching budget
(worker/grammar_budget.py) read by a scripted clock."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from loraplex.exceptions import InvalidRequest
from loraplex.worker.grammar_budget import BURST_TOKENS, GrammarBudget, RowMatcher
from loraplex.worker.grammar_mask import GrammarMask


class Fixed:
    """A matcher whose next-token bitmask is given (what fill_next_token_bitmask writes into its row)."""

    def __init__(self, words: torch.Tensor, accepts: bool = True):
        self.words, self.accepts, self.accepted = words, accepts, []

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = self.words

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return self.accepts


class Broken(Fixed):
    def fill_next_token_bitmask(self, bitmask, index):
        raise RuntimeError("fill failed")


def ticking(seconds_per_call: float):
    """A clock that moves seconds_per_call at every read (so every timed call costs exactly that)."""
    counter = itertools.count()
    return lambda: next(counter) * seconds_per_call


@pytest.mark.parametrize("vocab", [259, 320, 1000])
def test_the_mask_equals_xgrammars_apply_on_the_rows_it_names(vocab):
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmasks = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [4, 0, 2]
    ours = logits.clone()
    GrammarMask(vocab, "cpu").apply(ours, [(row, RowMatcher(Fixed(bitmasks[i]))) for i, row in enumerate(rows)])
    theirs = logits.clone()
    full = torch.full((5, words), -1, dtype=torch.int32)  # all allowed: rows not named stay as they are
    full[rows] = bitmasks
    xgr.apply_token_bitmask_inplace(theirs, full)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]]) and torch.isinf(ours[rows]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_logits_are_minus_inf_and_the_rest_unchanged_in_every_dtype_held_stops_included(dtype):
    vocab, gen = 100, torch.Generator().manual_seed(1)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    logits[2, 7] = float("-inf")  # a stop token held back below min_tokens
    ours = logits.clone()
    GrammarMask(vocab, "cpu").apply(ours, [(2, RowMatcher(Fixed(bitmask[0]))), (0, RowMatcher(Fixed(bitmask[1])))])
    for row, words in ((2, bitmask[0]), (0, bitmask[1])):
        allowed = [bool(int(words[t // 32]) >> (t % 32) & 1) for t in range(vocab)]
        want = [v if ok else float("-inf") for v, ok in zip(logits[row].tolist(), allowed)]
        assert ours[row].tolist() == want
    assert torch.equal(ours[1], logits[1]) and ours.dtype == dtype


def _vocab() -> list[str]:
    """A small vocabulary: JSON's punctuation, digits, letters and a few words."""
    return ["</s>", *'{}[]:," ', *"0123456789", *"abcdefghij", '"a"', '"name"', "true", "false", "null", "ab", "12"]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_the_threads_fill_what_each_matcher_fills_alone_and_what_xgrammars_batched_fill_does(threads):
    import xgrammar as xgr

    vocab = _vocab()
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        '{"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "array", "items": '
        '{"type": "integer"}}}, "required": ["name", "n"]}')
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(11)]
    rng = random.Random(threads)
    for k, matcher in enumerate(matchers):  # each moved a different number of random allowed tokens
        one = xgr.allocate_token_bitmask(1, len(vocab))
        for _ in range(k * 2):
            matcher.fill_next_token_bitmask(one, 0)
            allowed = [t for t in range(1, len(vocab)) if one[0, t // 32] >> (t % 32) & 1]
            if not allowed:
                break
            assert matcher.accept_token(rng.choice(allowed))
    rows = [(i, RowMatcher(m)) for i, m in enumerate(matchers)]
    ours = GrammarMask(len(vocab), "cpu", threads=threads).fill(rows).wait().clone()
    alone = xgr.allocate_token_bitmask(len(matchers), len(vocab))
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(alone, i)
    batched = xgr.allocate_token_bitmask(len(matchers), len(vocab))
    xgr.BatchGrammarMatcher(max_threads=2).batch_fill_next_token_bitmask(matchers, batched)
    assert torch.equal(ours, alone) and torch.equal(ours, batched)
    assert len({tuple(row.tolist()) for row in ours}) > 3  # the rows differ: each is its own matcher's
    assert all(row.fill_seconds > 0 for _, row in rows)


def test_a_row_over_the_per_token_budget_fails_naming_structured_outputs_and_its_neighbour_does_not():
    mask = GrammarMask(64, "cpu", GrammarBudget(token_ms=10, mean_ms=0, clock=ticking(0.004)))
    cheap, costly = RowMatcher(Fixed(torch.tensor([-1, -1], dtype=torch.int32)), "a"), \
        RowMatcher(Fixed(torch.tensor([-1, -1], dtype=torch.int32)), "b")
    rows = [(0, cheap), (1, costly)]
    mask.fill(rows).wait()
    costly.fill_seconds = 0.009  # with its accept's 4 ms: 13 ms, over 10
    errors: dict[int, Exception] = {}
    mask.advance(rows, [5, 7], [3, 4], errors)
    assert list(errors) == [4] and isinstance(errors[4], InvalidRequest)
    assert str(errors[4]).startswith("structured_outputs: matching the grammar took 13.0 ms for one token, over the "
                                     "budget of 10 ms")
    assert cheap.matcher.accepted == [5] and costly.matcher.accepted == [7]
    assert mask.seconds == pytest.approx({"a": 0.008, "b": 0.013})  # every row's matching, per tenant label


def test_a_fill_already_over_the_budget_skips_the_accept():
    mask = GrammarMask(64, "cpu", GrammarBudget(token_ms=10, mean_ms=0, clock=ticking(0.001)))
    row = RowMatcher(Fixed(torch.tensor([-1, -1], dtype=torch.int32)))
    row.fill_seconds = 0.5
    errors: dict[int, Exception] = {}
    mask.advance([(0, row)], [1], [0], errors)
    assert "500.0 ms for one token" in str(errors[0]) and row.matcher.accepted == []


def test_the_mean_budget_allows_a_burst_then_the_mean():
    budget = GrammarBudget(token_ms=10, mean_ms=1, clock=ticking(0))
    row = RowMatcher(None)
    # 6 ms a token, under the per-token cap: the burst (10 x 10 ms) less 6 ms, then 5 ms net a token, is spent
    # at the 20th token
    assert BURST_TOKENS * 10 == 100
    charged = [budget.charge(row, 0.006) for _ in range(25)]
    first = next(i for i, over in enumerate(charged) if over is not None)
    assert first + 1 == 20
    assert "on average" in str(charged[first]) and str(charged[first]).startswith("structured_outputs: ")
    steady = RowMatcher(None)  # at the mean itself, a row never runs out
    assert all(budget.charge(steady, 0.001) is None for _ in range(10_000))


def test_a_budget_of_zero_is_off():
    budget = GrammarBudget(token_ms=0, mean_ms=0)
    row = RowMatcher(None)
    assert all(budget.charge(row, 5.0) is None for _ in range(100)) and row.seconds == 500.0


def test_a_refused_token_fails_its_row():
    mask = GrammarMask(64, "cpu", GrammarBudget(clock=ticking(0)))
    row = RowMatcher(Fixed(torch.tensor([-1, -1], dtype=torch.int32), accepts=False))
    errors: dict[int, Exception] = {}
    mask.advance([(0, row)], [1], [2], errors)
    assert "does not fit" in str(errors[2]) and str(errors[2]).startswith("structured_outputs: ")


def test_a_fill_that_raises_raises_at_the_wait_and_settle_waits_quietly():
    mask = GrammarMask(64, "cpu", threads=2)
    rows = [(0, RowMatcher(Fixed(torch.tensor([-1, -1], dtype=torch.int32)))), (1, RowMatcher(Broken(None)))]
    filling = mask.fill(rows)
    filling.settle()
    assert all(f.done() for f in filling.futures)
    with pytest.raises(RuntimeError, match="fill failed"):
        filling.wait()


def test_the_engine_knobs_default_to_the_budgets_defaults():
    from loraplex.config import EngineConfig
    from loraplex.worker.grammar_budget import MEAN_BUDGET_MS, TOKEN_BUDGET_MS

    config = EngineConfig()
    assert (config.grammar_token_budget_ms, config.grammar_mean_budget_ms) == (TOKEN_BUDGET_MS, MEAN_BUDGET_MS)
