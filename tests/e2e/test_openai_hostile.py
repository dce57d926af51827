"""The OpenAI gateway against a hostile tenant: a real tritonserver (tenants file) and a real gateway process.

Each attack is bounded in time, and a good request of another tenant is served while it runs:
request-supplied templates (refused), a render that outlasts its bound (the operator's template,
made to spin on one message: 503 at the bound while the loop serves others), oversize bodies (413
before they are read), too many messages or choices (400), and clients that leave while their
request waits in the engine's queue (the engine counts an abort while the request ahead of it
still runs, and the request never starts: every request of the tenant that started was one of those ahead).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from helpers import run_gateway, scrape
from tritonserver_fixture import make_triton_server_fixture, seed_demo_adapters

from loraplex.tenancy.tenants import key_digest

KEYS = {"acme": "acme-hostile-key", "mallory": "mallory-hostile-key", "queued": "queued-hostile-key"}
WORK = Path(tempfile.mkdtemp(prefix="loraplex-openai-hostile-"))
TENANTS_FILE = WORK / "tenants.json"
TENANTS_FILE.write_text(json.dumps({"tenants": {
    "acme": {"api_key_sha256": key_digest(KEYS["acme"]).hex()},
    "mallory": {"api_key_sha256": key_digest(KEYS["mallory"]).hex()},
    "queued": {"api_key_sha256": key_digest(KEYS["queued"]).hex(), "max_concurrent_requests": 1},
}}))
BASE = "model"
MAX_BODY = 256 * 1024
RENDER_TIMEOUT_S = 2.0
GATEWAY_FLAGS = ["--max-body-bytes", str(MAX_BODY), "--max-messages", "64", "--max-choices", "8",
                 "--render-threads", "2", "--render-timeout", str(RENDER_TIMEOUT_S)]
ATTACK_BOUND_S = 10.0  # every hostile request is answered within this (2 shared cores)
GOOD_BOUND_S = 15.0  # a good request of another tenant, served meanwhile
# The attack: a two-line nested loop in a request-supplied template (minutes of rendering).
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# The operator's own template spins on a message 'SPIN' (~6 s here): a render over its bound.
SPIN = ("{% for message in messages %}{% if message['content'] == 'SPIN' %}{% for i in range(12000) %}"
        "{% for j in range(12000) %}{% endfor %}{% endfor %}{% endif %}{% endfor %}")
MESSAGES = [{"role": "user", "content": "What is LoRA?"}]

triton_server = make_triton_server_fixture(env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)},
                                           adapter_store=lambda tmp, demo: seed_demo_adapters(tmp, demo))


def spinning_model_dir(demo) -> Path:
    """The demo checkpoint's tokenizer and config, its chat template prefixed with SPIN."""
    out = WORK / "model"
    out.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo["model"]) / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = SPIN + cfg["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def gateway(triton_server, demo):
    """`loraplex-openai` with small limits in front of the module's server; yields its base URL."""
    with run_gateway(triton_server.grpc_url, spinning_model_dir(demo), WORK / "gateway.log", "--served-model-name", BASE, *GATEWAY_FLAGS) as url:
        yield url


def client(gateway, tenant: str, timeout: float = GOOD_BOUND_S) -> openai.OpenAI:
    """The SDK with the tenant's key; no retries (a 4xx/5xx must show at once)."""
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEYS[tenant], max_retries=0, timeout=timeout)


def good_chat(gateway) -> float:
    """acme's chat, greedy, 8 tokens; returns its latency (fails past GOOD_BOUND_S)."""
    t0 = time.monotonic()
    got = client(gateway, "acme").chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8,
                                                          temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 8
    return time.monotonic() - t0


def render_threads_busy(gateway) -> float:
    """The gateway's render threads running a job now (its /metrics)."""
    text = requests.get(f"{gateway}/metrics", timeout=5).text
    return float(re.search(r"^loraplex_openai_render_threads_busy (\S+)$", text, re.M).group(1))


def timed(fn):
    """(result or exception, seconds) of ``fn()``."""
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the caller asserts which
        out = exc
    return out, time.monotonic() - t0


# ---- templates -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"chat_template": NESTED_LOOP}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": NESTED_LOOP}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": {"nested": [NESTED_LOOP]}}}, "chat_template_kwargs"),
])
def test_a_request_supplied_template_is_refused_while_another_tenant_is_served(gateway, fields, param):
    hostile = client(gateway, "mallory", timeout=ATTACK_BOUND_S)
    with ThreadPoolExecutor(2) as pool:
        attack = pool.submit(timed, lambda: hostile.chat.completions.create(model=BASE, messages=MESSAGES,
                                                                            max_tokens=4, extra_body=fields))
        good = pool.submit(good_chat, gateway)
        (error, took), good_s = attack.result(), good.result()
    assert isinstance(error, openai.BadRequestError), error  # not a timeout: the template never rendered
    assert error.status_code == 400 and error.body["param"] == param and error.body["type"] == "invalid_request_error"
    assert took < ATTACK_BOUND_S and good_s < GOOD_BOUND_S


def test_a_render_over_its_bound_is_503_and_the_gateway_serves_others_meanwhile(gateway):
    hostile = client(gateway, "mallory", timeout=ATTACK_BOUND_S)
    spin = [{"role": "user", "content": "SPIN"}]
    with ThreadPoolExecutor(3) as pool:
        attack = pool.submit(timed, lambda: hostile.chat.completions.create(model=BASE, messages=spin, max_tokens=4))
        assert _poll(lambda: render_threads_busy(gateway), 1, ATTACK_BOUND_S) == 1  # the spin renders on one thread
        chat = pool.submit(good_chat, gateway)
        completion = pool.submit(timed, lambda: client(gateway, "acme").completions.create(
            model=BASE, prompt="Hello", max_tokens=4, temperature=0))
        chat_s, (done, completion_s) = chat.result(), completion.result()
        good_before_503 = not attack.done()
        error, took = attack.result()
        busy_after_503 = render_threads_busy(gateway)
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
    assert error.body["code"] == "render_timeout" and error.body["type"] == "service_unavailable_error"
    assert RENDER_TIMEOUT_S <= took < ATTACK_BOUND_S and busy_after_503 == 1  # at the bound, while the spin ran on
    assert done.choices[0].text and completion_s < GOOD_BOUND_S and chat_s < GOOD_BOUND_S
    assert good_before_503  # both served before the spin's own 503 came
    # the spinning thread cannot be stopped: let it end before the next test
    assert _poll(lambda: render_threads_busy(gateway), 0, 60) == 0


# ---- sizes -----------------------------------------------------------------------------------------------
def _oversize(url: str) -> tuple[int, float]:
    """A body announced at 1 GiB, none of it sent: (status, seconds to the answer)."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=ATTACK_BOUND_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS["mallory"].encode() + b"\r\nContent-Length: 1073741824\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    return int(data.split(b" ", 2)[1]), time.monotonic() - t0


def test_oversize_bodies_are_413_before_they_are_read_while_another_tenant_is_served(gateway):
    with ThreadPoolExecutor(9) as pool:
        attacks = [pool.submit(_oversize, gateway) for _ in range(8)]
        good_s = good_chat(gateway)
        results = [a.result() for a in attacks]
    assert all(status == 413 and took < ATTACK_BOUND_S for status, took in results)
    assert good_s < GOOD_BOUND_S
    just_over = requests.post(f"{gateway}/v1/completions", data=b"x" * (MAX_BODY + 1), timeout=ATTACK_BOUND_S,
                              headers={"Authorization": f"Bearer {KEYS['mallory']}",
                                       "Content-Type": "application/json"})
    assert just_over.status_code == 413 and just_over.json()["error"]["type"] == "invalid_request_error"


def test_too_many_messages_or_choices_are_400_naming_the_field(gateway):
    hostile = client(gateway, "mallory", timeout=ATTACK_BOUND_S)
    cases = [
        (lambda: hostile.chat.completions.create(model=BASE, messages=MESSAGES * 65, max_tokens=1), "messages"),
        (lambda: hostile.completions.create(model=BASE, prompt=["a"] * 9, max_tokens=1), "prompt"),
        (lambda: hostile.completions.create(model=BASE, prompt=["a", "b", "c"], n=3, max_tokens=1), "n"),
    ]
    for call, param in cases:
        error, took = timed(call)
        assert isinstance(error, openai.BadRequestError) and error.body["param"] == param, error
        assert took < ATTACK_BOUND_S
    short = [{"role": "user", "content": "x"}]
    assert len(client(gateway, "acme").chat.completions.create(model=BASE, messages=short * 64,
                                                               max_tokens=1).choices) == 1


# ---- disconnects -----------------------------------------------------------------------------------------
def _metric(server, name: str, **labels) -> float:
    return scrape(server, name, tenant="queued", **labels) or 0.0


def _poll(fn, want, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (value := fn()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


HEADERS = {"Authorization": f"Bearer {KEYS['queued']}"}
# The demo tokenizer is byte-level: a prompt of b bytes is b + 1 tokens. Each blocker's prompt is 2 tokens, the
# request that leaves has 8 or more: the tenant's started requests hold 2 prompt tokens each only if it never started.
BLOCKER_PROMPT_TOKENS = 2
LONG = {"model": BASE, "prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
BLOCKERS = 8  # 'queued' runs one request at a time; these run one after another (~0.7 s each here)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "waiting", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "waiting", "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True}),
])
def test_a_client_that_leaves_while_queued_cancels_its_request_in_the_engine(triton_server, gateway, path, body):
    """A request queued behind its tenant's others is aborted in the engine as soon as its client gives up, and
    never starts: counted exactly by the tenant's started requests and their prompt tokens."""
    aborts = _metric(triton_server, "loraplex_request_finished_total", finish_reason="abort")
    started = _metric(triton_server, "loraplex_queue_time_seconds_count")  # one per request at its first scheduling
    prompt_tokens = _metric(triton_server, "loraplex_prompt_tokens_total")  # counted at the same moment
    blockers = []
    try:
        for _ in range(BLOCKERS):  # the first answers at once; the others are queued behind it
            blockers.append(threading.Thread(target=lambda: blockers.append(requests.post(
                f"{gateway}/v1/completions", json=LONG, headers=HEADERS, stream=True, timeout=60))))
            blockers[-1].start()
        assert _poll(lambda: _metric(triton_server, "loraplex_requests_waiting") >= BLOCKERS - 2, True, 10)
        gave_up, t0 = timed(lambda: requests.post(f"{gateway}{path}", json={"model": BASE, **body}, headers=HEADERS,
                                                  timeout=1.0))
        assert isinstance(gave_up, requests.Timeout), gave_up  # no answer while queued: the client gave up
        assert _poll(lambda: _metric(triton_server, "loraplex_request_finished_total", finish_reason="abort"),
                     aborts + 1, 5) == aborts + 1  # aborted (nothing else was cancelled yet) ...
        assert _metric(triton_server, "loraplex_requests_running") == 1.0  # ... while a blocker still ran
    finally:
        for item in blockers:
            if isinstance(item, threading.Thread):
                item.join()
        for item in blockers:
            if isinstance(item, requests.Response):
                item.close()
    assert _poll(lambda: _metric(triton_server, "loraplex_requests_running")
                 + _metric(triton_server, "loraplex_requests_waiting"), 0.0, 20) == 0.0
    # idle, as published with the counters below: every start is counted; the leaving request's was not
    started = _metric(triton_server, "loraplex_queue_time_seconds_count") - started
    prompt_tokens = _metric(triton_server, "loraplex_prompt_tokens_total") - prompt_tokens
    assert started >= 1 and prompt_tokens == BLOCKER_PROMPT_TOKENS * started, (started, prompt_tokens)
