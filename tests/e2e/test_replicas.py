"""Two real tritonserver replicas on one machine sharing one adapter store agree on every adapter operation.

An upload, a run-time shared load and its unload, and a delete made through replica A are listed and served (or
refused) by replica B on B's very first request after the operation returned (docs/adapters.md, "Replicas").
The endpoint picker's LoRA-info gauge shows an adapter as running only on the replica that runs it, and a
tenant's quotas are per replica while the store's are fleet-wide (decision 077).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from tritonserver_fixture import demo_server, seed_demo_adapters

from loraplex.clients.adapters import build_inputs as adapter_inputs
from loraplex.clients.adapters import adapter_request, delete_adapter, list_adapters, read_adapter_folder, upload_adapter
from loraplex.clients import metrics
from loraplex.clients.generate import build_inputs, stream_generate
from loraplex.launch.tritonserver import TritonServerError
from loraplex.tenancy.tenants import key_digest
from loraplex.openai.triton_stream import ADMIN_PARAMETER

KEYS = {"acme": "acme-replica-key", "globex": "globex-replica-key", "metered": "metered-replica-key"}
ADMIN_KEY = "operator-replica-key"
QUOTAS = {"metered": {"tokens_per_minute": 20, "max_adapters": 1}}
PROMPT = "The quick brown fox"
INFO = "loraplex_lora_requests_info"


@pytest.fixture(scope="module")
def work():
    path = Path(tempfile.mkdtemp(prefix="loraplex-replicas-"))
    (path / "tenants.json").write_text(json.dumps({"tenants": {
        t: {"api_key_sha256": key_digest(k).hex(), **QUOTAS.get(t, {})} for t, k in KEYS.items()}}))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def replicas(work, demo):
    """Replicas A and B: two tritonservers of the demo model on one adapter store, started together."""
    store = seed_demo_adapters(work / "store", demo)
    env = {"LORAPLEX_TENANTS_FILE": str(work / "tenants.json"), "LORAPLEX_ADMIN_KEY": ADMIN_KEY}
    for name in ("a", "b"):
        (work / name).mkdir()
    servers = [demo_server(work / name, demo, env=env, adapter_store=store) for name in ("a", "b")]
    for server in servers:
        server.start()
    try:
        for server in servers:
            try:
                server.wait_ready()
            except TritonServerError:  # a port taken meanwhile: start it again on new ones
                server.stop()
                server.start_and_wait()
        warm = [threading.Thread(target=adapter_request, args=(s.grpc_url, "list"), kwargs={"headers": key("acme")})
                for s in servers]  # lora_adapters' first use opens the store (imports torch): both at once
        for thread in warm:
            thread.start()
        for thread in warm:
            thread.join()
        yield servers
    finally:
        stops = [threading.Thread(target=server.stop, kwargs={"grace": 10}) for server in servers]
        for stop in stops:
            stop.start()
        for stop in stops:
            stop.join()


def key(tenant: str) -> dict:
    return {"x-api-key": KEYS[tenant]}


def generate(server, tenant: str, lora: str | None = None, max_tokens: int = 8, prompt: str = PROMPT):
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **({"lora_name": lora} if lora else {})}
    return stream_generate(server.grpc_url, prompt, params, headers=key(tenant))


def text(result) -> str:
    assert result.error is None, result.error
    return "".join(r["text_output"][0] for r in result.responses)


def names(server, tenant: str) -> set[str]:
    """Every adapter name the tenant may use on this replica (what the gateway's /v1/models lists)."""
    page = adapter_request(server.grpc_url, "list", headers=key(tenant))
    return {a["name"] for a in page["adapters"]} | set(page["shared"])


def operator(server, action: str, name: str, folder: Path | None = None) -> dict:
    """lora_adapters' load_shared / unload_shared with the admin key (what the gateway's vLLM API sends)."""
    import tritonclient.grpc as grpcclient
    config, weights = read_adapter_folder(folder) if folder is not None else (None, None)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer("lora_adapters", adapter_inputs(grpcclient, action, name, config, weights),
                              parameters={ADMIN_PARAMETER: ADMIN_KEY})
        return json.loads(result.as_numpy("result")[0])
    finally:
        client.close()


def test_an_upload_and_a_delete_through_one_replica_are_seen_by_the_other_at_once(replicas, demo):
    a, b = replicas
    upload_adapter(a.grpc_url, "mine", demo["demo-b"], headers=key("acme"))
    assert "mine" in names(b, "acme") and "mine" not in names(b, "globex")  # B's first request after it
    served = text(generate(b, "acme", "mine"))
    assert served == text(generate(a, "acme", "mine")) == text(generate(b, "acme", "demo-b"))
    assert "not supported" in str(generate(b, "globex", "mine").error)  # still the tenant's own, on every replica
    delete_adapter(a.grpc_url, "mine", headers=key("acme"))
    assert "mine" not in names(b, "acme")
    assert "LoRA mine is not supported" in str(generate(b, "acme", "mine").error)  # NOT_FOUND at once


def test_a_shared_load_and_unload_through_one_replica_are_seen_by_the_other_at_once(replicas, demo):
    a, b = replicas
    assert operator(a, "load_shared", "ops", Path(demo["demo-a"]))["name"] == "ops"
    assert "ops" in names(b, "globex")
    assert text(generate(b, "globex", "ops")) == text(generate(a, "acme", "demo-a"))
    operator(a, "unload_shared", "ops")
    assert "ops" not in names(b, "globex")
    assert "LoRA ops is not supported" in str(generate(b, "globex", "ops").error)


def series(text: str, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of every sample of `name` lora_llm exports, in one scrape's text."""
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    found = [(dict(re.findall(r'(\w+)="([^"]*)"', line.rsplit("}", 1)[0])), float(line.rsplit(" ", 1)[1]))
             for line in lines]
    return [(labels, value) for labels, value in found if labels.get("model") == "lora_llm"]


def lora_info(text: str) -> dict:
    """The LoRA-info series the endpoint picker takes: the one with the largest value."""
    return max(series(text, INFO), key=lambda s: s[1])[0]


def gauge(text: str, name: str) -> float:
    ((_, value),) = series(text, name)
    return value


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def test_the_lora_info_gauge_shows_an_adapter_running_only_where_it_runs(replicas):
    import tritonclient.grpc as grpcclient
    a, b = replicas
    responses = []
    client = grpcclient.InferenceServerClient(a.grpc_url)
    client.start_stream(callback=lambda result, error: responses.append(error), headers=key("acme"))
    params = {"max_tokens": 900, "ignore_eos": True, "lora_name": "demo-a"}
    client.async_stream_infer("lora_llm", build_inputs(grpcclient, "a long one", params, True),
                              request_id=uuid.uuid4().hex)
    try:
        # A's figures all from the one scrape that shows demo-a running: the stream may end soon after it
        at_a = wait_for(lambda: lora_info(t := metrics.fetch(a.metrics_url))["running_lora_adapters"] == "demo-a" and t,
                        "demo-a never showed as running on A")
        at_b = metrics.fetch(b.metrics_url)
        running = lora_info(at_a)
        assert running["max_lora"] == "8" and running["waiting_lora_adapters"] == ""
        assert lora_info(at_b) == {**running, "running_lora_adapters": ""}  # B runs nothing
        assert gauge(at_a, "loraplex_num_requests_running") == 1 and gauge(at_b, "loraplex_num_requests_running") == 0
        assert 0 < gauge(at_a, "loraplex_kv_cache_usage_ratio") < 1
        assert gauge(at_b, "loraplex_kv_cache_usage_ratio") == 0
        assert gauge(at_a, "loraplex_num_requests_waiting") == gauge(at_b, "loraplex_num_requests_waiting") == 0
        ((labels, one),) = series(at_b, "loraplex_cache_config_info")
        assert one == 1 and labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0
        assert not any(responses)  # no error while it ran
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    after = wait_for(lambda: lora_info(t := metrics.fetch(a.metrics_url))["running_lora_adapters"] == "" and t,
                     "demo-a still running on A after the cancel")
    assert gauge(after, "loraplex_num_requests_running") == 0


def test_a_tenants_quotas_are_per_replica_and_its_store_quotas_fleet_wide(replicas, demo):
    a, b = replicas
    assert text(generate(a, "metered", max_tokens=2, prompt="within quota"))
    over = generate(a, "metered", max_tokens=2, prompt="over quota").error  # 15 reserved + 14 > 20 on A
    assert "tenant quota exceeded: tokens_per_minute=20" in str(over)
    assert text(generate(b, "metered", max_tokens=2, prompt="over quota"))  # B keeps its own window (decision 077)
    upload_adapter(a.grpc_url, "one", demo["demo-a"], headers=key("metered"))
    with pytest.raises(Exception, match="max_adapters quota"):  # the store counts every replica's uploads
        upload_adapter(b.grpc_url, "two", demo["demo-b"], headers=key("metered"))
    assert [x["name"] for x in list_adapters(b.grpc_url, headers=key("metered"))] == ["one"]


def test_concurrent_uploads_through_both_replicas_leave_one_current_version(replicas, demo):
    a, b = replicas
    results: list = []
    threads = [threading.Thread(target=lambda s=s, d=d: results.append(
        upload_adapter(s.grpc_url, "race", demo[d], headers=key("globex")))) for s, d in ((a, "demo-a"), (b, "demo-b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    current = {x["name"]: x["version"] for x in list_adapters(a.grpc_url, headers=key("globex"))}["race"]
    assert current == {x["name"]: x["version"] for x in list_adapters(b.grpc_url, headers=key("globex"))}["race"]
    assert current in {r["version"] for r in results}
    assert text(generate(a, "globex", "race")) == text(generate(b, "globex", "race"))
