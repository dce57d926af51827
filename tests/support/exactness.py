"""Greedy requests through an engine, checked against a teacher-forced oracle (transformers + peft, or merged
weights): the tokens equal its argmax, each chosen token's logprob equal to its log-softmax within a tolerance."""

from __future__ import annotations

import os

import torch
from peft_reference import teacher_forced_logits

LOGPROB_ATOL = 2e-4  # fp32 throughout; the sums run in another order than torch's
# The device the exactness tests' engines run on: the CPU here; `cuda` in benchmarks/gpu_session.sh's exact_paths
# stage, where the same tests check each GPU path against the same oracle (which always runs on the CPU)
ENGINE_DEVICE = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu")


def run_greedy_logprobs(engine, batch: dict[str, tuple[str, str | None]], max_tokens: int):
    """Requests (id -> (prompt, adapter or None)), greedy with ignore_eos, stepped to the end together:
    (id -> Request, id -> tokens, id -> each token's logprob). An output with an error fails the test."""
    from loraplex.engine.request import SamplingParams

    requests = {}
    for rid, (prompt, lora) in batch.items():
        params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0}
        requests[rid] = engine.make_request(rid, prompt, SamplingParams.from_dict(
            params | ({"lora_name": lora} if lora else {})), "t")
        engine.add_request(requests[rid])
    tokens, logprobs = {rid: [] for rid in batch}, {rid: [] for rid in batch}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
            logprobs[out.request_id] += [entry["token"][1] for entry in out.logprobs or []]
    return requests, tokens, logprobs


def assert_matches_oracle(oracle, batch, requests, tokens, logprobs, what: str, atol: float = LOGPROB_ATOL) -> None:
    """Each request against oracle(adapter or None) -> (model dir, adapter dir or None), teacher-forced."""
    for rid, (_, lora) in batch.items():
        ref = teacher_forced_logits(*oracle(lora), requests[rid].prompt_token_ids, tokens[rid])
        assert tokens[rid] == ref.argmax(-1).tolist(), f"{what} {rid}: greedy tokens differ from the oracle"
        want = torch.log_softmax(ref, -1).gather(1, torch.tensor(tokens[rid])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs[rid]), want, atol=atol, rtol=0,
                                   msg=lambda m, rid=rid: f"{what} {rid}: {m}")
