"""StepArrays.build (a step's model inputs) against a per-token reference, decode and prefill steps; sampler fast paths."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loraplex.worker.step_arrays import StepArrays
from loraplex.engine.request import SamplingParams
from loraplex.worker.sampler import make_generator, sample, sample_tokens, token_logprobs

BS = 4


def seq(tokens, computed):
    return SimpleNamespace(token_ids=list(tokens), num_computed_tokens=computed)


def batch(seqs, counts, tables):
    return SimpleNamespace(seqs=seqs, num_new_tokens=counts, block_tables=tables)


def reference(b):
    """One token at a time, as the definition reads."""
    ids, positions, slots, cu, sampled = [], [], [], [0], []
    width = max(len(t) for t in b.block_tables)
    for i, (s, n, table) in enumerate(zip(b.seqs, b.num_new_tokens, b.block_tables)):
        for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
            ids.append(s.token_ids[p])
            positions.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        cu.append(cu[-1] + n)
        if s.num_computed_tokens + n == len(s.token_ids):
            sampled.append(i)
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots, "cu": cu,
            "block_tables": [t + [0] * (width - len(t)) for t in b.block_tables],
            "context_lens": [s.num_computed_tokens + n for s, n in zip(b.seqs, b.num_new_tokens)],
            "sample_seqs": sampled, "sample_rows": [cu[i + 1] - 1 for i in sampled]}


DTYPES = {"input_ids": np.int64, "positions": np.int64, "slot_mapping": np.int64, "block_tables": np.int32,
          "context_lens": np.int32, "cu": np.int32, "sample_rows": np.int64, "sample_seqs": np.int64}


def check(b, is_decode):
    got, want = StepArrays.build(b, BS), reference(b)
    assert got.is_decode is is_decode
    for name, dtype in DTYPES.items():
        array = getattr(got, name)
        assert array.dtype == dtype, name
        assert array.tolist() == want[name], name


def test_decode_with_tables_of_different_lengths():
    seqs = [seq(range(10, 16), 5), seq(range(20, 29), 8), seq(range(30, 34), 3)]
    check(batch(seqs, [1, 1, 1], [[7, 2], [5, 9, 11], [4]]), True)


def test_decode_with_tables_of_one_length():
    seqs = [seq(range(10, 16), 5), seq(range(20, 27), 6)]
    check(batch(seqs, [1, 1], [[7, 2], [5, 9]]), True)


def test_decode_step_with_a_one_token_prompt_chunk_not_sampled():
    seqs = [seq(range(10, 16), 5), seq(range(20, 29), 3), seq(range(30, 34), 3)]  # the middle one has 6 to go
    b = batch(seqs, [1, 1, 1], [[7, 2], [5, 9, 11], [4]])
    check(b, True)
    assert StepArrays.build(b, BS).sample_seqs.tolist() == [0, 2]


def test_prefill_and_decode_mixed():
    seqs = [seq(range(10, 16), 5), seq(range(20, 29), 2), seq(range(30, 40), 0)]
    check(batch(seqs, [1, 7, 4], [[7, 2], [5, 9, 11], [4, 6, 8]]), False)  # the last is a chunk: not sampled


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fast_argmax_and_fused_logprobs_match_torch(rows):
    torch.manual_seed(rows)
    logits = torch.randn(rows, 300)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first wins
    greedy = [SamplingParams.from_dict({"temperature": 0})] * rows
    tokens = sample_tokens(logits, greedy, [None] * rows)
    assert tokens.tolist() == torch.argmax(logits, dim=-1).tolist() and tokens[0] == 7
    chosen, tops = token_logprobs(logits, tokens, [None] * rows)
    want = (logits.gather(1, tokens[:, None]) - torch.logsumexp(logits, -1, keepdim=True)).squeeze(1).tolist()
    assert chosen == want and tops == [None] * rows
    assert token_logprobs(logits, tokens.tolist(), [2] * rows) == token_logprobs(logits, tokens, [2] * rows)


def test_seeded_rows_draw_from_their_own_generator_among_greedy_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    seeded = SamplingParams.from_dict({"temperature": 1.0, "seed": 3})
    greedy = SamplingParams.from_dict({"temperature": 0})
    alone = sample(logits[2:3], [seeded], [make_generator(seeded, 0, "cpu")])
    mixed = sample(logits, [greedy, greedy, seeded, greedy], [None, None, make_generator(seeded, 0, "cpu"), None])
    assert mixed[2] == alone[0]
    assert [mixed[0], mixed[1], mixed[3]] == torch.argmax(logits, -1)[[0, 1, 3]].tolist()


def decode_batch(seqs, tables, num_updates, allocated=(), forks=()):
    return SimpleNamespace(seqs=list(seqs), num_new_tokens=[1] * len(seqs), block_tables=tables, forks=list(forks),
                           num_updates=num_updates, allocated=list(allocated), num_padding=0)


class Loop:
    """The scheduler's side of decode steps: new blocks, the update count, tokens applied."""

    def __init__(self, seed):
        self.rng, self.num_updates = np.random.default_rng(seed), 0

    def run(self, seqs, tables, inputs, steps, change=lambda step, tables: [], commit=True, apply=True):
        """Decode `steps` steps; each step's arrays equal a rebuild's; returns whether each repeated.
        change(step, tables) edits tables and returns the rows it changed; commit=False: never sampled
        (the forward raised); apply=False: sampled, the tokens never applied (update raised)."""
        repeats = []
        for step in range(steps):
            allocated = []
            for i, (s, table) in enumerate(zip(seqs, tables)):
                if s.num_computed_tokens // BS >= len(table):
                    table.append(int(self.rng.integers(100, 999)))  # the scheduler's new block
                    allocated.append(i)
            allocated += change(step, tables)
            b = decode_batch(seqs, [list(t) for t in tables], self.num_updates, allocated)
            got, plans = inputs.build(b)
            repeated = plans is not None
            want = StepArrays.build(b, BS)
            for name in DTYPES:
                assert getattr(got, name).tolist() == getattr(want, name).tolist(), (step, name)
            repeats.append(repeated)
            if not commit:
                continue
            sampled = self.rng.integers(3, 300, len(seqs))
            inputs.sampled(sampled, ("lora plan", "sampling rows"))
            if not apply:
                continue
            for s, token in zip(seqs, sampled.tolist()):  # the scheduler's update
                s.token_ids.append(token)
                s.num_computed_tokens += 1
            self.num_updates += 1
        return repeats


def test_repeated_decode_equals_a_rebuild_across_new_blocks_and_copy_on_write():
    from loraplex.worker.step_arrays import RepeatedDecode

    seqs = [seq(range(10, 10 + n), n - 1) for n in (3, 4, 5, 9)]  # one token each to decode
    tables = [[1], [2], [3, 4], [5, 6, 7]]

    def copy_on_write(step, tables):
        if step == 5:
            tables[1][-1] = 777  # its last block copied before the write
            return [1]
        return []

    repeats = Loop(0).run(seqs, tables, RepeatedDecode(BS), 12, copy_on_write)
    assert repeats == [False] + [True] * 11


def test_repeated_decode_rebuilds_when_the_batch_changes_or_its_tokens_were_not_applied():
    from loraplex.worker.step_arrays import RepeatedDecode

    loop, inputs = Loop(1), RepeatedDecode(BS)
    seqs = [seq(range(10, 14), 3), seq(range(20, 26), 5)]
    tables = [[1], [2, 3]]
    assert loop.run(seqs, tables, inputs, 3) == [False, True, True]
    assert loop.run(seqs[::-1], tables[::-1], inputs, 2) == [False, True]  # reordered
    seqs.append(seq(range(30, 33), 2))
    tables.append([9])
    assert loop.run(seqs, tables, inputs, 2) == [False, True]  # one more
    assert loop.run(seqs, tables, inputs, 1, commit=False) == [True]  # built, never sampled:
    assert loop.run(seqs, tables, inputs, 2) == [False, True]  # rebuilt
    assert loop.run(seqs, tables, inputs, 1, apply=False) == [True]  # sampled, its tokens never applied:
    assert loop.run(seqs, tables, inputs, 2) == [False, True]  # rebuilt
    assert loop.run(seqs[:2], tables[:2], inputs, 1) == [False]
    b = decode_batch(seqs[:2], [list(t) for t in tables[:2]], loop.num_updates, forks=[(0, seqs[2])])
    assert not inputs.build(b)[1]  # a batch that forks samples is built afresh


def test_a_prefill_takes_the_decode_form_up_to_a_mean_context(monkeypatch):
    # model_runner: a step's prompt rows run as decode rows while they attend to ROWS_FORM_MAX_MEAN_CONTEXT keys
    # each on average; decode rows (one new token) do not count
    from loraplex.worker import model_runner

    monkeypatch.setattr(model_runner, "ROWS_FORM_MAX_MEAN_CONTEXT", 100)

    def step(counts, starts):
        positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
        return SimpleNamespace(cu=np.concatenate(([0], np.cumsum(counts))).astype(np.int32), positions=positions)

    assert model_runner._prompt_rows_fit(step([199, 1], [0, 5000]))  # 1..199 keys: 100 on average
    assert not model_runner._prompt_rows_fit(step([201, 1], [0, 0]))  # 101
    assert not model_runner._prompt_rows_fit(step([2], [150]))  # a chunk after 150 cached tokens: 151.5
