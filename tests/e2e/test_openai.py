"""loraplex-openai through a real tritonserver and a real gateway process, with the official `openai` SDK.

The oracle is lora_llm itself: the gateway's greedy text must equal what `stream_generate` (native gRPC
streaming) returns for the same prompt and adapter; chat prompts are the checkpoint's chat template
rendered with exactly one BOS. One server with a tenants file (keys for 401, a metered tenant for 429).
"""

from __future__ import annotations

import http.client
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
import requests
from helpers import run_gateway, scrape, wait_for_metric
from tritonserver_fixture import make_triton_server_fixture, seed_demo_adapters

from loraplex.clients.adapters import upload_adapter
from loraplex.clients.generate import stream_generate
from loraplex.exceptions import AUTH_ERROR
from loraplex.tenancy.tenants import key_digest

KEYS = {"acme": "acme-openai-key", "globex": "globex-openai-key", "metered": "metered-openai-key"}
WORK = Path(tempfile.mkdtemp(prefix="loraplex-openai-"))
TENANTS_FILE = WORK / "tenants.json"
TENANTS_FILE.write_text(json.dumps({"tenants": {
    "acme": {"api_key_sha256": key_digest(KEYS["acme"]).hex()},
    "globex": {"api_key_sha256": key_digest(KEYS["globex"]).hex()},
    "metered": {"api_key_sha256": key_digest(KEYS["metered"]).hex(), "tokens_per_minute": 30},
}}))
BASE = "model"  # the demo checkpoint's folder name: the base model's id
ADAPTERS = (None, "demo-a", "demo-b")
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is LoRA?"}]

triton_server = make_triton_server_fixture(env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)},
                                           adapter_store=lambda tmp, demo: seed_demo_adapters(tmp, demo))


@pytest.fixture(scope="module")
def gateway(triton_server, demo):
    """`loraplex-openai` as its own process in front of the module's server; yields its base URL."""
    with run_gateway(triton_server.grpc_url, demo["model"], WORK / "gateway.log") as url:
        yield url


def client(gateway, tenant: str = "acme", **kw) -> openai.OpenAI:
    """The SDK on the gateway with the tenant's key; no retries (a 429/503 must show at once)."""
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEYS.get(tenant, tenant), max_retries=0, **kw)


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


@pytest.fixture(scope="module")
def chat_prompt(tokenizer):
    """The rendered chat prompt as lora_llm must receive it: the template's text BOS dropped (lora_llm adds it)."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith(tokenizer.bos_token)
    return text[len(tokenizer.bos_token):]


def peft_greedy_text(demo, tokenizer, prompt_ids: list[int], lora: str | None, max_tokens: int) -> str:
    """The oracle: transformers + peft's greedy continuation of these prompt tokens (EOS ignored), as text."""
    from peft_reference import greedy_tokens

    adapter = str(demo[lora]) if lora else None
    tokens = greedy_tokens(str(demo["model"]), adapter, prompt_ids, max_tokens, ignore_eos=True)
    assert len(tokens) == max_tokens
    return tokenizer.decode(tokens, skip_special_tokens=True)


def native(server, prompt: str, lora: str | None, tenant: str = "acme", **params):
    """lora_llm's own output over gRPC (what the gateway forwards to)."""
    params = {"temperature": 0, **params, **({"lora_name": lora} if lora else {})}
    result = stream_generate(server.grpc_url, prompt, params, headers={"x-api-key": KEYS[tenant]},
                             return_num_input_tokens=True, return_num_output_tokens=True,
                             return_finish_reason=True)
    assert result.error is None, result.error
    return result


def model_id(lora: str | None) -> str:
    return lora or BASE


# ---- /v1/models ------------------------------------------------------------------------------------------
def test_models_lists_the_base_and_the_callers_adapters_with_parent(triton_server, gateway, demo):
    upload_adapter(triton_server.grpc_url, "acme-own", demo["demo-a"], headers={"x-api-key": KEYS["acme"]})
    acme = {m.id: m for m in client(gateway, "acme").models.list().data}
    globex = {m.id for m in client(gateway, "globex").models.list().data}
    assert list(acme) == [BASE, "acme-own", "demo-a", "demo-b"]
    assert acme[BASE].parent is None and acme[BASE].root == BASE  # the served name, no server path
    assert {acme[n].parent for n in ("acme-own", "demo-a", "demo-b")} == {BASE}
    assert globex == {BASE, "demo-a", "demo-b"}  # another tenant's upload is not listed
    assert acme["demo-a"].object == "model" and acme["demo-a"].owned_by == "loraplex"


# ---- completions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", ADAPTERS)
def test_completions_equal_peft_greedy_streamed_and_not(triton_server, gateway, tokenizer, demo, lora):
    want = native(triton_server, PROMPT, lora, max_tokens=12, ignore_eos=True)
    c = client(gateway)
    got = c.completions.create(model=model_id(lora), prompt=PROMPT, max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    oracle = peft_greedy_text(demo, tokenizer, tokenizer(PROMPT).input_ids, lora, 12)
    assert got.choices[0].text == oracle == want.text and oracle
    assert got.choices[0].finish_reason == "length" and got.object == "text_completion"
    assert got.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids) == want.responses[-1]["num_input_tokens"][0]
    assert got.usage.completion_tokens == 12 and got.usage.total_tokens == got.usage.prompt_tokens + 12
    chunks = list(c.completions.create(model=model_id(lora), prompt=PROMPT, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == oracle
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == got.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_batch_n_seed_stop_and_logprobs(triton_server, gateway):
    c = client(gateway)
    batch = c.completions.create(model="demo-b", prompt=["Hello", PROMPT], max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in batch.choices] == [native(triton_server, p, "demo-b", max_tokens=6).text
                                                 for p in ("Hello", "Hello", PROMPT, PROMPT)]
    seeded = [c.completions.create(model=BASE, prompt="Hello", max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
                                   extra_body={"top_k": 20}).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1] == native(triton_server, "Hello", None, max_tokens=8, temperature=1.0,
                                            top_p=0.9, seed=7, top_k=20).text
    full = native(triton_server, PROMPT, None, max_tokens=12, ignore_eos=True).text
    stop = full[4:6]
    cut = c.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.startswith(cut.choices[0].text)
    lp = c.completions.create(model=BASE, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                              extra_body={"ignore_eos": True, "min_tokens": 5}).choices[0]
    assert len(lp.logprobs.tokens) == 5 and "".join(lp.logprobs.tokens) == lp.text
    assert all(1 <= len(t) <= 2 for t in lp.logprobs.top_logprobs)  # keyed by text: byte tokens may share '\ufffd'
    assert all(max(t.values()) == lp.logprobs.token_logprobs[i] for i, t in enumerate(lp.logprobs.top_logprobs))
    assert lp.logprobs.text_offset[0] == 0
    echo = c.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + native(triton_server, PROMPT, None, max_tokens=4).text


# ---- chat ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", ADAPTERS)
def test_chat_equals_peft_greedy_on_the_rendered_template(triton_server, gateway, tokenizer, chat_prompt, demo,
                                                          lora):
    c = client(gateway)
    got = c.chat.completions.create(model=model_id(lora), messages=MESSAGES, max_completion_tokens=10,
                                    temperature=0, extra_body={"ignore_eos": True})
    oracle = peft_greedy_text(demo, tokenizer, tokenizer(chat_prompt).input_ids, lora, 10)  # the template, one BOS
    assert got.choices[0].message.content == oracle and got.choices[0].message.role == "assistant"
    assert got.object == "chat.completion" and got.choices[0].finish_reason == "length"
    ids = tokenizer(chat_prompt).input_ids
    assert ids[:2] == [tokenizer.bos_token_id, ids[1]] and ids[1] != tokenizer.bos_token_id  # one BOS
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 10
    chunks = list(c.chat.completions.create(model=model_id(lora), messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == oracle
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs_and_n(gateway):
    c = client(gateway)
    got = c.chat.completions.create(model="demo-a", messages=MESSAGES, max_tokens=4, temperature=0, n=2,
                                    logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [ch.index for ch in got.choices] == [0, 1]
    assert got.choices[0].message.content == got.choices[1].message.content  # greedy: both samples agree
    content = got.choices[0].logprobs.content
    assert "".join(t.token for t in content) == got.choices[0].message.content and len(content) == 4
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)
    assert got.usage.completion_tokens == 8


# ---- errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_errors_map_to_openai_statuses(gateway, stream):
    def call(tenant="acme", **kw):
        args = dict(model=BASE, prompt="Hi", max_tokens=2, stream=stream)
        result = client(gateway, tenant).completions.create(**{**args, **kw})
        return list(result) if stream else result

    with pytest.raises(openai.AuthenticationError) as e:
        call("not-a-key")
    assert e.value.status_code == 401 and e.value.body["message"] == AUTH_ERROR
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        call(model="no-such-adapter")
    assert e.value.body["code"] == "model_not_found" and "no-such-adapter" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        call(max_tokens=5000)  # beyond the model's 1024 positions: the engine refuses it
    assert "exceeds the model's max length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        call(presence_penalty=0.5)
    assert e.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        call(max_tokens="many")
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"


def test_over_quota_is_429_and_others_are_served(gateway):
    metered = client(gateway, "metered")
    with pytest.raises(openai.BadRequestError) as e:  # could never fit the quota: retrying does not help
        metered.completions.create(model=BASE, prompt="spend", max_tokens=30)
    assert "more than the tenant's tokens_per_minute=30" in e.value.body["message"]
    metered.completions.create(model=BASE, prompt="spend", max_tokens=20, temperature=0,
                               extra_body={"ignore_eos": True})  # 6 prompt tokens + 20 reserved, all used
    with pytest.raises(openai.RateLimitError) as e:
        metered.completions.create(model=BASE, prompt="more", max_tokens=2)
    assert e.value.status_code == 429 and "tokens_per_minute=30 (26 tokens" in e.value.body["message"]
    assert client(gateway, "acme").completions.create(model=BASE, prompt="ok", max_tokens=2).choices


def test_raw_http_error_object_and_sse_framing(gateway):
    bad = requests.post(f"{gateway}/v1/chat/completions", json={"model": BASE, "messages": []}, timeout=30)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.post(f"{gateway}/v1/completions", stream=True, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS['acme']}"},
                      json={"model": "demo-a", "prompt": "Hi", "max_tokens": 3, "stream": True})
    lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)


# ---- disconnects and concurrency -------------------------------------------------------------------------
def _kv_used(server) -> float:
    return wait_for_metric(server, "loraplex_kv_cache_blocks", 0.0, timeout=20, state="used")


def test_a_client_that_disconnects_cancels_its_request_and_frees_the_kv_blocks(triton_server, gateway):
    body = {"model": "demo-b", "prompt": "run long", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEYS['acme']}"}
    aborted = scrape(triton_server, "loraplex_request_finished_total", tenant="acme", finish_reason="abort") or 0
    r = requests.post(f"{gateway}/v1/completions", json={**body, "stream": True}, headers=headers, stream=True,
                      timeout=60)
    lines = r.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    r.close()  # the stream is cut mid-generation
    assert _kv_used(triton_server) == 0.0
    # non-streamed: the client gives up waiting once its request runs (not after a fixed time, which a fast machine
    # could outrun: 1000 tokens take 0.3 s and more)
    conn = http.client.HTTPConnection(urlsplit(gateway).hostname, urlsplit(gateway).port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {**headers, "Content-Type": "application/json"})
    assert wait_for_metric(triton_server, "loraplex_num_sequences", 1.0, state="running") == 1.0
    conn.close()
    assert _kv_used(triton_server) == 0.0
    assert wait_for_metric(triton_server, "loraplex_request_finished_total", aborted + 2, tenant="acme",
                           finish_reason="abort") == aborted + 2  # both were cancelled, not run to the end


def test_many_concurrent_requests_through_one_gateway(triton_server, gateway, tokenizer):
    jobs = [(ADAPTERS[i % 3], f"tenant traffic {i}", bool(i % 2)) for i in range(12)]
    c = client(gateway)

    def run(lora, prompt, chat):
        if chat:
            chunks = c.chat.completions.create(model=model_id(lora), messages=[{"role": "user", "content": prompt}],
                                               max_tokens=8, temperature=0, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return c.completions.create(model=model_id(lora), prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: run(*job), jobs))
    for (lora, prompt, chat), text in zip(jobs, got):
        if chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                     tokenize=False)[len(tokenizer.bos_token):]
            assert text == native(triton_server, rendered, lora, max_tokens=8).text
        else:
            assert text == native(triton_server, prompt, lora, max_tokens=8).text
