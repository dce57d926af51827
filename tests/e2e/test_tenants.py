"""Tenant identity through a real tritonserver with a tenants file: keys, refusals, spoofing, live reload."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from helpers import http_generate, wait_for_metric
from tritonserver_fixture import make_triton_server_fixture

from loraplex.clients.generate import main as generate_main
from loraplex.clients.generate import stream_generate
from loraplex.exceptions import AUTH_ERROR
from loraplex.tenancy.tenants import key_digest

KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key"}
NEW_KEY = "initech-secret-key"
TENANTS_FILE = Path(tempfile.mkdtemp(prefix="loraplex-tenants-")) / "tenants.json"
PARAMS = {"max_tokens": 2, "ignore_eos": True, "temperature": 0}


def write_tenants(keys: dict[str, str]) -> None:
    """Replace the tenants file atomically (as an operator's editor or a config map would)."""
    tmp = TENANTS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps({"tenants": {t: {"api_key_sha256": key_digest(k).hex(), "weight": 1}
                                           for t, k in keys.items()}}))
    tmp.replace(TENANTS_FILE)


@pytest.fixture(scope="module", autouse=True)
def tenants_file():
    write_tenants(KEYS)
    yield TENANTS_FILE
    shutil.rmtree(TENANTS_FILE.parent, ignore_errors=True)


triton_server = make_triton_server_fixture(env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)})


def finished(server, tenant: str, expected: float) -> float | None:
    return wait_for_metric(server, "loraplex_request_finished_total", expected, tenant=tenant, finish_reason="length")


def test_grpc_key_header_is_the_tenant_and_x_tenant_id_is_ignored(triton_server):
    result = stream_generate(triton_server.grpc_url, "who am i", PARAMS, headers={"x-api-key": KEYS["acme"]})
    assert result.error is None and result.final_count == 1
    assert finished(triton_server, "acme", 1.0) == 1.0
    spoofed = stream_generate(triton_server.grpc_url, "spoof", PARAMS,
                              headers={"x-api-key": KEYS["globex"], "x-tenant-id": "acme"})
    assert spoofed.error is None
    assert finished(triton_server, "globex", 1.0) == 1.0
    assert finished(triton_server, "acme", 1.0) == 1.0


def test_http_generate_takes_the_api_key_parameter(triton_server):
    r = http_generate(triton_server, {"text_input": "over http", "parameters": dict(PARAMS, api_key=KEYS["acme"],
                                                                                   tenant="globex")})
    assert r.status_code == 200, r.text
    assert KEYS["acme"] not in r.text
    assert finished(triton_server, "acme", 2.0) == 2.0


def test_missing_or_wrong_key_is_refused_with_one_message(triton_server):
    wrong = "not-a-key-of-anyone"
    for headers in (None, {"x-tenant-id": "acme"}, {"x-api-key": wrong}):
        result = stream_generate(triton_server.grpc_url, "let me in", PARAMS, headers=headers)
        assert result.error.message() == AUTH_ERROR  # a stream's error carries no status code
    for parameters in ({}, {"tenant": "acme"}, {"api_key": wrong}):
        r = http_generate(triton_server, {"text_input": "let me in", "parameters": dict(PARAMS, **parameters)})
        assert (r.status_code, r.json()["error"]) == (400, AUTH_ERROR)  # INVALID_ARG
    assert wrong not in triton_server.log_path.read_text()


def test_a_tenant_added_to_the_file_works_without_restart(triton_server):
    headers = {"x-api-key": NEW_KEY}
    assert stream_generate(triton_server.grpc_url, "early", PARAMS, headers=headers).error.message() == AUTH_ERROR
    write_tenants({**KEYS, "initech": NEW_KEY})
    deadline = time.monotonic() + 5.0
    while (result := stream_generate(triton_server.grpc_url, "late", PARAMS, headers=headers)).error is not None:
        assert time.monotonic() < deadline, result.error
        time.sleep(0.2)
    assert finished(triton_server, "initech", 1.0) == 1.0
    assert stream_generate(triton_server.grpc_url, "still", PARAMS, headers={"x-api-key": KEYS["acme"]}).error is None


def test_the_generate_client_sends_its_api_key(triton_server, monkeypatch, capsys):
    url = ["--url", triton_server.grpc_url, "--max-tokens", "2", "client"]
    assert generate_main(["--api-key", KEYS["globex"], *url]) == 0
    monkeypatch.setenv("LORAPLEX_API_KEY", "wrong")
    assert generate_main(url) == 1  # the environment's key is the default
    assert AUTH_ERROR in capsys.readouterr().err
