"""lora_llm through a real tritonserver: streaming, HTTP, adapters, echo rules, errors, cancel."""

from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import http_generate, sse_events, token_ids_of, wait_for_metric, wait_for_positive
from peft_reference import greedy_tokens
from tritonserver_fixture import make_triton_server_fixture, seed_demo_adapters

from loraplex.clients.generate import build_inputs, stream_generate
from loraplex.models.builtin.demo import build_peft_adapter

GREEDY = {"temperature": 0, "logprobs": 0}


def store_with_three_adapters(store, demo):
    """The demo adapters plus demo-c (rank 4, MLP + o_proj only)."""
    seed_demo_adapters(store, demo)
    build_peft_adapter(demo["model"], store / "demo-c", r=4, alpha=8,
                       target_modules=("o_proj", "up_proj", "down_proj"), seed=3)
    return store


triton_server = make_triton_server_fixture(adapter_store=store_with_three_adapters,
                                           engine_config={"max_num_batched_tokens": 64})


@pytest.fixture(scope="module")
def adapters(triton_server):
    store = triton_server.env["LORAPLEX_ADAPTER_STORE"]
    return {None: None, "demo-a": f"{store}/demo-a", "demo-b": f"{store}/demo-b", "demo-c": f"{store}/demo-c"}


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


def test_concurrent_staggered_streams_equal_peft(triton_server, demo, adapters, tokenizer):
    prompts = ["Hello there", "The quick brown fox jumps over", "LoRA", "Many tenants share one base model.",
               "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22", "abc", "Triton", "zz top", "q", "Once"]
    names = [None, "demo-a", "demo-b", "demo-c"]
    jobs = [(p, names[i % 4], 64 + 8 * i) for i, p in enumerate(prompts)]
    results = [None] * len(jobs)
    first_token = [threading.Event() for _ in jobs]
    ended = [threading.Event() for _ in jobs]
    joined_running = [None] * len(jobs)  # stream i was sent after i-1's first token and before i-1's end

    def run(i, prompt, lora, max_tokens):
        if i:  # staggered arrivals join a running batch: each starts once the one before it is generating
            joined_running[i] = first_token[i - 1].wait(120) and not ended[i - 1].is_set()
        params = dict(GREEDY, max_tokens=max_tokens, **({"lora_name": lora} if lora else {}))
        try:
            results[i] = stream_generate(triton_server.grpc_url, prompt, params, return_logprobs=True,
                                         on_response=lambda _: first_token[i].set())
        finally:
            ended[i].set()

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    # most arrivals joined a running batch; on a starved CPU the thread that sends the next stream may wake after
    # the one before it has ended (seen under two busy loops beside the suite, with streams of 17 and 56 tokens)
    assert sum(map(bool, joined_running[1:])) >= len(jobs) // 2, joined_running
    for (prompt, lora, max_tokens), result in zip(jobs, results):
        assert result.error is None and result.final_count == 1
        ids = tokenizer(prompt).input_ids
        expected = greedy_tokens(str(demo["model"]), adapters[lora], ids, max_tokens)
        assert token_ids_of(result) == expected, (prompt, lora)
        assert result.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_adapters_change_the_output(triton_server):
    texts = set()
    for lora in (None, "demo-a", "demo-b", "demo-c"):
        params = dict(GREEDY, max_tokens=12, **({"lora_name": lora} if lora else {}))
        texts.add(stream_generate(triton_server.grpc_url, "What is LoRA?", params).text)
    assert len(texts) == 4


def test_http_generate_matches_stream_and_echoes_prompt(triton_server):
    params = {"max_tokens": 20, "temperature": "0", "lora_name": "demo-b", "ignore_eos": "true"}
    streamed = sse_events(http_generate(triton_server, {"text_input": "Hi", "stream": True, "parameters": params},
                                        stream=True))
    text = "".join(e["text_output"] for e in streamed)
    plain = http_generate(triton_server, {"text_input": "Hi", "parameters": params}).json()
    assert plain["text_output"] == "Hi" + text
    excluded = http_generate(triton_server, {"text_input": "Hi", "exclude_input_in_output": True,
                                             "parameters": params}).json()
    assert excluded["text_output"] == text
    grpc_text = stream_generate(triton_server.grpc_url, "Hi", params).text
    assert grpc_text == text


def test_http_stream_sends_more_than_one_event(triton_server):
    """The responder coalesces what is pending, so a short stream may arrive whole: ask for a long one (~0.3 s)."""
    params = {"max_tokens": 600, "temperature": "0", "ignore_eos": "true"}
    streamed = sse_events(http_generate(triton_server, {"text_input": "Hi", "stream": True, "parameters": params},
                                        stream=True))
    assert len(streamed) >= 2


def test_optional_outputs_only_when_asked(triton_server):
    body = {"text_input": "Hello", "parameters": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}
    bare = http_generate(triton_server, body).json()
    assert set(bare) == {"model_name", "model_version", "text_output"}
    flags = {f: True for f in ("return_finish_reason", "return_cumulative_logprob", "return_num_input_tokens",
                               "return_num_output_tokens", "return_logprobs")}
    full = http_generate(triton_server, {**body, **flags}).json()
    assert full["finish_reason"] == "length"
    assert full["num_output_tokens"] == 5
    assert full["num_input_tokens"] == 6  # <s> + 5 bytes
    assert full["cumulative_logprob"] < 0
    assert json.loads(full["logprobs"]) is None  # logprobs were not requested in sampling params
    streamed = stream_generate(triton_server.grpc_url, "Hello", {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
                               return_finish_reason=True, return_num_output_tokens=True)
    assert [r["finish_reason"][0] for r in streamed.responses][-1] == "length"
    assert all(r["finish_reason"][0] == "None" for r in streamed.responses[:-1])
    assert sum(r["num_output_tokens"][0] for r in streamed.responses) == 5


def test_stop_string_and_max_tokens(triton_server):
    base = stream_generate(triton_server.grpc_url, "Hello", {"max_tokens": 30, "temperature": 0, "ignore_eos": True}).text
    at = next(i for i in range(3, len(base) - 2) if "\ufffd" not in base[i : i + 2])
    stop = base[at : at + 2]
    cut = stream_generate(triton_server.grpc_url, "Hello", {"max_tokens": 30, "temperature": 0, "ignore_eos": True,
                                                            "stop": [stop]}, return_finish_reason=True)
    assert cut.text == base[: base.index(stop)]
    assert cut.responses[-1]["finish_reason"][0] == "stop"


BAD_INPUTS = [
    ("missing text_input", None, None, "missing required input 'text_input'"),
    ("empty prompt", "", None, "text_input is empty"),
    ("not json", "Hi", "{max_tokens: 3", "sampling_parameters is not valid JSON"),
    ("unknown key", "Hi", {"max_tokenz": 3}, "unknown sampling parameter 'max_tokenz'"),
    ("bad type", "Hi", {"temperature": "hot"}, "'temperature' has value 'hot'"),
    ("max_tokens < 1", "Hi", {"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ("negative temperature", "Hi", {"temperature": -1}, "temperature must be >= 0, got -1.0"),
    ("top_p zero", "Hi", {"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
    ("top_p above one", "Hi", {"top_p": 1.01}, "top_p must be in (0, 1], got 1.01"),
    ("too long", "Hi", {"max_tokens": 1022}, "prompt has 3 tokens and max_tokens is 1022: 1025 exceeds the model's max length 1024"),
    ("unknown adapter", "Hi", {"lora_name": "no-such-adapter"},
     "LoRA no-such-adapter is not supported, we currently support ['demo-a', 'demo-b', 'demo-c']"),
    ("seed beyond int64", "Hi", {"seed": 2**64}, "'seed' has value 18446744073709551616"),
    ("not UTF-8", b"\xff\xfeHi", None, "text_input is not valid UTF-8 (byte 0: invalid start byte)"),
]


@pytest.mark.parametrize("case, prompt, params, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_final_error_and_the_server_keeps_serving(triton_server, case, prompt, params, message):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    inputs = []
    if prompt is not None:
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([prompt if isinstance(prompt, bytes) else prompt.encode()], dtype=object))
        inputs.append(t)
    if params is not None:
        t = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        raw = params if isinstance(params, str) else json.dumps(params)
        t.set_data_from_numpy(np.array([raw.encode()], dtype=object))
        inputs.append(t)
    q = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    if not inputs:  # Triton itself rejects a request without its required input
        client.async_stream_infer("lora_llm", [_stream_flag(True)])
    else:
        client.async_stream_infer("lora_llm", inputs)
    result, error = q.get(timeout=60)
    client.stop_stream()
    assert result is None and error is not None
    assert message in str(error) or (prompt is None and "text_input" in str(error))
    good = stream_generate(triton_server.grpc_url, "Still serving?", {"max_tokens": 4, "temperature": 0})
    assert good.error is None and good.final_count == 1 and good.responses


def _stream_flag(value):
    t = grpcclient.InferInput("stream", [1], "BOOL")
    t.set_data_from_numpy(np.array([value]))
    return t


def test_streaming_with_echo_is_refused_as_vllm_backend_does(triton_server):
    result = stream_generate(triton_server.grpc_url, "Hi", {"max_tokens": 3}, exclude_input_in_output=False)
    assert result.error.message() == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.")


def test_http_errors_carry_the_message(triton_server):
    r = http_generate(triton_server, {"text_input": "Hi", "parameters": {"lora_name": "nope"}})
    assert r.status_code in (400, 404) and "LoRA nope is not supported" in r.json()["error"]
    r = http_generate(triton_server, {"text_input": "Hi", "parameters": {"max_tokens": 0}})
    assert r.status_code == 400 and "max_tokens must be >= 1" in r.json()["error"]


def _idle_used_blocks(server):
    return wait_for_metric(server, "loraplex_kv_cache_blocks", 0.0, state="used")


def test_grpc_cancel_frees_blocks(triton_server):
    assert _idle_used_blocks(triton_server) == 0.0
    q = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)), headers={"x-tenant-id": "canceller"})
    client.async_stream_infer("lora_llm", build_inputs(grpcclient, "cancel me", {"max_tokens": 1000, "ignore_eos": True}))
    q.get(timeout=60)
    assert wait_for_positive(triton_server, "loraplex_kv_cache_blocks", state="used") > 0
    client.stop_stream(cancel_requests=True)
    assert _idle_used_blocks(triton_server) == 0.0
    assert wait_for_metric(triton_server, "loraplex_request_finished_total", 1.0,
                           tenant="canceller", finish_reason="abort") == 1.0


def test_closed_http_stream_cancels(triton_server):
    body = {"text_input": "bye", "stream": True, "parameters": {"max_tokens": 900, "ignore_eos": True}}
    with requests.post(f"{triton_server.http_url}/v2/models/lora_llm/generate_stream", json=body, stream=True,
                       timeout=60) as r:
        next(r.iter_lines())
    assert _idle_used_blocks(triton_server) == 0.0


def test_tenant_header_and_parameter_reach_the_engine(triton_server):
    stream_generate(triton_server.grpc_url, "tenant one", {"max_tokens": 2}, headers={"x-tenant-id": "acme"})
    http_generate(triton_server, {"text_input": "tenant two", "parameters": {"max_tokens": 2, "tenant": "globex"}})
    assert wait_for_metric(triton_server, "loraplex_prefix_cache_query_tokens_total", 11.0, tenant="acme") == 11.0
    assert wait_for_metric(triton_server, "loraplex_prefix_cache_query_tokens_total", 11.0, tenant="globex") == 11.0


def test_generation_and_finish_counters_per_tenant(triton_server):
    stream_generate(triton_server.grpc_url, "count me", {"max_tokens": 7, "ignore_eos": True},
                    headers={"x-tenant-id": "counted"})
    stream_generate(triton_server.grpc_url, "count me", {"max_tokens": 3, "ignore_eos": True},
                    headers={"x-tenant-id": "counted"})
    assert wait_for_metric(triton_server, "loraplex_generation_tokens_total", 10.0, tenant="counted") == 10.0
    assert wait_for_metric(triton_server, "loraplex_request_finished_total", 2.0,
                           tenant="counted", finish_reason="length") == 2.0
