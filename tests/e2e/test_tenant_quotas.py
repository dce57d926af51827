"""Quotas through a real tritonserver in authenticated mode: a flooding tenant is refused while another tenant's
requests are accepted and served; the prompt byte bound; a broken tenants file keeps the last good one, counted."""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from helpers import http_generate, scrape
from tritonserver_fixture import make_triton_server_fixture

from loraplex.clients.generate import build_inputs, stream_generate
from loraplex.exceptions import AUTH_ERROR
from loraplex.tenancy.tenants import key_digest

KEYS = {"acme": "acme-flood-key", "globex": "globex-quiet-key"}
TENANTS_FILE = Path(tempfile.mkdtemp(prefix="loraplex-quotas-")) / "tenants.json"
MAX_WAITING = 8  # tenant_queue_share 0.5: 4 places kept, 2 per tenant (equal weights); 4 shared
FLOOD_REFUSED = ("tenant quota exceeded: 6 requests of this tenant are waiting, its share of the queue is 2 "
                 "(max_waiting_requests=8) and the shared part is full; retry later")


@pytest.fixture(scope="module", autouse=True)
def tenants_file():
    TENANTS_FILE.write_text(json.dumps({"tenants": {t: {"api_key_sha256": key_digest(k).hex()}
                                                    for t, k in KEYS.items()}}))
    yield TENANTS_FILE
    shutil.rmtree(TENANTS_FILE.parent, ignore_errors=True)


triton_server = make_triton_server_fixture(
    engine_config={"max_waiting_requests": MAX_WAITING, "max_num_seqs": 1},
    env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)},
)


def test_a_flooding_tenant_is_refused_while_another_is_accepted_and_served(triton_server):
    results: queue.Queue = queue.Queue()
    flood = grpcclient.InferenceServerClient(triton_server.grpc_url)
    flood.start_stream(callback=lambda result, error: results.put((result, error)), headers={"x-api-key": KEYS["acme"]})
    long = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    try:
        flood.async_stream_infer("lora_llm", build_inputs(grpcclient, "flood 0", long), request_id="0")
        assert results.get(timeout=120)[1] is None  # it runs (max_num_seqs=1): the rest wait behind it
        for i in range(1, 15):
            flood.async_stream_infer("lora_llm", build_inputs(grpcclient, f"flood {i}", long), request_id=str(i))
        refused, deadline = [], time.monotonic() + 60
        while len(refused) < 7 and time.monotonic() < deadline:  # 14 sent: at most 6 wait, 1 more if one started
            try:
                result, error = results.get(timeout=1)
            except queue.Empty:
                continue
            if error is not None:
                refused.append(error.message())
        assert len(refused) >= 7 and set(refused) == {FLOOD_REFUSED}
        started = time.monotonic()
        quiet = [stream_generate(triton_server.grpc_url, f"quiet {i}", {"max_tokens": 2, "temperature": 0},
                                 headers={"x-api-key": KEYS["globex"]}, timeout=300) for i in range(2)]
        for result in quiet:  # accepted into its own part of the full queue, and served
            assert result.error is None and result.final_count == 1, result.error
        assert time.monotonic() - started < 300
    finally:
        flood.stop_stream(cancel_requests=True)
        flood.close()


def test_a_prompt_over_the_byte_bound_is_refused_before_tokenizing(triton_server):
    bound = 1024 * 5  # the demo model's max_model_len x its longest token ("<pad>", 5 bytes)
    body = {"text_input": "x" * (bound + 1), "parameters": {"api_key": KEYS["globex"], "max_tokens": 1}}
    r = http_generate(triton_server, body)
    assert (r.status_code, r.json()["error"]) == (400, f"text_input is {bound + 1} bytes; at most {bound} "
                                                       "are accepted (max_prompt_bytes)")


def _answers(server, key: str) -> tuple[str | None, tuple[int, str | None]]:
    """What a key gets: (the gRPC stream's error text or None, (HTTP generate's status, its error or None))."""
    streamed = stream_generate(server.grpc_url, "who am I", {"max_tokens": 1}, headers={"x-api-key": key})
    r = http_generate(server, {"text_input": "who am I", "parameters": {"api_key": key, "max_tokens": 1}})
    return (None if streamed.error is None else streamed.error.message()), (r.status_code, r.json().get("error"))


def test_a_broken_tenants_file_keeps_the_last_good_one_and_is_counted(triton_server):
    good = TENANTS_FILE.read_text()
    assert scrape(triton_server, "loraplex_tenants_file_reload_failures_total") == 0
    refused = (AUTH_ERROR, (400, AUTH_ERROR))  # INVALID_ARG over HTTP; a stream's error carries no status code
    assert _answers(triton_server, "intruder") == refused and _answers(triton_server, KEYS["acme"]) == (None, (200, None))
    digest = key_digest(KEYS["acme"]).hex()
    TENANTS_FILE.write_text('{"tenants": {"acme": {"api_key_sha256": "%s"}, "acme": {"api_key_sha256": "%s"}}}'
                            % (digest, key_digest("intruder").hex()))  # a duplicate name: refused, not collapsed
    try:
        deadline = time.monotonic() + 30
        while (scrape(triton_server, "loraplex_tenants_file_reload_failures_total") or 0) < 2:
            assert time.monotonic() < deadline, "the failing reloads were not counted"
            time.sleep(0.2)
        # exactly what the last good file answers: acme served, the intruder refused as any unknown key is
        assert _answers(triton_server, KEYS["acme"]) == (None, (200, None))
        assert _answers(triton_server, "intruder") == refused
        log = triton_server.log_path.read_text()
        assert log.count("tenants file not reloaded, keeping the last good one (2 tenant(s))") >= 2
        assert "'acme' appears twice in one JSON object (a duplicate tenant name?)" in log
    finally:
        TENANTS_FILE.write_text(good)
