"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, and logprobs."""

from __future__ import annotations

import torch

from .request import SamplingParams


def make_generator(params: SamplingParams, index: int, device) -> torch.Generator | None:
    """A private generator for a seeded sample (seed + sample index); None uses the global one."""
    if params.seed is None or params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((params.seed + index) % (1 << 64))  # any int64 seed, any sample index
    return gen


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        beyond = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.clone()
        logits[order[beyond]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token id per row of logits [B, V] (fp32)."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        row_logits = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row_logits, dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generators[row]))
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: list[int]) -> tuple[list[float], list]:
    """Log-probability of each chosen token, and the top-n candidates per row (n=0: none)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    tops = []
    for row, n in enumerate(top_n):
        if n is None:
            tops.append(None)
            continue
        values, ids = torch.topk(logp[row], max(n, 0)) if n > 0 else (torch.empty(0), torch.empty(0, dtype=torch.long))
        rank = int((logp[row] > logp[row, tokens[row]]).sum()) + 1
        tops.append({"token": (tokens[row], chosen[row], rank), "top": list(zip(ids.tolist(), values.tolist()))})
    return chosen, tops
