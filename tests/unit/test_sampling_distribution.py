"""The sampler's draws follow softmax(logits / T) after the top-k and top-p masks (vLLM semantics).

The oracle is written here in numpy float64 from the definitions, not from the sampler's helpers:
  - temperature: z = logits / T;
  - top-k (k > 0 and k < V): keep the k largest z;
  - top-p (p < 1), on the distribution renormalized over what top-k kept: keep the smallest set of
    most likely tokens whose probability reaches p, i.e. a token is kept when the mass of the tokens
    more likely than it is below p; the most likely token is always kept;
  - the draw is from softmax(z) over the kept tokens; other tokens have probability 0.

Each case draws DRAWS tokens (fixed seeds: the test is deterministic) and a chi-square goodness-of-fit
test must not reject the oracle at ALPHA = 1e-6 (bins with an expected count below 5 are pooled).
A token outside the kept set must never be drawn. So that a pass means something, the same counts
must reject the distribution at 1.25 x the temperature (a quarter off) at that level too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.engine.request import SamplingParams
from loraplex.worker.sampler import make_generator, sample

ALPHA = 1e-6  # significance: a correct sampler fails a case with probability 1e-6
DRAWS = 40_000
VOCAB = 64
MIN_EXPECTED = 5.0  # chi-square's usual rule: bins expected below this are pooled into one

# (temperature, top_k, top_p); -1 / 1.0 = off
CASES = [
    (1.0, -1, 1.0),  # plain softmax
    (0.5, -1, 1.0),  # sharper
    (1.7, 10, 1.0),  # top-k alone
    (0.8, -1, 0.75),  # top-p alone
    (1.3, 12, 0.6),  # top-p over the top-k distribution, renormalized
    (2.0, 40, 0.9),  # both, loose
]


def oracle(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Probabilities [V] of each token under the definitions above (float64)."""
    z = logits.astype(np.float64) / temperature
    vocab = z.shape[0]
    keep = np.ones(vocab, dtype=bool)
    if 0 < top_k < vocab:
        keep[:] = False
        keep[np.argsort(-z, kind="stable")[:top_k]] = True
    if top_p < 1.0:
        p = _softmax(z, keep)
        order = np.argsort(-p, kind="stable")
        more_likely = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])  # mass of the tokens ranked before
        needed = more_likely < top_p
        needed[0] = True  # at least one token
        keep[:] = False
        keep[order[needed]] = True
    return _softmax(z, keep)


def _softmax(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return e / e.sum()


def top_p_margin(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """How far the top-p cut is from a tie: the smallest |mass before a kept-or-next token - p|."""
    if top_p >= 1.0:
        return 1.0
    p = oracle(logits, temperature, top_k, 1.0)
    mass = np.concatenate([[0.0], np.cumsum(np.sort(p)[::-1])[:-1]])
    return float(np.abs(mass - top_p).min())


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of Pearson's chi-square test of counts against probs (0 when a zero-probability bin was drawn)."""
    if counts[probs == 0].any():
        return 0.0
    n = counts.sum()
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs = list(counts[big]) + ([counts[~big & (probs > 0)].sum()] if (~big & (probs > 0)).any() else [])
    exp = list(expected[big]) + ([expected[~big & (probs > 0)].sum()] if (~big & (probs > 0)).any() else [])
    obs, exp = np.asarray(obs, np.float64), np.asarray(exp, np.float64)
    if exp.size < 2:  # one bin: the counts are all in it (checked above)
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = exp.size - 1
    # chi-square survival function: the regularized upper incomplete gamma Q(dof / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def case_logits(seed: int) -> np.ndarray:
    """Distinct fp32 logits (no ties), spread enough that top-k and top-p cut somewhere interesting."""
    return (np.random.default_rng(seed).standard_normal(VOCAB) * 2.0).astype(np.float32)


def params(temperature: float, top_k: int, top_p: float, seed: int | None = None) -> SamplingParams:
    return SamplingParams.from_dict({"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed})


def counts_of(tokens: list[int]) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=VOCAB)


def check(counts: np.ndarray, logits: np.ndarray, case: tuple) -> None:
    want = oracle(logits, *case)
    assert counts.sum() > 0
    outside = np.flatnonzero((want == 0) & (counts > 0))
    assert outside.size == 0, f"{case}: drew tokens outside the kept set: {outside.tolist()}"
    kept = int((want > 0).sum())
    assert kept >= 2, f"{case}: the case keeps one token, a chi-square test says nothing"
    p = chi_square_p(counts, want)
    assert p >= ALPHA, f"{case}: chi-square rejects softmax(logits / T) after the masks, p = {p:.3g}"
    temperature, top_k, top_p = case
    off = chi_square_p(counts, oracle(logits, temperature * 1.25, top_k, top_p))
    assert off < ALPHA, f"{case}: no power: the counts do not reject T x 1.25 either (p = {off:.3g})"


def test_draws_of_a_mixed_batch_follow_the_masked_softmax():
    """All cases in one batch, rows interleaved, so each row must get its own T, top_k and top_p."""
    logits = [case_logits(100 + i) for i in range(len(CASES))]
    for i, case in enumerate(CASES):
        assert top_p_margin(logits[i], *case) > 1e-3, case  # fp32 vs fp64 cannot move the cut
    batch = torch.from_numpy(np.stack(logits)).repeat(DRAWS, 1)  # row r is case r % len(CASES)
    rows = [params(*case) for case in CASES] * DRAWS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        tokens = sample(batch, rows, [None] * len(rows))
    for i, case in enumerate(CASES):
        check(counts_of(tokens[i :: len(CASES)]), logits[i], case)


def test_seeded_draws_follow_the_masked_softmax():
    """Rows with their own generators (seed + sample index, as n > 1 samples) draw from the same law."""
    case, draws = (0.9, 20, 0.85), 10_000
    logits = case_logits(8)
    assert top_p_margin(logits, *case) > 1e-3
    p = params(*case, seed=2024)
    generators = [make_generator(p, i, "cpu") for i in range(draws)]
    tokens = sample(torch.from_numpy(logits).repeat(draws, 1), [p] * draws, generators)
    check(counts_of(tokens), logits, case)


@pytest.mark.parametrize("case", [(0.7, -1, 0.2), (1.5, 5, 0.05), (3.0, 1, 1.0)], ids=["top-p-one", "k5-p-one", "k1"])
def test_a_cut_that_keeps_one_token_always_draws_the_argmax(case):
    """top_p below the most likely token's probability (or top_k = 1) keeps exactly that token."""
    logits = case_logits(11)
    want = oracle(logits, *case)
    assert (want > 0).sum() == 1 and want.argmax() == logits.argmax()
    draws = 2_000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        tokens = sample(torch.from_numpy(logits).repeat(draws, 1), [params(*case)] * draws, [None] * draws)
    assert set(tokens) == {int(logits.argmax())}


def test_the_oracle_is_what_it_says():
    """Hand-checked values: the oracle's top-p keeps the token that crosses p, and top-p sees top-k's renormalization."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64)).astype(np.float32)
    assert np.allclose(oracle(logits, 1.0, -1, 0.6), [0.5 / 0.8, 0.3 / 0.8, 0, 0])  # 0.5 < 0.6: the 0.3 is needed
    assert np.allclose(oracle(logits, 1.0, -1, 0.5), [1, 0, 0, 0])  # 0.5 reaches 0.5
    assert np.allclose(oracle(logits, 1.0, 2, 0.6), [1, 0, 0, 0])  # after top-2: 0.625 >= 0.6
    assert np.allclose(oracle(logits, 1.0, -1, 0.01), [1, 0, 0, 0])
    assert chi_square_p(np.array([500, 300, 150, 50]), oracle(logits, 1.0, -1, 1.0)) > 0.99
    assert chi_square_p(np.array([600, 250, 100, 50]), oracle(logits, 1.0, -1, 1.0)) < ALPHA
