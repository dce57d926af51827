"""worker/grammar_mask.py's torch unpacking of xgrammar's bitmask against xgrammar's own apply."""

from __future__ import annotations

import pytest
import torch

from loraplex.worker.grammar_mask import GrammarMask


class Fixed:
    """A matcher whose next-token bitmask is given (what fill_next_token_bitmask writes into its row)."""

    def __init__(self, words: torch.Tensor):
        self.words = words

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = self.words


@pytest.mark.parametrize("vocab", [259, 320, 1000])
def test_the_mask_equals_xgrammars_apply_on_the_rows_it_names(vocab):
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmasks = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [4, 0, 2]
    ours = logits.clone()
    GrammarMask(vocab, "cpu").apply(ours, [(row, Fixed(bitmasks[i])) for i, row in enumerate(rows)])
    theirs = logits.clone()
    full = torch.full((5, words), -1, dtype=torch.int32)  # all allowed: rows not named stay as they are
    full[rows] = bitmasks
    xgr.apply_token_bitmask_inplace(theirs, full)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]]) and torch.isinf(ours[rows]).any()
