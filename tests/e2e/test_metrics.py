"""Custom metrics on Triton's metrics port after known traffic: exact counters, histogram counts, the family set.

One server, a tenants file (so the unauthenticated and quota refusals can be provoked):
`alpha` runs two requests that succeed (one on an adapter) and uploads an adapter; `beta`
has one failure of each reason the engine or the glue can be driven to here; `gamma`
crosses its tokens-per-minute quota; `delta` sends an ambiguous grammar whose matching outgrows its
budget; an unknown key is refused as `other`.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import tempfile
import urllib.request
from pathlib import Path

import pytest
from helpers import scrape, wait_for_metric
from tritonserver_fixture import make_triton_server_fixture

from loraplex.clients.adapters import upload_adapter
from loraplex.clients.generate import build_inputs, stream_generate
from loraplex.engine.metrics import EXPORTED_METRICS, FAMILIES, HISTOGRAM
from loraplex.tenancy.tenants import key_digest

KEYS = {"alpha": "alpha-metrics-key", "beta": "beta-metrics-key", "gamma": "gamma-metrics-key",
        "delta": "delta-metrics-key"}
TENANTS_FILE = Path(tempfile.mkdtemp(prefix="loraplex-metrics-")) / "tenants.json"
TENANTS_FILE.write_text(json.dumps({"tenants": {
    name: {"api_key_sha256": key_digest(key).hex(), **({"tokens_per_minute": 20} if name == "gamma" else {})}
    for name, key in KEYS.items()}}))
ALPHA = [("count my tokens", {"max_tokens": 5}), ("and these too", {"max_tokens": 3, "lora_name": "demo-a"})]
LABELS = {"model": "lora_llm", "version": "1"}
HOSTILE = 'root ::= x root\nx ::= x y | y x | "a" | "b"\ny ::= x x | "a" | ""'  # no end; matching grows a token

triton_server = make_triton_server_fixture(env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)})


@pytest.fixture(scope="module", autouse=True)
def tenants_file():
    yield
    shutil.rmtree(TENANTS_FILE.parent, ignore_errors=True)


def key(tenant: str) -> dict:
    return {"x-api-key": KEYS.get(tenant, "not-a-key")}


def generate(server, tenant: str, prompt: str, params: dict, **flags):
    return stream_generate(server.grpc_url, prompt, {"ignore_eos": True, "temperature": 0, **params},
                           headers=key(tenant), **flags)


def cancel_after_first_response(server, tenant: str) -> None:
    import tritonclient.grpc as grpcclient

    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)), headers=key(tenant))
    client.async_stream_infer("lora_llm", build_inputs(grpcclient, "cancel me", {"max_tokens": 900, "ignore_eos": True}))
    assert responses.get(timeout=60)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()


@pytest.fixture(scope="module")
def traffic(triton_server, demo):
    """Run the known traffic once; the prompt token count of alpha's requests."""
    from transformers import AutoTokenizer
    for prompt, params in ALPHA:
        assert generate(triton_server, "alpha", prompt, params).error is None
    upload_adapter(triton_server.grpc_url, "mine", demo["demo-a"], headers=key("alpha"))
    assert "max_tokens must be >= 1" in str(generate(triton_server, "beta", "x", {"max_tokens": 0}).error)
    assert "LoRA nope is not supported" in str(generate(triton_server, "beta", "x", {"lora_name": "nope"}).error)
    timed_out = generate(triton_server, "beta", "slow", {"max_tokens": 1000, "timeout": 0.05}, return_finish_reason=True)
    assert timed_out.error is None and timed_out.responses[-1]["finish_reason"] == ["timeout"]
    cancel_after_first_response(triton_server, "beta")
    assert generate(triton_server, "gamma", "within quota", {"max_tokens": 2}).error is None
    over = generate(triton_server, "gamma", "over quota", {"max_tokens": 2}).error  # 15 reserved + 14 > 20
    assert "tenant quota exceeded: tokens_per_minute=20" in str(over)
    assert generate(triton_server, "nobody", "who am i", {"max_tokens": 2}).error is not None
    hostile = generate(triton_server, "delta", "Hello", {"max_tokens": 400, "ignore_eos": False,
                                                         "structured_outputs": {"grammar": HOSTILE}})
    assert "structured_outputs: matching the grammar took" in str(hostile.error)  # INVALID_ARG, at its budget
    tokenizer = AutoTokenizer.from_pretrained(demo["model"])
    return sum(len(tokenizer(prompt).input_ids) for prompt, _ in ALPHA)


def metric(server, name: str, expected: float, **labels) -> float | None:
    """The metric once it reached `expected` (the publisher runs on its own thread), with the model's labels."""
    return wait_for_metric(server, name, expected, **{**LABELS, **labels})


def families(text: str) -> dict[str, str]:
    """Family name -> kind, from the exposition's TYPE lines (a histogram by its base name)."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_request_counters_per_tenant_and_reason(triton_server, traffic):
    assert metric(triton_server, "loraplex_request_success_total", 2, tenant="alpha") == 2
    assert metric(triton_server, "loraplex_generation_tokens_total", 8, tenant="alpha") == 8
    assert metric(triton_server, "loraplex_prompt_tokens_total", traffic, tenant="alpha") == traffic
    for reason in ("invalid", "not_found", "timeout", "cancelled"):
        assert metric(triton_server, "loraplex_request_failure_total", 1, tenant="beta", reason=reason) == 1, reason
    assert metric(triton_server, "loraplex_request_success_total", 1, tenant="gamma") == 1
    assert metric(triton_server, "loraplex_request_failure_total", 1, tenant="gamma", reason="quota") == 1
    assert metric(triton_server, "loraplex_request_failure_total", 1, tenant="other", reason="unauthenticated") == 1
    assert scrape(triton_server, "loraplex_request_failure_total", tenant="alpha") is None
    assert scrape(triton_server, "loraplex_request_success_total", tenant="beta") is None
    assert metric(triton_server, "loraplex_request_finished_total", 2, tenant="alpha", finish_reason="length") == 2
    assert metric(triton_server, "loraplex_request_failure_total", 1, tenant="delta", reason="invalid") == 1
    assert scrape(triton_server, "loraplex_grammar_match_seconds_total", tenant="delta", **LABELS) > 0
    assert scrape(triton_server, "loraplex_grammar_match_seconds_total", tenant="alpha") is None


def test_latency_histograms_count_each_request_once(triton_server, traffic):
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "queue_time"):
        base = f"loraplex_{name}_seconds"
        assert metric(triton_server, f"{base}_count", 2, tenant="alpha") == 2, name
        assert metric(triton_server, f"{base}_bucket", 2, tenant="alpha", le="+Inf") == 2, name
        assert scrape(triton_server, f"{base}_sum", tenant="alpha", **LABELS) > 0, name
    assert metric(triton_server, "loraplex_e2e_request_latency_seconds_count", 2, tenant="beta") == 2  # timeout, cancel
    assert metric(triton_server, "loraplex_time_per_output_token_seconds_count", 1, tenant="gamma") == 1  # 2 tokens


def test_step_histograms_and_engine_state(triton_server, traffic):
    assert metric(triton_server, "loraplex_requests_running", 0, tenant="alpha") == 0
    assert metric(triton_server, "loraplex_requests_waiting", 0, tenant="beta") == 0
    assert metric(triton_server, "loraplex_kv_cache_blocks", 0, state="used") == 0
    steps = scrape(triton_server, "loraplex_batch_sequences_count", **LABELS)
    assert steps > 0
    for name in ("batch_tokens", "step_host_seconds"):
        assert metric(triton_server, f"loraplex_{name}_count", steps) == steps, name
    assert metric(triton_server, "loraplex_adapter_loads_total", 1, tier="host") == 1
    assert metric(triton_server, "loraplex_adapter_loads_total", 1, tier="device") == 1
    for stage in ("disk_read", "host_to_device"):  # the same one load, timed
        assert metric(triton_server, "loraplex_adapter_load_seconds_count", 1, stage=stage) == 1, stage
    assert metric(triton_server, "loraplex_adapters_resident", 1, tier="device") == 1
    assert metric(triton_server, "loraplex_adapter_evictions_total", 0, tier="device") == 0
    assert wait_for_metric(triton_server, "loraplex_adapter_uploads_total", 1, tenant="alpha",
                           model="lora_adapters", version="1") == 1


def test_exported_families_are_exactly_the_contract(triton_server, traffic):
    assert metric(triton_server, "loraplex_adapter_uploads_total", 1, tenant="alpha", model="lora_adapters") == 1
    with urllib.request.urlopen(triton_server.metrics_url, timeout=10) as response:
        found = {name: kind for name, kind in families(response.read().decode()).items() if name.startswith("loraplex_")}
    assert set(found) == EXPORTED_METRICS
    assert {name for name, kind in found.items() if kind == "histogram"} == \
        {"loraplex_" + f.name for f in FAMILIES if f.kind == HISTOGRAM}
