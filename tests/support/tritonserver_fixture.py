"""Start one real ``tritonserver`` per test module.

Usage in a test module (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)::

    from tritonserver_fixture import make_triton_server_fixture

    # One server for the whole module, on free ports, with the project's
    # model_repository/, the demo model and a temporary adapter store that
    # already holds the demo adapters (demo-a, demo-b).
    triton_server = make_triton_server_fixture(engine_config={"block_size": 16})

    def test_something(triton_server):
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        ...  # triton_server.http_url, .metrics_url, .log_path, .env as well

The fixture's name is whatever the module assigns it to. Arguments (all optional):

* ``engine_config``: dict (or JSON string) passed as ``LORAPLEX_ENGINE_CONFIG``;
* ``env``: more environment variables for the server;
* ``model_repository``: a path, or a callable ``f(tmp_dir: Path) -> Path`` that builds
  one (see ``copy_model_repository`` to start from a copy of the project's);
* ``model_dir``: base model folder (default: the demo model, ``LORAPLEX_MODEL_DIR``);
* ``adapter_store``: a path, or a callable ``f(tmp_dir, demo_paths) -> Path``
  (default: a fresh temporary folder holding copies of the demo adapters);
* ``ready_timeout``, ``extra_args`` (extra tritonserver flags), ``scope``.

The server runs in its own process group and is stopped (SIGINT, then SIGKILL of the
group after a grace period) when the module's tests are done. If it does not become
ready, the fixture fails with the tail of its log.

For process-fault tests: ``start_launcher`` runs ``loraplex-serve --quiet`` as a
subprocess on free ports, ``Stream`` records one streaming request's responses as they
arrive, ``descendants``/``wait_gone`` find what is left of a process tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pytest
import requests

from loraplex.launch.processes import ProcInfo, processes
from loraplex.launch.tritonserver import TritonServer, TritonServerError, engine_env, free_ports, project_root

DEFAULT_MODEL_REPOSITORY = project_root() / "model_repository"


def copy_model_repository(dst: Path, models: Sequence[str] | None = None,
                          src: Path = DEFAULT_MODEL_REPOSITORY) -> Path:
    """Copy the project's model repository (or only ``models`` of it) to ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    names = models if models is not None else [p.name for p in src.iterdir() if p.is_dir()]
    for name in names:
        shutil.copytree(src / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def seed_demo_adapters(store: Path, demo: Mapping[str, Path]) -> Path:
    """Fill ``store`` with copies of the demo adapters, one folder per adapter name."""
    from loraplex.launch.serve import seed_adapter_store

    seed_adapter_store(store, Path(demo["adapters"]))
    return store


def demo_server(
    tmp: Path,
    demo: Mapping[str, Path],
    *,
    engine_config: Mapping[str, Any] | str | None = None,
    env: Mapping[str, str] | None = None,
    model_repository: str | os.PathLike | Callable[[Path], Path] | None = None,
    model_dir: str | os.PathLike | None = None,
    adapter_store: str | os.PathLike | Callable[[Path, Mapping[str, Path]], Path] | None = None,
    **server_args,
) -> TritonServer:
    """A ``TritonServer`` (not started) on the demo model, its files in ``tmp`` (arguments: see the module doc)."""
    if model_repository is None:
        repo = DEFAULT_MODEL_REPOSITORY
    elif callable(model_repository):
        repo = Path(model_repository(tmp / "model_repository"))
    else:
        repo = Path(model_repository)
    if adapter_store is None:
        store = seed_demo_adapters(tmp / "adapters", demo)
    elif callable(adapter_store):
        store = Path(adapter_store(tmp / "adapters", demo))
    else:
        store = Path(adapter_store)
    store.mkdir(parents=True, exist_ok=True)
    server_env = engine_env(model_dir if model_dir is not None else demo["model"], store, engine_config)
    server_env["OMP_NUM_THREADS"] = "1"  # tests share 2 cores with pytest itself: no spinning intra-op threads
    server_env.update(env or {})
    return TritonServer(model_repository=repo, env=server_env, log_path=tmp / "tritonserver.log", **server_args)


def make_triton_server_fixture(
    *,
    engine_config: Mapping[str, Any] | str | None = None,
    env: Mapping[str, str] | None = None,
    model_repository: str | os.PathLike | Callable[[Path], Path] | None = None,
    model_dir: str | os.PathLike | None = None,
    adapter_store: str | os.PathLike | Callable[[Path, Mapping[str, Path]], Path] | None = None,
    ready_timeout: float = 180.0,
    extra_args: Sequence[str] = (),
    scope: str = "module",
):
    """A pytest fixture that yields a ready ``TritonServer`` for the module (see the module doc)."""

    @pytest.fixture(scope=scope)
    def _triton_server(demo, tmp_path_factory):
        server = demo_server(
            tmp_path_factory.mktemp("tritonserver"), demo, engine_config=engine_config, env=env,
            model_repository=model_repository, model_dir=model_dir, adapter_store=adapter_store,
            ready_timeout=ready_timeout, extra_args=list(extra_args),
        )
        try:
            server.start_and_wait()
        except TritonServerError as exc:
            pytest.fail(f"tritonserver did not start: {exc}", pytrace=False)
        try:
            yield server
        finally:
            server.stop(grace=10)

    return _triton_server


# ---------------------------------------------------------------- process faults

def descendants(root: int) -> list[ProcInfo]:
    """The processes whose parent chain leads to ``root``, right now."""
    procs = processes()
    children: dict[int, list[ProcInfo]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def wait_gone(sids: Iterable[int], timeout: float) -> float:
    """Seconds until no live process is left in the sessions ``sids``; fails after ``timeout``.

    Session ids survive reparenting to init, so they find orphans whose parent chain is
    gone; a session id cannot be reused while any process still carries it.
    """
    sids, t0 = set(sids), time.monotonic()
    while True:
        left = [p for p in processes() if p.sid in sids and p.running]
        if not left:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"left after {timeout:.0f}s: {left}")
        time.sleep(0.1)


SERVE_EXIT_TIMEOUT = TritonServer("unused").exit_timeout_secs  # loraplex-serve's --exit-timeout-secs


@dataclass
class Launcher:
    """``loraplex-serve`` running as a subprocess in its own session; output in files."""

    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    out: Path
    err: Path

    @property
    def grpc_url(self) -> str:
        """``host:port`` of its gRPC endpoint."""
        return f"127.0.0.1:{self.grpc_port}"

    def stderr(self) -> str:
        """What it has written to stderr so far."""
        return self.err.read_text()

    def wait_stderr(self, text: str, count: int = 1, timeout: float = 60.0) -> bool:
        """Wait until stderr holds ``text`` ``count`` times; False if it exited or the timeout passed first."""
        deadline = time.monotonic() + timeout
        while self.stderr().count(text) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return self.stderr().count(text) >= count
            time.sleep(0.02)
        return True

    def wait_serving(self, not_pid: int | None = None, timeout: float = 240.0) -> ProcInfo:
        """Wait until a tritonserver child (other than ``not_pid``) answers ready; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"loraplex-serve exited {self.proc.returncode}:\n{self.stderr()}"
            servers = [p for p in descendants(self.proc.pid) if p.comm == "tritonserver" and p.pid != not_pid]
            try:
                ready = requests.get(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2).ok
            except requests.RequestException:
                ready = False
            if servers and ready:
                return servers[0]
            time.sleep(0.2)
        pytest.fail(f"loraplex-serve not serving after {timeout:.0f}s:\n{self.stderr()}")

    def sessions(self) -> set[int]:
        """Session ids of its descendants: tritonserver's (with the stubs) and the guard's."""
        return {p.sid for p in descendants(self.proc.pid)}

    def kill(self) -> None:
        """SIGKILL it if it still runs (test cleanup)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_launcher(tmp: Path, model_dir: str | os.PathLike, extra_args: Sequence[str] = (),
                   address: str | None = "127.0.0.1", env: Mapping[str, str] | None = None) -> Launcher:
    """``loraplex-serve --quiet`` on free ports with ``model_dir`` and an empty adapter store in ``tmp``
    (``address`` None: the launcher's own default; ``env``: more environment variables)."""
    http, grpc, metrics = free_ports(3)
    cmd = [str(Path(sys.executable).with_name("loraplex-serve")), "--quiet", "--model-dir", str(model_dir),
           "--adapter-store", str(tmp / "adapters"), *(["--address", address] if address else []),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), *extra_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    out, err = tmp / "serve.out", tmp / "serve.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return Launcher(proc, http, grpc, out, err)


@dataclass
class Stream:
    """One streaming gRPC request to ``lora_llm`` and every event it got: ("data"|"final"|"error", t, text).

    The gRPC stream stays open after the request ends; an error that tears it down later
    (the server going away) is kept in ``stream_errors``, not in ``events``.
    """

    url: str
    prompt: str
    max_tokens: int = 1000
    events: list = field(default_factory=list)
    stream_errors: list = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        import tritonclient.grpc as grpcclient

        from loraplex.clients.generate import build_inputs

        self.client = grpcclient.InferenceServerClient(self.url)
        self.client.start_stream(callback=self._on_response)
        params = {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        self.client.async_stream_infer("lora_llm", build_inputs(grpcclient, self.prompt, params),
                                       request_id=uuid.uuid4().hex, enable_empty_final_response=True)

    def _on_response(self, result, error) -> None:
        if error is not None and self.ended.is_set():
            self.stream_errors.append(str(error))
        elif error is not None:
            self.events.append(("error", time.monotonic(), str(error)))
        else:
            final = result.get_response().parameters["triton_final_response"].bool_param
            self.events.append(("final" if final else "data", time.monotonic(), ""))
        if self.events[-1][0] != "data":
            self.ended.set()

    def wait_data(self, timeout: float = 60.0) -> None:
        """Block until the first response arrived (the request is in flight)."""
        deadline = time.monotonic() + timeout
        while not self.events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.events, f"no response to {self.prompt!r} after {timeout:.0f}s"

    @property
    def endings(self) -> list[tuple]:
        """The events that end a request (a final response or an error)."""
        return [e for e in self.events if e[0] != "data"]

    def only_ending(self) -> tuple:
        """The one event that ended the request, checked to be single and last."""
        assert len(self.endings) == 1 and self.events[-1] is self.endings[0], self.events[-3:]
        return self.endings[0]

    def close(self) -> None:
        """Close the client without waiting for anything still running."""
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def wait_ended(streams: Iterable[Stream], timeout: float) -> None:
    """Fail unless every stream has ended (a final response or an error) within ``timeout`` s from now."""
    deadline = time.monotonic() + timeout
    for s in streams:
        assert s.ended.wait(max(0.0, deadline - time.monotonic())), f"{s.prompt!r} still open: {s.events[-3:]}"


def start_streams(url: str, n: int, max_tokens: int = 1000, prefix: str = "in flight") -> list[Stream]:
    """``n`` streaming requests, each past its first response when this returns."""
    streams = [Stream(url, f"{prefix} {i}", max_tokens) for i in range(n)]
    for s in streams:
        s.wait_data()
    return streams


@contextmanager
def launcher_under_load(tmp: Path, model_dir: str | os.PathLike, n: int = 3, extra_args: Sequence[str] = ()):
    """``loraplex-serve`` serving ``n`` long streams: yields (launcher, its tritonserver, the streams).

    On the way out the launcher is SIGKILLed if it still runs (its guard then ends the server).
    """
    launcher = start_launcher(tmp, model_dir, extra_args)
    streams: list[Stream] = []
    try:
        server = launcher.wait_serving()
        streams = start_streams(launcher.grpc_url, n)
        yield launcher, server, streams
    finally:
        launcher.kill()
        for s in streams:
            s.close()
