"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, and logprobs, vectorized over rows."""

from __future__ import annotations

import numpy as np
import torch

from loraplex import kernels
from loraplex.engine.request import SamplingParams


def make_generator(params: SamplingParams, index: int, device) -> torch.Generator | None:
    """A private generator for a seeded sample (seed + sample index); None uses the global one."""
    if params.seed is None or params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((params.seed + index) % (1 << 64))  # any int64 seed, any sample index
    return gen


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _filter_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties with the k-th kept); k <= 0 or >= V keeps all."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if min(ks) == vocab:
        return logits
    largest = torch.topk(logits, max(ks), dim=-1).values
    kth = largest.gather(1, torch.tensor(ks, device=logits.device)[:, None] - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches top_p."""
    if min(top_p) >= 1.0:
        return logits
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    beyond = probs.cumsum(-1) - probs > _column(top_p, probs)
    return logits.scatter(1, order, ordered.masked_fill(beyond, float("-inf")))


def _uniforms(generators: list, like: torch.Tensor) -> torch.Tensor:
    """One uniform draw per row: a seeded row draws from its own generator, so its samples
    do not depend on which other rows share the batch; the others share one global draw."""
    u = torch.rand(len(generators), device=like.device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(1, generator=gen, device=gen.device)[0]
    return u


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list,
                  random_rows: list[int] | None = None, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """sample() as an int64 tensor [B] on the logits' device; random_rows: the rows not greedy, if known;
    greedy: each row's argmax, if known (kernels.argmax_rows)."""
    tokens = kernels.argmax_rows(logits)[0] if greedy is None else greedy
    rows = [r for r, p in enumerate(params) if not p.greedy] if random_rows is None else random_rows
    if rows:
        picked = [params[r] for r in rows]
        chosen = logits[rows] / _column([p.temperature for p in picked], logits)
        chosen = _filter_top_p(_filter_top_k(chosen, [p.top_k for p in picked]), [p.top_p for p in picked])
        cdf = torch.softmax(chosen, dim=-1).cumsum(-1)
        target = _uniforms([generators[r] for r in rows], cdf)[:, None] * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # right: never a p=0 token
        tokens[rows] = drawn.squeeze(1)
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token id per row of logits [B, V] (fp32): argmax for greedy rows, else a draw from the
    filtered distribution (temperature, top-k, top-p), all random rows at once (inverse CDF)."""
    return sample_tokens(logits, params, generators).tolist()


def token_logprobs(logits: torch.Tensor, tokens: list[int] | torch.Tensor,
                   top_n: list[int | None]) -> tuple[list[float], list]:
    """Log-probability of each chosen token, and the top-n candidates per row (None: not asked). Everything is
    computed where the logits are and read back in one transfer (on CUDA: one wait for the device)."""
    if isinstance(tokens, torch.Tensor):
        ids = tokens[:, None]
    else:
        ids = torch.tensor(tokens, device=logits.device)[:, None]
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen_logits = logits.gather(1, ids)
    parts = [(chosen_logits - norm).squeeze(1)]
    asked = [r for r, n in enumerate(top_n) if n is not None]
    k = max((top_n[r] for r in asked), default=0)
    if asked:
        index = torch.from_numpy(np.asarray(asked, np.int64)).to(logits.device, non_blocking=True)
        rows = logits.index_select(0, index)
        values, top_ids = torch.topk(rows, k, dim=-1)  # k = 0: empty
        ranks = (rows > chosen_logits.index_select(0, index)).sum(-1) + 1
        parts += [ids.squeeze(1), (values - norm.index_select(0, index)).flatten(), top_ids.flatten(), ranks]
    flat = torch.cat([p.double() for p in parts]).tolist()  # ids, ranks < 2**53: exact as float64
    batch, width = len(top_n), len(asked) * k
    chosen, tops = flat[:batch], [None] * batch
    if asked:
        token_ids, top_logp = flat[batch: 2 * batch], flat[2 * batch: 2 * batch + width]
        top_ids, ranks = flat[2 * batch + width: 2 * batch + 2 * width], flat[2 * batch + 2 * width:]
        for j, r in enumerate(asked):
            top = [(int(top_ids[j * k + i]), top_logp[j * k + i]) for i in range(top_n[r])]
            tops[r] = {"token": (int(token_ids[r]), chosen[r], int(ranks[j])), "top": top}
    return chosen, tops
