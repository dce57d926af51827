"""Quotas through the real engine (demo model): the tokens_per_minute reservation is given back on every end
path, the queue share refuses only the flooder, concurrency counts sequences, the prompt byte bound."""

from __future__ import annotations

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.exceptions import InvalidRequest, QueueFull, RequestCancelled
from loraplex.engine.request import SamplingParams
from loraplex.tenancy.tenants import Tenant

PROMPT = "quota"  # 5 bytes + BOS: 6 prompt tokens
TPM = 10_000


@pytest.fixture(scope="module")
def engine(demo):
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), max_num_seqs=4, max_waiting_requests=8))


def tenant(name="acme", **quotas) -> Tenant:
    return Tenant(name, b"k-" + name.encode(), queue_fraction=0.5, **{"tokens_per_minute": TPM, **quotas})


def add(engine, request_id, params, limits=None, prompt=PROMPT):
    limits = limits or tenant()
    request = engine.make_request(request_id, prompt, params, limits.name, limits)
    engine.add_request(request)
    return request


def run(engine) -> dict:
    outputs: dict = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def generated(outs) -> int:
    return sum(len(o.token_ids) for o in outs if o.error is None)


def settled(engine, name="acme") -> tuple[int, int, int]:
    """(outstanding reservation, window use, requests queued) once every request ended."""
    return engine.quotas.outstanding(name), engine.quotas.used(name), engine.quotas.queued(name)


@pytest.fixture(autouse=True)
def fresh_quotas(engine):
    from loraplex.tenancy.quotas import TenantQuotas
    engine.quotas = TenantQuotas(engine.config.max_waiting_requests, engine.config.tenant_queue_share)
    yield
    assert not engine.has_work()


def test_finish_by_length_and_by_eos_give_back_what_was_not_generated(engine):
    r = add(engine, "len", SamplingParams(max_tokens=5, n=2, temperature=0, ignore_eos=True))
    assert r.reserved_tokens == 10 and engine.quotas.used("acme") == 6 + 10
    assert generated(run(engine)["len"]) == 10
    assert settled(engine) == (0, 16, 0)
    stopped = add(engine, "stop", SamplingParams(max_tokens=50, temperature=0, stop=["\n", " ", "e", "a"]))
    outs = run(engine)["stop"]
    used = generated(outs)
    assert outs[-1].finish_reason == "stop" and used < 50 and stopped.reserved_tokens == 0
    assert settled(engine) == (0, 16 + 6 + used, 0)


def test_cancel_before_and_after_start_gives_everything_unused_back(engine):
    add(engine, "queued", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.abort("queued")
    outs = run(engine)["queued"]
    assert isinstance(outs[-1].error, RequestCancelled) and settled(engine) == (0, 6, 0)
    add(engine, "running", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    before = engine.step() + engine.step()
    engine.abort("running")
    outs = run(engine)["running"]
    assert isinstance(outs[-1].error, RequestCancelled) and generated(before) == 2
    assert settled(engine) == (0, 6 + 6 + 2, 0)


def test_timeout_and_an_error_give_back(engine):
    add(engine, "timeout", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, timeout=1e-9))
    outs = run(engine)["timeout"]
    assert outs[-1].finish_reason == "timeout" and settled(engine)[0] == 0
    r = add(engine, "error", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    outs = engine._fail_request(r, RuntimeError("boom"))  # the path of a failed forward or output
    assert outs and settled(engine)[0] == 0 and r.reserved_tokens == 0


def test_loop_recovery_and_shutdown_give_back(demo):
    engine = LLMEngine(EngineConfig(model_dir=str(demo["model"]), max_num_seqs=1))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    add(engine, "held", params)
    engine.step()
    engine._recover(RuntimeError("loop failed"))  # what run_loop does when serving raises
    assert engine.quotas.outstanding("acme") == 0
    add(engine, "running", params)
    add(engine, "queued", params)
    engine.step()
    ended = engine.shutdown()
    assert {o.request_id for o in ended} == {"running", "queued"} and all(o.error for o in ended)
    assert settled(engine) == (0, engine.quotas.used("acme"), 0) and engine.quotas.outstanding("acme") == 0


def test_a_flood_is_refused_while_another_tenant_is_accepted(engine):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    acme, globex = tenant("acme"), tenant("globex")
    accepted = 0
    with pytest.raises(QueueFull) as err:
        for i in range(20):
            add(engine, f"a{i}", params, acme)
            accepted += 1
    assert accepted == 6  # its part (2 of the 4 reserved) and the 4 shared places
    assert str(err.value).startswith("tenant quota exceeded: 6 requests of this tenant are waiting")
    for i in range(2):
        add(engine, f"g{i}", params, globex)  # its part is kept for it
    outputs = run(engine)
    assert all(generated(outputs[f"g{i}"]) == 2 for i in range(2))


def test_n_over_the_tenants_concurrency_is_invalid_and_sequences_are_counted(engine):
    limited = tenant(max_concurrent_requests=3)
    with pytest.raises(InvalidRequest) as err:
        engine.make_request("n4", PROMPT, SamplingParams(n=4), "acme", limited)
    assert str(err.value) == "n is 4 but the tenant's max_concurrent_requests is 3 (sequences)"
    params = SamplingParams(max_tokens=4, n=2, temperature=0, ignore_eos=True)
    add(engine, "first", params, limited)
    add(engine, "second", params, limited)
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, engine.scheduler.active.counts.get("acme", 0))
    assert most == 2  # 2 + 2 > 3: the second waits for the first's samples


def test_a_prompt_over_the_byte_bound_is_refused_before_tokenizing(engine, monkeypatch):
    assert engine.max_prompt_bytes == engine.max_model_len * 5  # the demo tokenizer's longest token: "<pad>"
    calls = []
    monkeypatch.setattr(engine, "tokenizer", lambda text: calls.append(text))
    with pytest.raises(InvalidRequest) as err:
        engine.make_request("big", "x" * (engine.max_prompt_bytes + 1), SamplingParams(), "acme")
    assert str(err.value) == f"text_input is {engine.max_prompt_bytes + 1} bytes; at most {engine.max_prompt_bytes} " \
                             "are accepted (max_prompt_bytes)"
    with pytest.raises(InvalidRequest, match="text_input is 5122 bytes"):
        engine.make_request("wide", "é" * 2561, SamplingParams(), "acme")  # bytes, not characters
    assert calls == []
