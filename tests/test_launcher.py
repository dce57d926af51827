"""The tritonserver launcher against a real server (stop, faults of loraplex-serve), and the offline demo builder."""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from loraplex.launch.processes import SHM_PREFIX, STUB_COMM, mapped_shm_regions, processes, shm_region
from loraplex.launch.tritonserver import TritonServer, TritonServerError, free_ports, project_root
from tritonserver_fixture import (SERVE_EXIT_TIMEOUT, descendants, launcher_under_load, make_triton_server_fixture,
                                  wait_ended, wait_gone)

ECHO_CONFIG = """\
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# Streams back: the input, the request parameters (JSON; forwarded headers land there),
# and facts about the stub's interpreter; then an empty response carrying the FINAL flag.
ECHO_MODEL = '''\
import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

import loraplex


class TritonPythonModel:
    def initialize(self, args):
        self.facts = json.dumps({
            "loraplex": loraplex.__file__,
            "prefix": sys.prefix,
            "version": list(sys.version_info[:3]),
            "numpy": np.__version__,
            "engine_config": __import__("os").environ.get("LORAPLEX_ENGINE_CONFIG"),
        })

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            params = json.loads(request.parameters() or "{}")
            for chunk in (text, json.dumps(params, sort_keys=True), self.facts):
                out = pb_utils.Tensor("text_output", np.array([chunk.encode("utf-8")], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def make_echo_repository(dst: Path, model_py: str = ECHO_MODEL) -> Path:
    """A model repository holding only the decoupled ``echo`` model."""
    (dst / "echo" / "1").mkdir(parents=True)
    (dst / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (dst / "echo" / "1" / "model.py").write_text(model_py)
    return dst


triton_server = make_triton_server_fixture(
    model_repository=make_echo_repository,
    engine_config={"probe": 1},
    adapter_store=lambda tmp, demo: tmp,
    ready_timeout=60,
)


def _group_members(pgid: int) -> list[int]:
    return [p.pid for p in processes() if p.pgid == pgid and p.running]


def _guards_of(pgid: int) -> list[int]:
    """Guard processes watching process group ``pgid`` (``tritonserver.py guard <pgid> ...``)."""
    found = []
    for p in processes():
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if p.running and b"guard" in argv and argv[argv.index(b"guard") + 1:][:1] == [str(pgid).encode()]:
            found.append(p.pid)
    return found


def _grpc_stream(server, text: str, headers=None) -> list:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
        inp = grpcclient.InferInput("text_input", [1], "BYTES")
        inp.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
        client.async_stream_infer("echo", [inp], request_id="r1", enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            out = result.as_numpy("text_output")
            got.append((None if out is None else out[0].decode("utf-8"), final))
            if final:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_grpc_stream_string_tensors_and_tenant_header(triton_server):
    got = _grpc_stream(triton_server, "héllo 世界 😀", headers={"x-tenant-id": "acme"})
    assert [final for _, final in got] == [False, False, False, True]
    assert got[0][0] == "héllo 世界 😀"
    assert json.loads(got[1][0]) == {"x-tenant-id": "acme"}  # header -> request parameter
    assert got[3][0] is None  # the FINAL flag travels on an empty response
    facts = json.loads(got[2][0])
    # The stub imported our package from this checkout, inside this virtualenv's interpreter.
    assert facts["loraplex"] == str(project_root() / "backend" / "__init__.py")
    assert facts["prefix"] == sys.prefix
    assert facts["version"] == list(sys.version_info[:3])
    assert facts["numpy"] == np.__version__ and facts["numpy"].startswith("1.")
    assert json.loads(facts["engine_config"]) == {"probe": 1}


def test_grpc_without_tenant_header(triton_server):
    got = _grpc_stream(triton_server, "x", headers={"x-other": "1", "x-tenantid": "2"})
    assert [text for text, _ in got[:2]] == ["x", "{}"]  # only headers matching x-tenant-.* travel


def test_http_generate_stream_sse(triton_server):
    r = requests.post(
        f"{triton_server.http_url}/v2/models/echo/generate_stream",
        json={"text_input": "over http", "parameters": {"max_tokens": 4, "lora_name": "demo-a"}},
        headers={"x-tenant-id": "globex"}, stream=True, timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len(b"data: "):]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert all("error" not in e for e in events), events
    texts = [e["text_output"] for e in events]
    assert len(texts) == 3  # the empty FINAL response makes no event
    assert texts[0] == "over http"
    # The body's "parameters" arrive as request parameters. The x-tenant-id header does
    # NOT: Triton's HandleGenerate never forwards headers (triton-inference-server/server
    # issue #8790, fix proposed in PR #8916); only /infer does, and /infer rejects
    # decoupled models over HTTP. If this starts failing, Triton fixed it.
    assert json.loads(texts[1]) == {"lora_name": "demo-a", "max_tokens": 4}


def test_http_generate_needs_exactly_one_response(triton_server):
    r = requests.post(f"{triton_server.http_url}/v2/models/echo/generate",
                      json={"text_input": "x"}, timeout=30)
    assert "exactly 1 response" in r.json()["error"]


def test_ready_and_metrics_endpoints(triton_server):
    assert triton_server.is_ready()
    assert requests.get(f"{triton_server.http_url}/v2/models/echo/ready", timeout=5).status_code == 200
    metrics = requests.get(triton_server.metrics_url, timeout=5).text
    assert 'nv_inference_request_success{model="echo"' in metrics


def test_ready_means_this_server_answers_on_its_port(triton_server):
    """With auto-picked ports another process (a parallel test worker's server) can take this one's HTTP port
    first: its readiness, or its gRPC port's HTTP/2 bytes, is not this server's (a run once failed on the second)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):  # ready, and named like a tritonserver that is not ours
            body = json.dumps({"name": "triton"} if self.path == "/v2" else {}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    assert triton_server.answers_as_itself()
    other = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    not_http = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: not_http.accept()[0].sendall(b"\x00\x00\x06\x04\x00" + bytes(20)),
                     daemon=True).start()
    try:
        for port in (other.server_address[1], not_http.getsockname()[1]):
            assert not TritonServer("unused", http_port=port, grpc_port=1, metrics_port=2).is_ready()
    finally:
        other.shutdown()
        not_http.close()


def test_stop_tears_down_the_process_group(tmp_path, demo):
    repo = make_echo_repository(tmp_path / "repo")
    server = TritonServer(repo, log_path=tmp_path / "log.txt", ready_timeout=60)
    server.start_and_wait()
    pgid = server.pid
    assert os.getpgid(pgid) == pgid  # its own process group ...
    assert os.getsid(pgid) == pgid  # ... and session
    members = _group_members(pgid)
    assert len(members) >= 2, members  # tritonserver + the Python stub
    assert len(_guards_of(pgid)) == 1  # in its own session, outside the group
    rc = server.stop(grace=10)
    assert rc == server.proc.returncode == 0  # it exited by itself within the grace, not killed at its end
    assert _group_members(pgid) == [] and _guards_of(pgid) == []
    assert "successfully unloaded" in server.log_path.read_text()
    assert server.stop(grace=10) == rc  # a second stop does nothing


def test_stop_kills_a_server_stuck_past_its_grace(tmp_path):
    """A server stuck past its grace (e.g. waiting on a crashed stub) is killed with its group."""
    hang = ECHO_MODEL.replace(
        "    def execute(self, requests):",
        "    def finalize(self):\n        import time\n        time.sleep(60)\n\n    def execute(self, requests):",
    )
    repo = make_echo_repository(tmp_path / "repo", hang)
    server = TritonServer(repo, log_path=tmp_path / "log.txt", ready_timeout=60, exit_timeout_secs=30)
    server.start_and_wait()
    pgid = server.pid
    t0 = time.monotonic()
    rc = server.stop(grace=2)
    assert time.monotonic() - t0 >= 2  # it had its grace
    assert rc == -signal.SIGKILL  # then was killed: not left to its 30 s exit timeout or its 60 s finalize
    assert "successfully unloaded" not in server.log_path.read_text()
    assert _group_members(pgid) == []


def test_early_exit_is_reported_with_the_log_tail(tmp_path):
    broken = "raise ImportError('model is broken on purpose')\n"
    repo = make_echo_repository(tmp_path / "repo", broken)
    server = TritonServer(repo, log_path=tmp_path / "log.txt", ready_timeout=60)
    with pytest.raises(TritonServerError, match="broken on purpose") as info:
        server.start_and_wait()
    assert "exited with code" in str(info.value)  # seen when it exited, not at the ready timeout
    assert server.proc.returncode not in (None, 0)
    assert _group_members(server.pid) == []


# ---------------------------------------------------------------- loraplex-serve under process faults

def test_serve_stop_finishes_through_repeated_signals(tmp_path, demo):
    """SIGTERM twice (`make serve` stopped with SIGTERM): the second once it is stopping; then SIGTERM + SIGINT
    inside the grace wait. Each repeat is logged and ignored."""
    again = "again: already stopping"
    with launcher_under_load(tmp_path, demo["model"]) as (launcher, server, streams):
        sessions = launcher.sessions()
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.wait_stderr("stopping tritonserver"), launcher.stderr()
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.wait_stderr(f"SIGTERM {again}"), launcher.stderr()
        assert launcher.proc.poll() is None, "ended by the repeat, or before its grace wait (the streams outlast it)"
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.proc.send_signal(signal.SIGINT)
        assert launcher.proc.wait(timeout=SERVE_EXIT_TIMEOUT + 30) == 0
        assert launcher.stderr().count("stopping tritonserver") == 1
        assert launcher.stderr().count(again) == 3, launcher.stderr()
        wait_gone(sessions, timeout=5)  # tritonserver, its stub and the guard
        wait_ended(streams, timeout=5)
        assert all(s.only_ending()[0] in ("final", "error") for s in streams)


def test_killed_serve_takes_its_server_and_stubs_along(tmp_path, demo):
    """SIGKILL to loraplex-serve under load: within exit timeout + 20 s nothing of ours is left.

    With --exit-timeout 3, which reaches tritonserver's command line and the guard's deadline.
    """
    exit_timeout = 3
    with launcher_under_load(tmp_path, demo["model"], extra_args=["--exit-timeout", str(exit_timeout)]) as \
            (launcher, server, streams):
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--exit-timeout-secs") + 1] == str(exit_timeout).encode()
        sessions = launcher.sessions()
        regions = [shm_region(p.pid) for p in descendants(server.pid) if p.comm == STUB_COMM]
        launcher.kill()
        wait_gone(sessions, timeout=exit_timeout + 20)  # the guard ends the group after exit timeout + 5 s
        wait_ended(streams, timeout=5)
        for s in streams:  # each ended once: cut by the shutdown, or whole within Triton's exit timeout
            kind, _, text = s.only_ending()
            assert kind == "final" or ("UNAVAILABLE" in text or "the model is shutting down" in text), text
        assert regions and not any(Path("/dev/shm", r).exists() for r in regions if r)


def _serve(*args: str):
    import subprocess

    return subprocess.run([str(Path(sys.executable).with_name("loraplex-serve")), *args], capture_output=True,
                          text=True, timeout=60)


def test_serve_new_key_prints_a_key_and_its_hash():
    import hashlib

    out = _serve("new-key")
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(":", 1) for line in out.stdout.splitlines()[:2])
    key, digest = lines["api key"].strip(), lines["sha256"].strip()
    assert hashlib.sha256(key.encode()).hexdigest() == digest
    assert f'"api_key_sha256": "{digest}"' in out.stdout
    assert _serve("new-key").stdout.split()[2] != key


def test_serve_refuses_a_bad_tenants_file_before_starting(tmp_path):
    bad = tmp_path / "tenants.json"
    bad.write_text('{"tenants": {"acme": {"api_key_sha256": "' + "0" * 64 + '", "max_adapters": -1}}}')
    out = _serve("--model-dir", str(tmp_path), "--tenants-file", str(bad))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"loraplex-serve: --tenants-file {bad}: tenant 'acme': max_adapters must be an integer >= 0, got -1"]


def test_usage_text_sends_a_key_when_serving_a_tenants_file():
    from loraplex.launch.serve import usage_text

    server = TritonServer("unused", http_port=1, grpc_port=2, metrics_port=3)
    with_keys, development = usage_text(server, "demo-a", api_keys=True), usage_text(server, "demo-a")
    assert '"api_key": "<your key>"' in with_keys and '"x-api-key": "<your key>"' in with_keys
    assert "x-tenant-id" not in with_keys and "api_key" not in development


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = free_ports(5)
    assert len(set(ports)) == 5
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_mapped_shm_regions_are_read_from_proc_maps_and_skip_unlinked_ones():
    import mmap
    import uuid

    name = f"{SHM_PREFIX}{uuid.uuid4()}"
    path = Path("/dev/shm", name)
    with open(path, "w+b") as f:
        f.truncate(4096)
        region = mmap.mmap(f.fileno(), 4096)
    try:
        assert name in mapped_shm_regions(os.getpid())  # what a server keeps of a stub that died
        path.unlink()
        assert name not in mapped_shm_regions(os.getpid())  # "(deleted)": nothing left to unlink
    finally:
        region.close()
        path.unlink(missing_ok=True)
    assert mapped_shm_regions(2 ** 22 + 1) == set()  # no such process


def test_signalled_reads_only_this_run_of_the_log_and_finds_a_line_cut_by_a_read(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_bytes(b"Signal (2) received.\n")  # the last run's stop
    server = TritonServer(project_root() / "model_repository", log_path=log)
    server._log_scanned = log.stat().st_size  # what start() records
    assert not server.signalled()
    with open(log, "ab") as f:
        f.write(b"I1201 server.cc] ready\nSign")
        f.flush()
        assert not server.signalled()
        f.write(b"al (15) received.\n")
    assert server.signalled() and server.signalled() and server.crash_signal() is None


def test_a_crash_signal_line_is_told_from_a_stop_and_only_whole_lines_count(tmp_path):
    from loraplex.launch import tritonserver

    """Triton logs SIGABRT / SIGSEGV as it logs SIGTERM ("Signal (6) received."): a crash, not someone's stop."""
    log = tmp_path / "tritonserver.log"
    log.write_bytes(b"")
    server = TritonServer(project_root() / "model_repository", log_path=log)
    with open(log, "ab") as f:
        f.write(b"I1201 model said: Signal (15) received.\nW1201 x Signal (2) received.\n")  # inside a line
        f.flush()
        assert not server.signalled() and server.crash_signal() is None
        f.write(b"Signal (6) rec")
        f.flush()
        assert server.crash_signal() is None
        f.write(b"eived.\n 0# 0x00005572A424352D in tritonserver\nSignal (11) received.\n")
    assert server.crash_signal() == signal.SIGABRT and not server.signalled()  # the first crash line
    with open(log, "ab") as f:  # read a chunk at a time: a line cut between two chunks is still one
        f.write(b"x" * (tritonserver._LOG_CHUNK - 4) + b"\nSignal (15) received.\n")
    assert server.signalled()


# ---------------------------------------------------------------- demo builder

def test_demo_tokenizer_round_trips_bytes(demo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo["tokenizer"])
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 259
    for text in ["Hello, world!", "日本語のテキスト 中文", "emoji 😀👍🏽 and \n\ttabs  ", " a , b . ", "", "\x00\x7f"]:
        ids = tok(text).input_ids
        assert ids == [1] + [3 + b for b in text.encode("utf-8")]  # bos prepended, no eos
        assert tok(text, add_special_tokens=False).input_ids == ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == "<s>" + text


def test_demo_model_config_and_files(demo):
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(demo["model"])
    assert cfg.model_type == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (264, 128, 344)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 4, 2)
    assert cfg.max_position_embeddings == 1024 and cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert GenerationConfig.from_pretrained(demo["model"]).eos_token_id == 2
    assert (Path(demo["model"]) / "model.safetensors").is_file()
    assert not list(Path(demo["root"]).rglob("*.bin"))
    info = json.loads(Path(demo["info"]).read_text())
    assert info["check"]["median_margin"] > 0.1
    assert all(a["differs"] > a["prompts"] // 2 for a in info["check"]["adapters"].values())


def test_demo_adapters_load_with_peft(demo):
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    expect = {"demo-a": (8, 16, False, {"q_proj", "v_proj"}),
              "demo-b": (16, 16, True, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})}
    base = AutoModelForCausalLM.from_pretrained(demo["model"]).eval()
    ids = torch.tensor([[1] + [3 + b for b in b"The quick brown fox"]])
    with torch.no_grad():
        base_logits = base(ids).logits[0, -1]
    for name, (r, alpha, rslora, targets) in expect.items():
        path = Path(demo[name])
        assert {p.name for p in path.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
        cfg = PeftConfig.from_pretrained(path)
        assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, set(cfg.target_modules)) == (r, alpha, rslora, targets)
        model = PeftModel.from_pretrained(base, str(path)).eval()
        lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert lora_b and all(p.abs().sum() > 0 for p in lora_b)
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        assert (logits - base_logits).abs().max() > 0.1
        base = model.unload()


def test_demo_is_idempotent(demo):
    from loraplex.models.builtin.demo import build_demo

    files = {p: p.stat().st_mtime_ns for p in Path(demo["root"]).rglob("*") if p.is_file()}
    again = build_demo(demo["root"])
    assert again == demo
    assert {p: p.stat().st_mtime_ns for p in Path(demo["root"]).rglob("*") if p.is_file()} == files  # none rewritten


def test_builders_make_variants(tmp_path):
    from peft import PeftConfig
    from safetensors import safe_open
    from transformers import AutoConfig

    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "qwen", model_type="qwen2", num_key_value_heads=1,
                                 num_hidden_layers=2)
    cfg = AutoConfig.from_pretrained(model_dir)
    assert (cfg.model_type, cfg.num_key_value_heads, cfg.num_hidden_layers) == ("qwen2", 1, 2)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys
    out = build_peft_adapter(model_dir, tmp_path / "ad", r=4, alpha=8, target_modules=["k_proj", "down_proj"], seed=3)
    pc = PeftConfig.from_pretrained(out)
    assert (pc.r, pc.lora_alpha, set(pc.target_modules)) == (4, 8, {"k_proj", "down_proj"})
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] == (4, 128)
    assert shapes["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] == (32, 4)
    assert shapes["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"] == (4, 344)


# ---------------------------------------------------------------- loraplex-serve with the OpenAI gateway

def _gateway_pids(launcher_pid: int) -> list[int]:
    """The launcher's `python -m loraplex.openai` children."""
    found = []
    for p in descendants(launcher_pid):
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                if b"loraplex.openai" in f.read().split(b"\0"):
                    found.append(p.pid)
        except OSError:
            continue
    return [pid for pid in found if any(q.pid == pid and q.running for q in processes())]


def test_serve_runs_the_openai_gateway_restarts_it_and_stops_it(tmp_path):
    """--openai-port: the gateway answers after Triton, a killed one comes back, SIGTERM leaves nothing behind.
    --model-dir is a tiny Phi-3 (fused projections, partial rotary): its adapter in the store is listed and the
    demo adapters of the repository's multi_lora.json, which do not fit it, are not."""
    import shutil
    import subprocess

    import openai
    from family_checkpoints import build_family
    from tritonserver_fixture import Launcher

    model_dir, adapters = build_family(tmp_path / "phi3", "phi3")
    shutil.copytree(adapters["all"], tmp_path / "adapters" / "phi3-all")
    http, grpc, metrics, port = free_ports(4)
    cmd = [str(Path(sys.executable).with_name("loraplex-serve")), "--quiet", "--model-dir", model_dir,
           "--adapter-store", str(tmp_path / "adapters"), "--address", "127.0.0.1", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(port),
           "--served-model-name", "tiny"]
    with open(tmp_path / "out", "wb") as o, open(tmp_path / "err", "wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    launcher = Launcher(proc, http, grpc, tmp_path / "out", tmp_path / "err")
    try:
        launcher.wait_serving()
        deadline = time.monotonic() + 60
        while f"http://127.0.0.1:{port}/v1" not in (tmp_path / "out").read_text():  # printed once it answers
            assert time.monotonic() < deadline and proc.poll() is None, launcher.stderr()
            time.sleep(0.2)
        usage = (tmp_path / "out").read_text()
        assert "OpenAI-compatible API" in usage and '"model": "tiny"' in usage and "x-tenant-id: acme" in usage
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                            default_headers={"x-tenant-id": "acme"})
        models = sdk.models.list().data
        assert models[0].id == "tiny" and models[0].parent is None
        assert [(m.id, m.parent) for m in models[1:]] == [("phi3-all", "tiny")]
        reply = sdk.chat.completions.create(model="phi3-all", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3

        (first,) = _gateway_pids(proc.pid)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not ((pids := _gateway_pids(proc.pid)) and pids != [first]):
            assert time.monotonic() < deadline, launcher.stderr()
            time.sleep(0.2)
        assert "loraplex-openai exited with code -9; restarted it" in launcher.stderr()

        sessions = launcher.sessions()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SERVE_EXIT_TIMEOUT + 30) == 0
        wait_gone(sessions, timeout=5)  # tritonserver, its stub, the guard and the gateway
    finally:
        launcher.kill()


def test_usage_text_shows_the_openai_gateway():
    from loraplex.launch.serve import usage_text

    server = TritonServer("unused", http_port=1, grpc_port=2, metrics_port=3)
    text = usage_text(server, "demo-a", api_keys=True, openai=("http://127.0.0.1:9000", "demo-a"))
    assert "http://127.0.0.1:9000/v1/chat/completions" in text and "Authorization: Bearer <your key>" in text
    assert 'OpenAI(base_url="http://127.0.0.1:9000/v1", api_key="<your key>")' in text
    assert "OpenAI-compatible" not in usage_text(server, "demo-a")


def test_builtin_models_have_their_own_adapter_store_and_example(demo):
    from loraplex.launch.serve import builtin_model, default_adapter_store, usage_text

    assert default_adapter_store("smollm2").name == "adapters-smollm2"
    assert default_adapter_store(None).name == "adapters"
    model_dir, adapters, example = builtin_model("tiny")
    assert model_dir == Path(demo["model"]) and {p.name for p in adapters.iterdir()} >= {"demo-a", "demo-b"}
    assert example == {"lora_name": "demo-a"}
    server = TritonServer("unused", http_port=1, grpc_port=2, metrics_port=3)
    text = usage_text(server, "pirate", question="What is the capital of France?", prompt="<|im_start|>user\nWhat?")
    assert '"text_input": "<|im_start|>user\\nWhat?"' in text and '"lora_name": "pirate"' in text


def test_project_root_is_the_checkout_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAPLEX_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert project_root() == Path(__file__).resolve().parents[1]
