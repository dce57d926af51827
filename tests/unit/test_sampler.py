"""Sampling: greedy, top-k, top-p, seeds and logprobs on hand-made logits."""

import torch

from loraplex.request import SamplingParams
from loraplex.sampler import make_generator, sample, token_logprobs

LOGITS = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])


def params(**kw):
    return SamplingParams.from_dict(kw)


def test_greedy_and_top_k_one_take_the_argmax():
    assert sample(LOGITS, [params(temperature=0)], [None]) == [1]
    assert sample(LOGITS, [params(top_k=1)], [None]) == [1]


def test_top_k_and_top_p_keep_only_their_candidates():
    for seed in range(50):
        p = params(temperature=1.0, top_k=2, seed=seed)
        assert sample(LOGITS, [p], [make_generator(p, 0, "cpu")])[0] in (1, 2)
        p = params(temperature=1.0, top_p=0.4, seed=seed)  # token 1 alone holds 47% of the mass
        assert sample(LOGITS, [p], [make_generator(p, 0, "cpu")])[0] == 1


def test_seed_reproduces_and_sample_index_varies():
    p = params(temperature=2.0, seed=7)
    draws = [sample(LOGITS, [p], [make_generator(p, 0, "cpu")])[0] for _ in range(5)]
    assert len(set(draws)) == 1
    per_index = {tuple(sample(LOGITS.repeat(20, 1), [p] * 20, [make_generator(p, i, "cpu")] * 20)) for i in range(3)}
    assert len(per_index) == 3


def test_logprobs_rank_and_top_candidates():
    chosen, tops = token_logprobs(LOGITS, [2], [2])
    expected = torch.log_softmax(LOGITS[0], -1)
    assert abs(chosen[0] - float(expected[2])) < 1e-6
    token_id, logprob, rank = tops[0]["token"]
    assert (token_id, rank) == (2, 2)
    assert [t for t, _ in tops[0]["top"]] == [1, 2]
    assert token_logprobs(LOGITS, [1], [None])[1] == [None]
