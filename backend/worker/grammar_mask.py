"""Structured outputs in the step: each constrained row's allowed next tokens, as xgrammar's bitmask, set on
its logits before sampling; then each row's matcher advances by the token it sampled.

A row's bitmask is filled by its matcher in one native call (no loop over the vocabulary in Python);
the bits are unpacked and applied by a few torch ops over all constrained rows at once, on the device
the logits are on (CPU or CUDA alike).
"""

from __future__ import annotations

import torch

from loraplex.exceptions import InvalidRequest

BITS = 32  # xgrammar's bitmask: int32 words, bit j of word w allows token 32 * w + j


class GrammarMask:
    """The host bitmask buffer (reused step after step) and the bit shifts, for logits [rows, vocab_size]."""

    def __init__(self, vocab_size: int, device):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.words = -(-vocab_size // BITS)
        self._host = torch.zeros(0, self.words, dtype=torch.int32)
        self._shifts = torch.arange(BITS, dtype=torch.int32, device=self.device)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, object]]) -> None:
        """Each (row, matcher): logits[row, t] = -inf for every token t its grammar does not allow next."""
        n = len(rows)
        if len(self._host) < n:
            self._host = torch.zeros(n, self.words, dtype=torch.int32)
        bitmask = self._host[:n]
        for i, (_, matcher) in enumerate(rows):
            matcher.fill_next_token_bitmask(bitmask, i)
        words = bitmask.to(self.device)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(n, -1)[:, : logits.shape[1]].bool()
        index = torch.tensor([row for row, _ in rows], dtype=torch.int64, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def advance(rows: list[tuple[int, object]], tokens: list[int], sample_seqs: list[int],
            errors: dict[int, Exception]) -> None:
    """Each constrained row's matcher takes the token it sampled; a token its grammar refuses (never expected:
    the mask allowed only grammar tokens) fails that row's request."""
    for row, matcher in rows:
        if not matcher.accept_token(tokens[row]):
            errors[sample_seqs[row]] = InvalidRequest("the sampled token does not fit the request's structured output")
