"""Structured outputs and tool calls through a real tritonserver and real gateways, with the official openai SDK;
/v1/models, /tokenize and /detokenize on a checkpoint whose tokenizer adds no BOS (Qwen2-style); Retry-After.

The server serves a copy of the demo checkpoint whose tokenizer has no BOS post-processor. Two gateways stand in
front of it: one whose chat template reads ``tools`` (Hermes/Qwen-style ``<tool_call>``), one whose template does
not (the fallback system prompt). The weights are random: the tests assert structure (outputs that end parse and
validate; forced calls always do), never content.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
from helpers import run_gateway
from tritonserver_fixture import demo_server, seed_demo_adapters

from loraplex.tenancy.tenants import key_digest

KEYS = {"acme": "acme-structured-key", "metered": "metered-structured-key"}
WORK = Path(tempfile.mkdtemp(prefix="loraplex-structured-"))
TENANTS_FILE = WORK / "tenants.json"
TENANTS_FILE.write_text(json.dumps({"tenants": {
    "acme": {"api_key_sha256": key_digest(KEYS["acme"]).hex()},
    "metered": {"api_key_sha256": key_digest(KEYS["metered"]).hex(), "tokens_per_minute": 30},
}}))
BASE = "nobos"  # the served checkpoint's folder name
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two small numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOLS_TEMPLATE = (  # a small Hermes/Qwen-style template that reads tools, tool_calls and tool messages
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nFor each call return <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}<tool_call>{{ {'name': tc.function.name, 'arguments': tc.function.arguments} "
    "| tojson }}</tool_call>{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>"
    "{{ m.content }}</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def no_bos_copy(demo_model: Path, out: Path, chat_template: str | None) -> Path:
    """The demo checkpoint with a tokenizer that adds no BOS (no post-processor, add_bos_token false)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(demo_model, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def models(demo) -> dict[str, Path]:
    """The served no-BOS checkpoint (a template that reads tools) and a twin whose template does not."""
    served = no_bos_copy(Path(demo["model"]), WORK / BASE, TOOLS_TEMPLATE)
    plain = no_bos_copy(Path(demo["model"]), WORK / "plain" / BASE, None)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(served)("Hi").input_ids == list(b"Hi" and [3 + ord("H"), 3 + ord("i")])
    return {"served": served, "plain": plain}


@pytest.fixture(scope="module")
def triton_server(demo, models, tmp_path_factory):
    server = demo_server(tmp_path_factory.mktemp("tritonserver"), demo, model_dir=models["served"],
                         env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)},
                         adapter_store=lambda tmp, d: seed_demo_adapters(tmp, d), ready_timeout=180)
    server.start_and_wait()
    try:
        yield server
    finally:
        server.stop(grace=10)


@pytest.fixture(scope="module")
def gateway(triton_server, models):
    with run_gateway(triton_server.grpc_url, models["served"], WORK / "gateway.log") as url:
        yield url


@pytest.fixture(scope="module")
def plain_gateway(triton_server, models):
    """The same server behind a gateway whose template does not read tools (the fallback prompt)."""
    with run_gateway(triton_server.grpc_url, models["plain"], WORK / "plain-gateway.log") as url:
        yield url


def client(url: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0)


def post(url: str, path: str, body: dict, tenant: str = "acme") -> requests.Response:
    return requests.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60)


# ---- /v1/models on a tokenizer without BOS -----------------------------------------------------------------
def test_models_on_a_checkpoint_without_bos(gateway):
    ids = [m.id for m in client(gateway).models.list().data]
    assert ids == [BASE, "demo-a", "demo-b"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway}/v1", api_key="wrong", max_retries=0).models.list()


# ---- response_format --------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [BASE, "demo-a", "demo-b"])
def test_response_format_json_schema_validates_and_json_object_parses(gateway, model):
    c = client(gateway)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(2):  # random weights wander in the whitespace JSON allows: an output that ends validates
        r = c.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, max_tokens=120,
                                      temperature=1.0, seed=seed)
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert r.choices[0].finish_reason == "length" and text.startswith("{")
    compact = {"json": PERSON, "disable_any_whitespace": True}  # vLLM's spelling: no room to wander, so it ends
    for seed in range(2):
        r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": compact})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = c.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                  max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_response_format_streamed_and_on_completions_and_vllm_keys(gateway):
    c = client(gateway)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = list(c.chat.completions.create(model="demo-b", messages=MESSAGES, response_format=fmt, max_tokens=120,
                                            temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), PERSON)
    done = c.completions.create(model=BASE, prompt="Person:", max_tokens=120, temperature=0,
                                extra_body={"response_format": fmt})
    if done.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    choice = c.completions.create(model="demo-a", prompt="Pick:", max_tokens=10, temperature=1.0, seed=1,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    regex = c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(regex.choices[0].message.content) == 3 and regex.choices[0].message.content.isdigit()


@pytest.mark.parametrize("fmt, mark", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "([a-z"}}}}}, "structured_outputs"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "structured_outputs"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
])
def test_a_bad_schema_is_400_promptly(gateway, fmt, mark):
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway).chat.completions.create(model=BASE, messages=MESSAGES, response_format=fmt, max_tokens=8)
    assert time.monotonic() - start < 10 and mark in e.value.body["message"]


def test_constraints_compile_in_niced_workers_of_the_stub_and_a_deep_schema_is_400_at_once(gateway, triton_server):
    from loraplex.launch.processes import proc_info, processes

    r = client(gateway).completions.create(model=BASE, prompt="Digits:", max_tokens=4, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert r.choices[0].text.isdigit()
    workers = [p for p in processes() if p.running and b"loraplex.engine.compile_worker" in
               Path(f"/proc/{p.pid}/cmdline").read_bytes()]
    mine = [w for w in workers if (stub := proc_info(w.ppid)) and stub.ppid == triton_server.proc.pid]
    assert mine and all(os.getpriority(os.PRIO_PROCESS, w.pid) >= 10 for w in mine)  # started by lora_llm's stub
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway).chat.completions.create(model=BASE, messages=MESSAGES, response_format=fmt, max_tokens=8)
    assert "structured_outputs: json nests more than 64 levels deep" in e.value.body["message"]


# ---- tools ------------------------------------------------------------------------------------------------
def check_call(call, names=("get_weather", "add")):
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("which", ["gateway", "plain_gateway"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_parse_and_fit_streamed_and_not(request, which, choice):
    url = request.getfixturevalue(which)
    c = client(url)
    names = ("add",) if isinstance(choice, dict) else ("get_weather", "add")
    r = c.chat.completions.create(model="demo-a", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                  max_tokens=150, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    check_call(r.choices[0].message.tool_calls[0], names)
    chunks = list(c.chat.completions.create(model="demo-a", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=150, temperature=0, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = deltas[0].tool_calls[0]
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.type == "function"
    assert (streamed.function.name, streamed.function.arguments) == (
        r.choices[0].message.tool_calls[0].function.name, r.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_give_content_or_well_formed_calls(gateway, choice):
    c = client(gateway)
    r = c.chat.completions.create(model="demo-b", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                  max_tokens=16, temperature=0)
    message = r.choices[0].message
    if message.tool_calls:
        assert choice == "auto" and r.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert call.id.startswith("call_") and json.loads(call.function.arguments) is not None
    else:
        assert isinstance(message.content, str) and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="demo-b", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=16, temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    if not message.tool_calls:
        assert text == message.content


def test_tool_history_renders_through_the_template_and_the_fallback(gateway, plain_gateway):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    for url, marks in ((gateway, ["<tools>", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"',
                                  "<tool_response>18 degrees</tool_response>"]),
                       (plain_gateway, ["You can call functions", '{"name": "get_weather", "arguments": {"city": '
                                        '"Paris"', "Result of call_1: 18 degrees"])):
        tokens = post(url, "/tokenize", {"model": "demo-a", "messages": history, "tools": TOOLS})
        assert tokens.status_code == 200, tokens.text
        text = post(url, "/detokenize", {"model": "demo-a", "tokens": tokens.json()["tokens"]}).json()["prompt"]
        for mark in marks:
            assert mark in text, (mark, text)
        r = client(url).chat.completions.create(model="demo-a", messages=history, tools=TOOLS, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tools_are_400(gateway):
    c = client(gateway)
    for tools, choice in (([{"type": "function"}], "auto"), (TOOLS, {"type": "function", "function": {"name": "x"}}),
                          ([], "required")):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=BASE, messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=4)


# ---- /tokenize, /detokenize, Retry-After ------------------------------------------------------------------
def test_tokenize_detokenize_round_trip_authenticated(gateway):
    text = "Hello, wörld"
    r = post(gateway, "/tokenize", {"model": BASE, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(text.encode()) and body["max_model_len"] == 1024
    assert post(gateway, "/detokenize", {"model": "demo-b", "tokens": body["tokens"]}).json() == {"prompt": text}
    chat = post(gateway, "/tokenize", {"model": BASE, "messages": MESSAGES}).json()
    got = client(gateway).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == got.usage.prompt_tokens  # what lora_llm counted for the same chat
    assert requests.post(f"{gateway}/tokenize", json={"prompt": text}, timeout=30).status_code == 401
    assert post(gateway, "/tokenize", {"model": "nope", "prompt": text}).status_code == 404
    assert post(gateway, "/detokenize", {"model": BASE, "tokens": [10 ** 6]}).status_code == 400


def test_retry_after_on_429(gateway):
    spend = {"model": BASE, "prompt": "spend", "max_tokens": 20, "ignore_eos": True}  # 5 + 20 of 30 a minute
    assert post(gateway, "/v1/completions", spend, tenant="metered").status_code == 200
    r = post(gateway, "/v1/completions", {"model": BASE, "prompt": "more", "max_tokens": 2}, tenant="metered")
    assert r.status_code == 429 and r.headers["Retry-After"].isdigit()
    ok = post(gateway, "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200 and "Retry-After" not in ok.headers
