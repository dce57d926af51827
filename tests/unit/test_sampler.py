"""Sampling: greedy, top-k, top-p, seeds and logprobs on hand-made logits."""

import torch

from loraplex.engine.request import SamplingParams
from loraplex.worker.sampler import make_generator, sample, token_logprobs

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


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    p, other = params(temperature=1.5, seed=11), params(temperature=1.0, top_k=3, top_p=0.9)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))

    def draws(batch_rows):
        gen, out = make_generator(p, 0, "cpu"), []
        for _ in range(8):  # eight steps of one sequence
            rows = [logits[0]] + [logits[r] for r in batch_rows]
            out.append(sample(torch.stack(rows), [p] + [other] * len(batch_rows), [gen] + [None] * len(batch_rows))[0])
        return out

    alone = draws([])
    assert draws([1, 2, 3]) == alone and draws([5]) == alone
    assert len(set(alone)) > 1  # it does sample


def test_rows_of_different_kinds_in_one_batch():
    logits = LOGITS.repeat(4, 1)
    kinds = [params(temperature=0), params(top_k=1, temperature=1.0), params(temperature=1.0, top_p=0.4),
             params(temperature=1.0, top_k=2)]
    for _ in range(30):
        greedy, top1, top_p, top2 = sample(logits, kinds, [None] * 4)
        assert (greedy, top1, top_p) == (1, 1, 1) and top2 in (1, 2)


def test_a_zero_probability_token_is_never_drawn():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0]])
    p = params(temperature=1.0)
    assert {sample(logits, [p], [None])[0] for _ in range(200)} == {1, 3}
