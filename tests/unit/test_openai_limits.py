"""The gateway's bounds and hostile-input controls, on a real uvicorn with a fake Triton behind it.

Bodies (413 while read), messages and choices (400 before their items are validated), template
inputs (no request-supplied template; allow-listed variables), the render pool (off the event loop,
a time bound, a bounded queue), cancel-on-disconnect (before the first token, mid-stream, non-streamed)
and error texts (no addresses, paths or exception reprs; a request id instead).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import requests

from loraplex.openai.app import Settings, create_app
from loraplex.openai.callers import KnownCallers
from loraplex.openai.chat import COUNT_CHARS_PER_TOKEN, ChatRenderer
from loraplex.openai.errors import OpenAIError, client_text, from_rpc, from_triton
from loraplex.openai.limits import Limits
from loraplex.openai.offload import RenderPool
from loraplex.openai.process import GATEWAY_ID_HEADER, GatewayProcess
from loraplex.openai.protocol import ChatCompletionRequest
from loraplex.openai.template_inputs import TEMPLATE_VARIABLES
from loraplex.openai.triton_stream import Delta
from loraplex.launch.tritonserver import free_ports

LIMITS = Limits(max_body_bytes=64 * 1024, max_messages=8, max_choices=6, render_threads=2, render_timeout_s=1.0,
                max_upload_bytes=256 * 1024)
BAD_KEY = "bad-key"  # the fake Triton refuses this key (401) and takes any other
MESSAGES = [{"role": "user", "content": "Hi"}]
SLOW = "SLOW"  # a message with this content renders until SlowRenderer.release is set, SLOW_S at most
SLOW_S = 15.0


class FakeTriton:
    """lora_llm's stand-in: answers at once, never answers a HANG prompt, streams a STREAM one; records cancels."""

    def __init__(self):
        self.started, self.cancelled, self.failure = [], [], None

    async def ready(self):
        return True

    async def close(self):
        pass

    async def visible_adapters(self, headers, cursor=None, limit=None):
        self.listed = getattr(self, "listed", 0) + 1
        if headers.get("x-api-key") == BAD_KEY:
            raise OpenAIError(401, "missing or invalid API key", "invalid_request_error", None, "invalid_api_key")
        return [], None

    async def generate(self, prompt, params, headers, logprobs=False, request_id=None):
        self.started.append(request_id)
        try:
            if self.failure is not None:
                raise self.failure
            if "HANG" in prompt:
                await asyncio.sleep(3600)
            if "STREAM" in prompt:
                for _ in range(3600):
                    yield Delta(["x"], [1], [None], 3)
                    await asyncio.sleep(0.05)
            yield Delta([f"echo:{params.get('max_tokens')}"], [1], ["stop"], 3)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


class SlowRenderer(ChatRenderer):
    """The demo tokenizer, but a message 'SLOW' renders until released (a thread that cannot be stopped)."""

    slow_running = 0
    renders = 0
    release = threading.Event()

    def render(self, messages, *args, **kwargs):
        SlowRenderer.renders += 1
        if any(m["content"] == SLOW for m in messages):
            SlowRenderer.slow_running += 1
            SlowRenderer.release.wait(SLOW_S)
            SlowRenderer.slow_running -= 1
        return super().render(messages, *args, **kwargs)


def ended_calls(app, ended: set):
    """``app``, adding each HTTP call's client address to ``ended`` once the app returned from it."""
    async def counted(scope, receive, send):
        try:
            return await app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                ended.add(tuple(scope["client"]))
    return counted


GATEWAY_ID = "gateway-under-test"


@pytest.fixture(scope="module")
def served(demo):
    """(base URL, FakeTriton) of a gateway on uvicorn in a thread, with LIMITS; triton.ended: calls the app ended."""
    import uvicorn

    (port,) = free_ports(1)
    triton = FakeTriton()
    triton.ended = set()
    settings = Settings(triton_url="unused:1", base_model="model", model_dir=str(demo["model"]),
                        max_model_len=1024, limits=LIMITS, gateway_id=GATEWAY_ID)
    app = ended_calls(create_app(settings, triton=triton, renderer=SlowRenderer(demo["model"])), triton.ended)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield url, triton
    server.should_exit = True
    thread.join(timeout=10)


def test_health_names_the_gateway_so_its_launcher_tells_it_from_another_on_its_port(served):
    """loraplex-serve's probe takes /health only from the gateway it started: another one that took the port
    (with auto-picked ports, a parallel test's) answers 200 too, naming another id."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    assert requests.get(f"{url}/health", timeout=5).headers[GATEWAY_ID_HEADER] == GATEWAY_ID
    mine, stranger = GatewayProcess("unused:1", port), GatewayProcess("unused:1", port)
    mine.gateway_id = GATEWAY_ID
    assert mine.answers() and not stranger.answers()
    assert stranger.env()["LORAPLEX_GATEWAY_ID"] == stranger.gateway_id != GATEWAY_ID


def post(url, path, body, **kw):
    return requests.post(f"{url}{path}", json=body, timeout=kw.pop("timeout", 30), **kw)


def error_of(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    return error


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)
    return time.monotonic() - (deadline - timeout)


def raw(url) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def read_response(sock) -> tuple[int, bytes]:
    """Status and bytes of a response the server ends by closing the connection."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


# ---- bodies ----------------------------------------------------------------------------------------------
def test_a_declared_oversize_body_is_413_before_any_of_it_is_read(served):
    url, triton = served
    sock = raw(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 104857600\r\n\r\n")  # 100 MiB announced, none sent
    status, data = read_response(sock)
    sock.close()
    assert status == 413 and b"x-request-id: " in data.lower()
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"


def test_a_chunked_body_is_cut_off_once_it_passes_the_bound(served):
    url, triton = served
    sock = raw(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    sent, chunk = 0, b"x" * 8192
    sock.settimeout(0.05)
    while True:
        try:
            answer = sock.recv(65536)
            break
        except socket.timeout:
            pass
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)
        assert sent < 64 * LIMITS.max_body_bytes, "the gateway kept reading"
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert sent < 4 * LIMITS.max_body_bytes  # refused near the bound, not after the client was done


def test_bodies_within_the_bound_are_served_and_bad_json_is_400(served):
    url, _ = served
    r = post(url, "/v1/completions", {"prompt": "a" * (LIMITS.max_body_bytes - 100), "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "echo:2"
    assert r.headers["x-request-id"]
    deep = requests.post(f"{url}/v1/completions", data="[" * 20000 + "]" * 20000, timeout=30)
    assert error_of(deep, 400)["message"] == "the body is not valid JSON"
    assert error_of(requests.post(f"{url}/v1/completions", data="[1]", timeout=30), 400)["message"] == \
        "the body must be a JSON object"


def test_a_large_body_is_parsed_only_after_the_callers_key_passed(served, monkeypatch):
    import loraplex.openai.app as app_module

    url, triton = served
    monkeypatch.setattr(app_module, "AUTH_FIRST_BYTES", 1024)
    bad = {"Authorization": f"Bearer {BAD_KEY}"}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        large = requests.post(f"{url}{path}", data="[" * 2048, headers=bad, timeout=30)
        assert error_of(large, 401, None, "invalid_api_key")  # not "not valid JSON": never parsed
        small = requests.post(f"{url}{path}", data="[" * 512, headers=bad, timeout=30)
        assert error_of(small, 400)["message"] == "the body is not valid JSON"  # small: parsed, as before
    good, listed = {"Authorization": "Bearer good-key"}, getattr(triton, "listed", 0)
    for _ in range(3):  # a caller Triton accepted is not asked again for a while
        assert error_of(requests.post(f"{url}/v1/completions", data="[" * 2048, headers=good, timeout=30),
                        400)["message"] == "the body is not valid JSON"
    assert triton.listed == listed + 1


def test_known_callers_are_kept_a_while_and_a_bounded_number():
    callers = KnownCallers(ttl_s=60.0, size=2)
    a, b, c = ({"x-api-key": k} for k in "abc")
    assert not callers.known(a)
    callers.accepted(a)
    callers.accepted(b)
    assert callers.known(a) and callers.known(b) and not callers.known({"x-api-key": "a", "x-tenant-id": "t"})
    callers.accepted(c)  # the oldest goes
    assert not callers.known(a) and callers.known(c)
    expired = KnownCallers(ttl_s=0.0)
    expired.accepted(a)
    assert not expired.known(a)


# ---- counts ----------------------------------------------------------------------------------------------
def test_messages_and_prompts_are_counted_before_their_items_are_validated(served):
    url, _ = served
    too_many = [{"role": "user", "content": "x"}] * LIMITS.max_messages + [{"content": "no role"}]
    error = error_of(post(url, "/v1/chat/completions", {"messages": too_many}), 400, "messages")
    assert error["message"] == f"messages: {LIMITS.max_messages + 1} messages; at most {LIMITS.max_messages} per request"
    error = error_of(post(url, "/v1/completions", {"prompt": ["a"] * LIMITS.max_choices + [1]}), 400, "prompt")
    assert error["message"].startswith(f"prompt: {LIMITS.max_choices + 1} prompts; at most {LIMITS.max_choices}")
    for field, items, bound in (("stop", ["s"] * 64 + [1], 64), ("stop_token_ids", [1] * 1024 + ["x"], 1024),
                                ("logit_bias", {str(i): 0 for i in range(1025)}, 1024)):
        error = error_of(post(url, "/v1/completions", {"prompt": "x", field: items}), 400, field)
        assert error["message"].startswith(f"{field}: {len(items)} ") and f"at most {bound}" in error["message"]
    ok = [{"role": "user", "content": "x"}] * LIMITS.max_messages
    assert post(url, "/v1/chat/completions", {"messages": ok, "max_tokens": 1}).status_code == 200


def test_prompts_times_n_is_bounded(served):
    url, triton = served
    before = len(triton.started)
    error_of(post(url, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}), 400, "n")
    error_of(post(url, "/v1/chat/completions", {"messages": MESSAGES, "n": LIMITS.max_choices + 1}), 400, "n")
    assert len(triton.started) == before  # refused before any stream opened
    r = post(url, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 6 == LIMITS.max_choices


# ---- template inputs -------------------------------------------------------------------------------------
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("fields, param", [
    ({"chat_template": NESTED_LOOP}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": NESTED_LOOP}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": [True] * 1000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"reasoning_effort": "x" * 10000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
])
def test_a_request_never_supplies_a_template(served, fields, param):
    url, triton = served
    before, renders = len(triton.started), SlowRenderer.renders
    r = post(url, "/v1/chat/completions", {"messages": MESSAGES, **fields}, timeout=60)
    error = error_of(r, 400, param)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param}: ")
    assert SlowRenderer.renders == renders  # refused before any template ran
    assert len(triton.started) == before


def test_allowed_template_variables_reach_the_operators_template(demo, tmp_path):
    from loraplex.models.builtin.demo import build_byte_tokenizer

    build_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "[{{ enable_thinking }}|{{ thinking }}|{{ reasoning_effort }}|{{ add_generation_prompt }}]")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    renderer = ChatRenderer(tmp_path)
    body = ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={
        "enable_thinking": False, "thinking": True, "reasoning_effort": "low", "add_generation_prompt": False})
    text, used = renderer.prompt(body.messages, True, body.chat_template_kwargs, 1024)
    assert text == "Hi[False|True|low|False]"
    assert used == len(renderer.tokenizer(text).input_ids)
    assert set(TEMPLATE_VARIABLES) == {"add_generation_prompt", "enable_thinking", "thinking", "reasoning_effort"}


def test_token_counts_read_a_bounded_prefix(demo):
    renderer = ChatRenderer(demo["model"])
    assert renderer.count_tokens("hello", 1024) == len(renderer.tokenizer("hello").input_ids)
    huge = "x" * (4 * 1024 * 1024)  # the byte tokenizer: one token a byte; the whole would take seconds
    tokenize, read = renderer.tokenizer, []
    renderer.tokenizer = lambda text, *a, **kw: read.append(len(text)) or tokenize(text, *a, **kw)
    assert renderer.count_tokens(huge, 64) >= 64
    assert read and sum(read) <= 64 * COUNT_CHARS_PER_TOKEN  # the prefix only, never the whole


# ---- the render pool -------------------------------------------------------------------------------------
def test_a_slow_render_is_503_at_the_bound_and_the_loop_serves_others_meanwhile(served):
    url, triton = served
    results = {}

    def slow():
        t0 = time.monotonic()
        r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": SLOW}]})
        results["slow"] = (r, time.monotonic() - t0, SlowRenderer.slow_running)

    SlowRenderer.release.clear()
    thread = threading.Thread(target=slow)
    thread.start()
    try:
        wait_until(lambda: SlowRenderer.slow_running == 1)
        good = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})  # the other thread
        health = requests.get(f"{url}/health", timeout=5)
        assert "slow" not in results  # both were served before the slow request's bound...
        assert SlowRenderer.slow_running == 1  # ...and while its render ran
        thread.join()
    finally:
        SlowRenderer.release.set()  # the abandoned thread ends before the next test
        wait_until(lambda: SlowRenderer.slow_running == 0)
    r, took, rendering = results["slow"]
    assert good.status_code == 200 and health.status_code == 200
    error = error_of(r, 503, None, "render_timeout")
    assert error["type"] == "service_unavailable_error" and "--render-timeout" in error["message"]
    assert took >= LIMITS.render_timeout_s and rendering == 1  # at the bound, while the render still ran


def test_the_pool_runs_at_most_its_threads_and_refuses_past_its_queue():
    started, gate = [], threading.Event()

    def job(i):
        started.append(i)
        gate.wait(5)
        return i

    async def run():
        pool = RenderPool(threads=2, timeout_s=0.5)
        pool.max_admitted = 3
        jobs = [asyncio.ensure_future(pool.run(job, i)) for i in range(3)]
        while len(started) < 2:
            await asyncio.sleep(0.01)
        assert len(pool._executor._threads) == 2  # two threads (all three jobs were submitted by now)
        assert pool.busy == 2
        with pytest.raises(Exception) as busy:
            await pool.run(job, 3)
        assert busy.value.status == 503 and busy.value.code == "service_unavailable"
        results = await asyncio.gather(*jobs, return_exceptions=True)
        assert all(getattr(r, "code", None) == "render_timeout" for r in results)
        assert pool.busy == 2  # answered, still running
        gate.set()
        assert await pool.run(job, 4) == 4 and pool.admitted == 0
        pool._executor.shutdown(wait=True)  # whatever is still queued runs before the threads end
        assert sorted(started) == [0, 1, 4]  # the queued job timed out and was dropped, never run
        assert pool.busy == 0
        pool.close()

    asyncio.run(run())


# ---- disconnects -----------------------------------------------------------------------------------------
HANG_CHAT = [{"role": "user", "content": "HANG"}]


@pytest.mark.parametrize("path, body, midstream", [
    ("/v1/completions", {"prompt": "HANG", "stream": True}, False),
    ("/v1/completions", {"prompt": "HANG"}, False),
    ("/v1/chat/completions", {"messages": HANG_CHAT, "stream": True}, False),
    ("/v1/chat/completions", {"messages": HANG_CHAT}, False),
    ("/v1/completions", {"prompt": "STREAM", "stream": True}, True),
])
def test_a_client_that_leaves_cancels_its_triton_stream(served, path, body, midstream):
    url, triton = served
    before = len(triton.started)
    if midstream:
        r = requests.post(f"{url}{path}", json=body, stream=True, timeout=30)
        next(line for line in r.iter_lines() if line)
        r.close()
    else:  # waits for a first token that never comes (queued in the engine), then gives up
        with pytest.raises(requests.Timeout):
            requests.post(f"{url}{path}", json=body, timeout=0.5)
    wait_until(lambda: len(triton.started) > before)
    rid = triton.started[-1]
    assert wait_until(lambda: rid in triton.cancelled, timeout=3) < 3


def test_a_client_that_leaves_mid_body_starts_nothing(served):
    url, triton = served
    before = len(triton.started)
    sock = raw(url)
    client = sock.getsockname()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"x\", \"max_tokens\": 1}")  # whole JSON, short body
    sock.close()
    wait_until(lambda: client in triton.ended)  # the gateway is done with the request
    assert len(triton.started) == before
    assert requests.get(f"{url}/health", timeout=5).status_code == 200


# ---- adapter uploads (a streamed route) -----------------------------------------------------------------
UPLOAD_HEAD = b"POST /v1/lora_adapters HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"


def test_an_upload_with_a_bad_key_is_401_before_its_body_is_read(served):
    url, _ = served
    sock = raw(url)
    sock.sendall(UPLOAD_HEAD + f"Authorization: Bearer {BAD_KEY}\r\nContent-Length: 100000\r\n\r\n".encode())
    sock.settimeout(5)
    answer = whole_answer(sock, sock.recv(65536))  # none of the body was sent
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in answer


def whole_answer(sock, data: bytes) -> bytes:
    """``data`` and the rest of its response, up to its Content-Length."""
    sock.settimeout(5)
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            data.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
        data += sock.recv(65536)
    return data


def send_until_answered(sock, head: bytes, chunk: bytes, most: int) -> tuple[bytes, int]:
    """Send ``head``, then ``chunk`` as HTTP chunks until the server answers (bytes sent: at most ``most``)."""
    sock.sendall(head)
    sock.settimeout(0.05)
    sent = 0
    while True:
        try:
            return whole_answer(sock, sock.recv(65536)), sent
        except socket.timeout:
            pass
        assert sent < most, "the gateway kept reading"
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)


def test_a_long_part_header_is_refused_at_its_bound_while_it_is_read(served):
    url, _ = served
    sock = raw(url)
    part = b"--b\r\nContent-Disposition: form-data; "
    head = UPLOAD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(part), part)
    answer, sent = send_until_answered(sock, head, b"a" * 2048, 64 * 1024)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 400 ") and b"headers are over 8192 bytes" in answer
    assert sent < 32 * 1024  # refused near the part header's bound (8 KiB), not at the body's
    assert requests.get(f"{url}/health", timeout=5).status_code == 200


def test_an_upload_past_its_bound_is_413_while_it_is_read(served):
    url, _ = served
    sock = raw(url)
    part = b'--b\r\nContent-Disposition: form-data; name="adapter_model"\r\n\r\n'
    head = UPLOAD_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(part), part)
    answer, sent = send_until_answered(sock, head, b"w" * 32768, 64 * LIMITS.max_upload_bytes)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close" in answer.lower()
    assert sent < 2 * LIMITS.max_upload_bytes


def test_a_client_that_leaves_mid_upload_ends_its_request(served):
    url, triton = served
    sock = raw(url)
    client = sock.getsockname()
    sock.sendall(UPLOAD_HEAD + b"Content-Length: 1000\r\n\r\n--b\r\n")
    sock.close()
    wait_until(lambda: client in triton.ended)
    assert requests.get(f"{url}/health", timeout=5).status_code == 200


# ---- error texts -----------------------------------------------------------------------------------------
class RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_grpc_details_never_reach_the_client():
    leak = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:8001: Connection refused"
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.PERMISSION_DENIED):
        error = from_rpc(RpcError(code, leak), "r1")
        assert "10.1.2.3" not in error.message and "8001" not in error.message and "ipv4" not in error.message
        assert error.status == (500 if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.PERMISSION_DENIED)
                                else 503)
    assert from_rpc(RpcError(grpc.StatusCode.INTERNAL, leak), "r1").message == \
        "internal error in the gateway (request id r1)"


@pytest.mark.parametrize("message, shown", [
    ("prompt has 5 tokens and max_tokens is 5000: 5005 exceeds the model's max length 1024",
     "prompt has 5 tokens and max_tokens is 5000: 5005 exceeds the model's max length 1024"),
    ("cannot read /var/lib/loraplex/adapters/acme/a/adapter_config.json", "cannot read <redacted>"),
    ("Triton at triton.internal:8001 or http://10.0.0.2:8000/v2 failed", "Triton at <redacted> or <redacted> failed"),
    ("n is 17 but at most 16 is allowed (max_n)", "n is 17 but at most 16 is allowed (max_n)"),
    ("at a:8001-b:80 and [::1]:8001 via 1http://x/y", "at <redacted>-<redacted> and <redacted> via 1<redacted>"),
    ("file /srv/a/b.json, x-ipv4:10.0.0.1:80 done", "file <redacted>, x-<redacted> done"),
    ("tenant quota exceeded: tokens_per_minute=30 at 12:30; retry later",
     "tenant quota exceeded: tokens_per_minute=30 at 12:30; retry later"),
])
def test_lora_llm_messages_pass_without_addresses_or_paths(message, shown):
    assert client_text(message) == shown
    assert from_triton(message).message == shown


def test_tracebacks_and_grpc_debug_strings_become_a_generic_500():
    for leak in ('Traceback (most recent call last):\n  File "/opt/x.py", line 1',
                 'debug_error_string = "UNKNOWN:Error received from peer {grpc_status:13}"'):
        error = from_triton(leak, "abc")
        assert (error.status, error.code, error.message) == (500, "internal_error",
                                                             "internal error in the gateway (request id abc)")


def test_an_unexpected_failure_is_500_with_the_request_id_and_no_repr(served):
    url, triton = served
    triton.failure = RuntimeError("secret at /srv/keys.json talking to 10.0.0.9:8001")
    try:
        r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        error = error_of(r, 500, None, "internal_error")
        assert error["message"] == f"internal error in the gateway (request id {r.headers['x-request-id']})"
        assert triton.started[-1] == f"{r.headers['x-request-id']}-0"  # Triton's request id carries it
    finally:
        triton.failure = None
    health = requests.get(f"{url}/health", timeout=5)
    assert health.status_code == 200


def test_models_and_errors_name_no_path(served, demo):
    url, _ = served
    models = requests.get(f"{url}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["root"] == "model"  # the served name, as vLLM
    assert str(Path(demo["model"])) not in models.text and str(Path(demo["model"]).resolve()) not in models.text
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    error = error_of(r, 400, "messages")
    assert str(Path(demo["model"])) not in error["message"]
