"""Prefix caching through a real tritonserver, observed on Triton's metrics port.

The server has a fixed pool of 64 KV blocks of 16 tokens, so gauge values are exact.
Each test uses its own tenants, so the per-tenant counters start at zero.
"""

from __future__ import annotations

import queue

import tritonclient.grpc as grpcclient
from helpers import scrape, wait_for_metric, wait_for_positive
from tritonserver_fixture import make_triton_server_fixture

from loraplex.clients.generate import build_inputs, stream_generate

NUM_BLOCKS = 64
triton_server = make_triton_server_fixture(engine_config={"num_kv_blocks": NUM_BLOCKS, "block_size": 16})

PROMPT_200 = ("Prefix caching lets a tenant reuse the KV blocks of a prompt it sent before. " * 3)[:199]  # + <s>
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


def _send(server, tenant: str, prompt: str = PROMPT_200) -> str:
    result = stream_generate(server.grpc_url, prompt, GREEDY, headers={"x-tenant-id": tenant},
                             return_num_input_tokens=True)
    assert result.error is None and result.final_count == 1
    assert result.responses[0]["num_input_tokens"] == [200]
    return result.text


def _counters(server, tenant: str, query: float, hit: float) -> None:
    assert wait_for_metric(server, "loraplex_prefix_cache_query_tokens_total", query, tenant=tenant) == query
    assert wait_for_metric(server, "loraplex_prefix_cache_hit_tokens_total", hit, tenant=tenant) == hit


def _blocks(server, used: float, cached: float, free: float) -> None:
    for state, value in (("used", used), ("cached", cached), ("free", free)):
        assert wait_for_metric(server, "loraplex_kv_cache_blocks", value, state=state) == value, state


def test_same_prompt_twice_hits_for_its_tenant_only(triton_server):
    _blocks(triton_server, used=0, cached=0, free=NUM_BLOCKS)
    first = _send(triton_server, "acme")
    # 200 prompt + 3 computed output tokens: 12 full blocks are now cached for acme
    _counters(triton_server, "acme", query=200, hit=0)
    _blocks(triton_server, used=0, cached=12, free=NUM_BLOCKS)
    second = _send(triton_server, "acme")
    # 192 of 200 tokens hit: the second time computes 8 prompt tokens, less than one block
    _counters(triton_server, "acme", query=400, hit=192)
    assert second == first
    _blocks(triton_server, used=0, cached=12, free=NUM_BLOCKS)
    other = _send(triton_server, "globex")
    _counters(triton_server, "globex", query=200, hit=0)  # another tenant: no hit
    assert other == first
    _blocks(triton_server, used=0, cached=24, free=NUM_BLOCKS)  # its own copy of the 12 blocks


def test_cancelled_request_returns_the_free_count_to_idle(triton_server):
    idle = scrape(triton_server, "loraplex_kv_cache_blocks", state="free")
    assert idle == NUM_BLOCKS
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers={"x-tenant-id": "c"})
    inputs = build_inputs(grpcclient, "cancel me", {"max_tokens": 900, "ignore_eos": True})
    client.async_stream_infer("lora_llm", inputs)
    try:  # polled from the send, not from the first response: a starved client thread may deliver that late
        assert wait_for_positive(triton_server, "loraplex_kv_cache_blocks", state="used") > 0
        assert results.get(timeout=60)[1] is None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert wait_for_metric(triton_server, "loraplex_kv_cache_blocks", idle, state="free") == idle
    assert scrape(triton_server, "loraplex_kv_cache_blocks", state="used") == 0.0
