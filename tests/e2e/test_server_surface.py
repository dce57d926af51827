"""The server around the tenant boundary, tried as a hostile caller would (docs/security.md).

`loraplex-serve` in authenticated mode (a tenants file) with the OpenAI gateway: Triton's own APIs
(shared memory, repository, model config, statistics, logging, trace) refuse callers without a key
and callers with a tenant's key, over HTTP and gRPC, and answer the operator's admin header; health,
metadata and inference stay open, inference behind the tenant's key; another tenant's stream is
served while the attacks run. Development mode listens on loopback only, refuses a network address
without the opt-in flag, and the launcher's death takes the gateway along even when the gateway
cannot act on a signal.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from tritonserver_fixture import SERVE_EXIT_TIMEOUT, Launcher, descendants, start_launcher, wait_gone

from loraplex.clients.generate import stream_generate
from loraplex.openai.process import GUARD_GRACE
from loraplex.exceptions import AUTH_ERROR
from loraplex.tenancy.tenants import key_digest
from loraplex.launch.tritonserver import ADMIN_HEADER, RESTRICTED_APIS, free_ports

KEYS = {"acme": "acme-surface-key", "globex": "globex-surface-key"}
ADMIN_KEY = "operator-surface-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # Triton's gRPC form of a restricted-API header
REFUSED_HTTP = "This API is restricted, expecting header 'x-loraplex-admin-key'"
SHM_REGION = {"key": "/triton_python_backend_shm_region_1", "offset": 0, "byte_size": 16}

# Triton's own HTTP APIs: (method, path, body, whether the operator may call it here without side effects)
ADMIN_HTTP = [
    ("post", "/v2/repository/index", {}, True),
    ("post", "/v2/repository/models/lora_llm/unload", {}, False),
    ("post", "/v2/repository/models/lora_llm/load", {}, False),
    ("get", "/v2/models/lora_llm/config", None, True),
    ("get", "/v2/models/stats", None, True),
    ("get", "/v2/models/lora_adapters/stats", None, True),
    ("get", "/v2/systemsharedmemory/status", None, True),
    ("post", "/v2/systemsharedmemory/region/evil/register", SHM_REGION, False),
    ("post", "/v2/systemsharedmemory/unregister", {}, False),
    ("get", "/v2/cudasharedmemory/status", None, False),
    ("get", "/v2/logging", None, True),
    ("post", "/v2/logging", {"log_verbose_level": 3}, False),
    ("get", "/v2/trace/setting", None, True),
    ("post", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}, False),
]
# The same over gRPC (tritonclient.grpc method, args, whether the operator may call it here)
ADMIN_GRPC = [
    ("get_model_repository_index", (), True),
    ("unload_model", ("lora_llm",), False),
    ("load_model", ("lora_llm",), False),
    ("get_model_config", ("lora_llm",), True),
    ("get_inference_statistics", (), True),
    ("get_system_shared_memory_status", (), True),
    ("register_system_shared_memory", ("evil", SHM_REGION["key"], 16), False),
    ("unregister_system_shared_memory", (), False),
    ("get_log_settings", (), True),
    ("update_log_settings", ({"log_verbose_level": 3},), False),
    ("get_trace_settings", (), True),
    ("update_trace_settings", (None, {"trace_level": ["TIMESTAMPS"]}), False),
    ("get_cuda_shared_memory_status", (), False),
]
# Which of RESTRICTED_APIS a path or a gRPC method belongs to (Triton's groups); the first word found decides
API_GROUPS = {"sharedmemory": "shared-memory", "shared_memory": "shared-memory", "repository": "model-repository",
              "load_model": "model-repository", "config": "model-config", "stat": "statistics", "log": "logging",
              "trace": "trace"}


def api_group(endpoint: str) -> str:
    """The restricted-API group of an HTTP path or a tritonclient.grpc method name."""
    return next(group for word, group in API_GROUPS.items() if word in endpoint)


def write_tenants(path: Path) -> Path:
    path.write_text(json.dumps({"tenants": {t: {"api_key_sha256": key_digest(k).hex()} for t, k in KEYS.items()}}))
    return path


def serving(launcher: Launcher, gateway_port: int | None = None) -> Launcher:
    """Wait until Triton (and the gateway, when asked) answers."""
    launcher.wait_serving()
    deadline = time.monotonic() + 60
    while gateway_port and not _answers(f"http://127.0.0.1:{gateway_port}/health"):
        assert time.monotonic() < deadline and launcher.proc.poll() is None, launcher.stderr()
        time.sleep(0.2)
    return launcher


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).ok
    except requests.RequestException:
        return False


@pytest.fixture(scope="module")
def keyed(demo, tmp_path_factory):
    """loraplex-serve with a tenants file, an operator key and the gateway: (launcher, gateway port)."""
    tmp = tmp_path_factory.mktemp("surface")
    (gateway_port,) = free_ports(1)
    launcher = start_launcher(tmp, demo["model"], ["--tenants-file", str(write_tenants(tmp / "tenants.json")),
                                                   "--openai-port", str(gateway_port)],
                              env={"LORAPLEX_ADMIN_KEY": ADMIN_KEY})
    try:
        yield serving(launcher, gateway_port), gateway_port
    finally:
        sessions = launcher.sessions()
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.proc.wait(timeout=SERVE_EXIT_TIMEOUT + 30)
        wait_gone(sessions, timeout=10)


def _good_stream(launcher: Launcher, tenant: str, max_tokens: int = 48) -> tuple[threading.Thread, dict]:
    """Another tenant's greedy stream, run in a thread while the attacks go on."""
    out: dict = {}

    def run():
        out["result"] = stream_generate(launcher.grpc_url, "a good request", {"max_tokens": max_tokens,
                                        "ignore_eos": True, "temperature": 0},
                                        headers={"x-api-key": KEYS[tenant]}, return_num_output_tokens=True)
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _served(thread: threading.Thread, out: dict, max_tokens: int = 48) -> None:
    thread.join(timeout=120)
    result = out["result"]
    assert result.error is None and result.final_count == 1, result.error and result.error.message()
    assert sum(r["num_output_tokens"][0] for r in result.responses) == max_tokens


def test_triton_admin_http_apis_answer_only_the_operator(keyed):
    launcher, _ = keyed
    base = f"http://127.0.0.1:{launcher.http_port}"
    thread, out = _good_stream(launcher, "globex")
    callers = {"no key": {}, "a tenant's key": {"x-api-key": KEYS["acme"]},
               "a tenant's key as the admin header": {ADMIN_HEADER: KEYS["acme"]},
               "a wrong admin key": {ADMIN_HEADER: ADMIN_KEY + "x"}}
    for method, path, body, _ in ADMIN_HTTP:
        for who, headers in callers.items():
            r = requests.request(method, base + path, json=body, headers=headers, timeout=5)
            assert (r.status_code, r.json()) == (403, {"error": REFUSED_HTTP}), (who, method, path, r.text)
    for method, path, body, safe in ADMIN_HTTP:
        if safe:
            r = requests.request(method, base + path, json=body, headers={ADMIN_HEADER: ADMIN_KEY}, timeout=5)
            assert r.status_code == 200, (path, r.text)
    _served(thread, out)
    # Health, metadata and inference stay open; inference still needs a tenant's key.
    assert requests.get(base + "/v2/health/ready", timeout=5).status_code == 200
    assert requests.get(base + "/v2/models/lora_llm", timeout=5).json()["name"] == "lora_llm"
    r = requests.post(base + "/v2/models/lora_llm/generate", json={"text_input": "hi", "parameters": {
        "max_tokens": 2, "api_key": KEYS["acme"]}}, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.post(base + "/v2/models/lora_llm/generate", json={"text_input": "hi", "parameters": {
        "max_tokens": 2}}, timeout=30)
    assert r.status_code == 400 and AUTH_ERROR in r.text


def test_triton_admin_grpc_apis_answer_only_the_operator(keyed):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    launcher, _ = keyed
    client = grpcclient.InferenceServerClient(launcher.grpc_url)
    thread, out = _good_stream(launcher, "globex")
    try:
        for name, args, _ in ADMIN_GRPC:
            for headers in (None, {"x-api-key": KEYS["acme"]}, {GRPC_ADMIN_HEADER: KEYS["acme"]},
                            {ADMIN_HEADER: ADMIN_KEY}):  # the HTTP header name does not open gRPC
                with pytest.raises(InferenceServerException, match="This protocol is restricted") as caught:
                    getattr(client, name)(*args, headers=headers, client_timeout=5)
                assert caught.value.status() == "StatusCode.UNAVAILABLE", (name, headers)
        for name, args, safe in ADMIN_GRPC:
            if safe:
                getattr(client, name)(*args, headers={GRPC_ADMIN_HEADER: ADMIN_KEY}, client_timeout=5)
        assert client.is_server_ready() and client.get_model_metadata("lora_llm").name == "lora_llm"
        _served(thread, out)
    finally:
        client.close()


def test_the_admin_key_is_never_printed_and_the_gateway_serves_tenants(keyed):
    import openai

    launcher, gateway_port = keyed
    log = Path(launcher.stderr().split("log ", 1)[1].split(")", 1)[0])  # "starting tritonserver (pid N, log PATH)"
    texts = [launcher.out.read_text(), launcher.stderr(), log.read_text()]
    assert "<admin key>" in log.read_text()  # the command line the log shows
    cmdlines = [Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in descendants(launcher.proc.pid)
                if p.comm == "tritonserver"]
    assert cmdlines and ADMIN_KEY.encode() in cmdlines[0]  # the flag reaches tritonserver ...
    assert not any(ADMIN_KEY in t for t in texts)  # ... and nothing prints it
    assert "answer only with the header x-loraplex-admin-key" in launcher.stderr()
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key=KEYS["acme"], max_retries=0)
    reply = sdk.chat.completions.create(model="demo-a", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                        extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="not-a-key", max_retries=0) \
            .chat.completions.create(model="demo-a", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)


def test_with_keys_and_no_admin_key_the_apis_are_closed_to_everyone(demo, tmp_path):
    """Every restricted API group, over HTTP and gRPC, refuses every caller when no admin key was given."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    assert {api_group(path) for _, path, _, _ in ADMIN_HTTP} == set(RESTRICTED_APIS)
    assert {api_group(name) for name, _, _ in ADMIN_GRPC} == set(RESTRICTED_APIS)
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_ADMIN_KEY"}
    launcher = start_launcher(tmp_path, demo["model"], ["--tenants-file", str(write_tenants(tmp_path / "t.json"))])
    try:
        serving(launcher)
        base = f"http://127.0.0.1:{launcher.http_port}"
        for method, path, body, _ in ADMIN_HTTP:
            for headers in ({}, {ADMIN_HEADER: ""}, {ADMIN_HEADER: KEYS["acme"]}, {"x-api-key": KEYS["acme"]}):
                r = requests.request(method, base + path, json=body, headers=headers, timeout=5)
                assert (r.status_code, r.json()) == (403, {"error": REFUSED_HTTP}), (headers, method, path, r.text)
        client = grpcclient.InferenceServerClient(launcher.grpc_url)
        try:
            for name, args, _ in ADMIN_GRPC:
                for headers in (None, {GRPC_ADMIN_HEADER: ""}, {GRPC_ADMIN_HEADER: KEYS["acme"]},
                                {"x-api-key": KEYS["acme"]}):
                    with pytest.raises(InferenceServerException, match="This protocol is restricted") as caught:
                        getattr(client, name)(*args, headers=headers, client_timeout=5)
                    assert caught.value.status() == "StatusCode.UNAVAILABLE", (name, headers)
            assert client.is_server_ready()  # health stays open
        finally:
            client.close()
        assert requests.get(base + "/v2/models/lora_llm", timeout=5).json()["name"] == "lora_llm"  # metadata too
        assert "are closed (no --admin-key / $LORAPLEX_ADMIN_KEY given)" in launcher.stderr()
        assert env.get("LORAPLEX_ADMIN_KEY") is None
    finally:
        sessions = launcher.sessions()
        launcher.kill()
        wait_gone(sessions, timeout=SERVE_EXIT_TIMEOUT + 20)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) with a socket listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_development_mode_refuses_a_network_address_without_the_opt_in(demo, tmp_path):
    import subprocess
    import sys

    serve = str(Path(sys.executable).with_name("loraplex-serve"))
    t0 = time.monotonic()
    out = subprocess.run([serve, "--model-dir", str(demo["model"]), "--adapter-store", str(tmp_path),
                          "--address", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and time.monotonic() - t0 < 30
    assert out.stderr.strip() == ("loraplex-serve: --address 0.0.0.0 without --tenants-file would let anyone who "
                                  "reaches the ports name any tenant; give a tenants file, or pass "
                                  "--allow-unauthenticated-network")


def test_development_mode_is_loopback_and_the_gateway_dies_with_a_killed_launcher(demo, tmp_path):
    """No --address: every port on 127.0.0.1. Then the gateway is killed and restarted, the new one is
    stopped (SIGSTOP: like an event loop that cannot act on SIGTERM), and the launcher is SIGKILLed:
    nothing of ours is left once the guards' grace has passed."""
    (gateway_port,) = free_ports(1)
    launcher = start_launcher(tmp_path, demo["model"], ["--openai-port", str(gateway_port)], address=None)
    try:
        serving(launcher, gateway_port)
        deadline = time.monotonic() + 30
        while "metrics  http://127.0.0.1:" not in launcher.out.read_text():  # printed once the gateway answers
            assert time.monotonic() < deadline, launcher.stderr()
            time.sleep(0.2)
        metrics_port = int(launcher.out.read_text().split("metrics  http://127.0.0.1:")[1].split("/")[0])
        for port in (launcher.http_port, launcher.grpc_port, metrics_port, gateway_port):
            found = _listening(port)  # 127.0.0.1 only (gRPC's as IPv4-mapped IPv6), no wildcard socket
            assert found and found <= {"0100007F", "0000000000000000FFFF00000100007F"}, (port, found)
        (first,) = [p.pid for p in descendants(launcher.proc.pid) if p.comm.startswith("python") and
                    b"loraplex.openai" in Path(f"/proc/{p.pid}/cmdline").read_bytes()]
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            gateways = [p.pid for p in descendants(launcher.proc.pid) if p.running and p.pid != first and
                        b"loraplex.openai" in Path(f"/proc/{p.pid}/cmdline").read_bytes()]
            if gateways and _answers(f"http://127.0.0.1:{gateway_port}/health"):
                break
            assert time.monotonic() < deadline, launcher.stderr()
            time.sleep(0.2)
        os.kill(gateways[0], signal.SIGSTOP)
        sessions = launcher.sessions()
        launcher.kill()
        took = wait_gone(sessions, timeout=max(GUARD_GRACE, SERVE_EXIT_TIMEOUT + 5) + 15)
        print(f"everything gone {took:.1f} s after the launcher's SIGKILL")
    finally:
        launcher.kill()
