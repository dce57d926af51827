"""Find, configure and run a real ``tritonserver`` process.

Two installations are recognised:

* the ``nvidia-pytriton`` wheel (installed with ``--no-deps``; only its bundled
  files are used): ``pytriton/tritonserver/bin/tritonserver``, the Python backend in
  ``pytriton/tritonserver/backends/python/``, one Python-backend stub per Python
  version in ``pytriton/tritonserver/python_backend_stubs/<major.minor>/`` and the
  shared libraries in the sibling ``nvidia_pytriton.libs/`` folder;
* NVIDIA's container, ``/opt/tritonserver``.

``LORAPLEX_TRITON_ROOT`` may point at either layout explicitly.

How the Python-backend stub finds our packages: the stub embeds CPython and, having no
program name of its own, resolves ``python3`` through ``PATH``. Putting the running
interpreter's ``bin/`` folder (the virtualenv's) first on ``PATH`` makes the embedded
interpreter find ``pyvenv.cfg`` there, so it runs *as that virtualenv*: its
site-packages are a site dir and their ``.pth`` files (the editable install's finder)
are processed. ``LD_LIBRARY_PATH`` starts with the running interpreter's own
``libpython`` folder (when it is a shared build), so the stub loads the same CPython
build as the virtualenv instead of whatever ``libpython3.X.so`` the system has.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from loraplex.config import STOP_FILE_ENV
from loraplex.launch.processes import (STUB_COMM, answers_ok, get_json, group_shm_regions, kill_group,
                                       mapped_shm_regions, processes, release_guard, start_guard, start_in_session,
                                       unlink_shm)

DEFAULT_HEADER_PATTERN = "x-tenant-.*|x-api-key"  # forwarded as request parameters
# Triton's own APIs that only the operator may call once an admin key is set (docs/security.md):
# everything but health, metadata and inference. The header is not forwarded to models.
ADMIN_HEADER = "x-loraplex-admin-key"
RESTRICTED_APIS = ("shared-memory", "model-config", "model-repository", "statistics", "trace", "logging")
CONTAINER_ROOT = Path("/opt/tritonserver")


class TritonServerError(RuntimeError):
    """tritonserver could not be found, failed to start, or died."""


@dataclass(slots=True, frozen=True)
class TritonInstall:
    """Where one Triton installation keeps its binary, Python backend and libraries."""

    server: Path
    python_backend: Path
    stub: Path | None
    lib_dirs: tuple[Path, ...] = ()
    kind: str = "pytriton"


def project_root() -> Path:
    """Where `model_repository/` and `demo_adapters/` are: ``$LORAPLEX_HOME``, else the source
    checkout this module lives in, else (an installed wheel) the current directory."""
    if os.environ.get("LORAPLEX_HOME"):
        return Path(os.environ["LORAPLEX_HOME"])
    here = Path(__file__).resolve().parents[2]  # backend/launch/tritonserver.py -> the checkout
    if (here / "pyproject.toml").is_file():
        return here
    return Path.cwd()


def cache_dir() -> Path:
    """Writable cache folder: ``$LORAPLEX_CACHE_DIR`` or ``<project>/.cache``."""
    env = os.environ.get("LORAPLEX_CACHE_DIR")
    return Path(env) if env else project_root() / ".cache"


def python_tag() -> str:
    """The running interpreter's ``major.minor``."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_install(pkg_dir: Path) -> TritonInstall | None:
    root = pkg_dir / "tritonserver"
    server = root / "bin" / "tritonserver"
    backend = root / "backends" / "python"
    stub = root / "python_backend_stubs" / python_tag() / "triton_python_backend_stub"
    if not (server.is_file() and (backend / "libtriton_python.so").is_file()):
        return None
    if not stub.is_file():
        raise TritonServerError(
            f"{root} has no Python-backend stub for Python {python_tag()} "
            f"(have: {sorted(p.name for p in (root / 'python_backend_stubs').iterdir())})"
        )
    libs = [p for p in (pkg_dir.parent / "nvidia_pytriton.libs", root / "lib") if p.is_dir()]
    return TritonInstall(server, backend, stub, tuple(libs), "pytriton")


def _container_install(root: Path) -> TritonInstall | None:
    server = root / "bin" / "tritonserver"
    backend = root / "backends" / "python"
    if not (server.is_file() and (backend / "libtriton_python.so").is_file()):
        return None
    stub = backend / "triton_python_backend_stub"
    libs = [p for p in (root / "lib",) if p.is_dir()]
    return TritonInstall(server, backend, stub if stub.is_file() else None, tuple(libs), "container")


def find_triton() -> TritonInstall:
    """Locate tritonserver: ``$LORAPLEX_TRITON_ROOT``, the pytriton wheel, or /opt/tritonserver."""
    explicit = os.environ.get("LORAPLEX_TRITON_ROOT")
    if explicit:
        root = Path(explicit)
        found = (_pytriton_install(root) if (root / "tritonserver").is_dir() else None) or (
            _container_install(root)
        )
        if found is None:
            raise TritonServerError(f"LORAPLEX_TRITON_ROOT={explicit} holds no tritonserver")
        return found
    spec = importlib.util.find_spec("pytriton")  # locates without importing pytriton
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            found = _pytriton_install(Path(loc))
            if found is not None:
                return found
    found = _container_install(CONTAINER_ROOT)
    if found is not None:
        return found
    raise TritonServerError(
        "tritonserver not found: install it with `pip install --no-deps nvidia-pytriton` "
        "(or run in NVIDIA's Triton container, /opt/tritonserver)"
    )


def _copy_if_changed(src: Path, dst: Path) -> None:
    try:
        s, d = src.stat(), dst.stat()
        if s.st_size == d.st_size and int(s.st_mtime) == int(d.st_mtime):
            return
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)  # atomic: a running server keeps the old inode
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prepare_backends(install: TritonInstall, root: Path | None = None) -> Path:
    """A backends folder holding ``python/`` with the stub for this interpreter beside the .so."""
    if install.kind == "container" and install.stub is not None:
        return install.python_backend.parent
    key = hashlib.sha256(f"{install.python_backend}|{install.stub}".encode()).hexdigest()[:12]
    backends = (root or cache_dir() / "triton_backends") / f"py{python_tag()}-{key}"
    target = backends / "python"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy_if_changed(install.python_backend / name, target / name)
    if install.stub is None:
        raise TritonServerError(f"no triton_python_backend_stub for {install.python_backend}")
    _copy_if_changed(install.stub, target / "triton_python_backend_stub")
    os.chmod(target / "triton_python_backend_stub", 0o755)
    return backends


def _python_lib_dir() -> str | None:
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname:
        if (Path(libdir) / soname).exists():
            return libdir
    return None


def _prepend(path_list: Iterable[str], existing: str | None) -> str:
    parts = [p for p in path_list if p]
    if existing:
        parts += [p for p in existing.split(os.pathsep) if p and p not in parts]
    return os.pathsep.join(parts)


def server_env(install: TritonInstall, extra: Mapping[str, str] | None = None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so its Python stub runs as this interpreter's virtualenv."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHOME", None)  # would override the virtualenv detection below
    libs = [_python_lib_dir()] + [str(p) for p in install.lib_dirs]
    env["LD_LIBRARY_PATH"] = _prepend(libs, env.get("LD_LIBRARY_PATH"))
    bindir = os.path.dirname(sys.executable)  # not resolved: the venv's bin/ holds pyvenv.cfg's sibling
    env["PATH"] = _prepend([bindir], env.get("PATH"))
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env.setdefault("PYTHONUNBUFFERED", "1")
    # OpenMP threads sleep at once when idle instead of spinning, so a pool that shares its cores
    # (or runs under a CPU quota) does not burn the slices its peers need (decision 056).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that are free right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, max_bytes: int = 8000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log)"


_PORT_IN_USE = ("already in use",)
# tritonserver's own line, on stdout for SIGINT / SIGTERM (a stop) and on stderr for SIGSEGV / SIGABRT (a crash,
# followed by a stack trace and the same signal's default action): src/triton_signal.cc
_SIGNAL_LINE = re.compile(rb"Signal \((\d+)\) received\.\r?")
STOP_SIGNALS_LOGGED = frozenset({int(signal.SIGINT), int(signal.SIGTERM)})
_MAX_SIGNAL_LINE = 32  # bytes; a longer partial line cannot be one
_LOG_CHUNK = 1 << 20  # bytes of the log read at a time: the launcher's memory stays bounded however fast it grows

@dataclass
class TritonServer:
    """One tritonserver process in its own process group; a context manager.

    ``with TritonServer(model_repository="model_repository", env={...}) as srv:`` starts
    the server and waits until ``/v2/health/ready``; leaving the block stops it.
    Ports left ``None`` are picked free (and re-picked if a port was taken meanwhile).

    The server does not outlive its launcher: started from the main thread it gets
    ``DEATH_SIGNAL`` from the kernel when the launcher dies (PR_SET_PDEATHSIG fires when
    the forking *thread* ends, so other threads skip it), and a guard process ends the
    whole group, stubs included, ``exit_timeout_secs + 5`` s later at the latest.
    """

    model_repository: str | os.PathLike
    env: Mapping[str, str] | None = None
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    address: str = "127.0.0.1"
    log_verbose: int = 0
    exit_timeout_secs: int = 5
    admin_key: str | None = None  # set: RESTRICTED_APIS answer only requests carrying ADMIN_HEADER with it
    header_forward_pattern: str = DEFAULT_HEADER_PATTERN
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    ready_timeout: float = 120.0
    install: TritonInstall | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)
    # tritonserver --id, which GET /v2 names: tells this server from another one that took its HTTP port first
    server_id: str = field(default_factory=lambda: f"loraplex-{secrets.token_hex(6)}", init=False)
    _auto_ports: bool = field(default=False, init=False)
    _log_file: object = field(default=None, init=False, repr=False)
    _guard: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _regions: set[str] = field(default_factory=set, init=False, repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)
    _log_scanned: int = field(default=0, init=False, repr=False)
    _signalled: bool = field(default=False, init=False, repr=False)
    _crash_signal: int | None = field(default=None, init=False, repr=False)
    _log_partial: bytes = field(default=b"", init=False, repr=False)

    # ---- addresses -------------------------------------------------------------
    @property
    def host(self) -> str:
        """Host clients should connect to."""
        return "127.0.0.1" if self.address in ("0.0.0.0", "", "::") else self.address

    @property
    def http_address(self) -> str:
        """``host:port`` of the HTTP endpoint (what ``tritonclient.http`` takes)."""
        return f"{self.host}:{self.http_port}"

    @property
    def http_url(self) -> str:
        """``http://host:port`` of the HTTP endpoint."""
        return f"http://{self.http_address}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint (what ``tritonclient.grpc`` takes)."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics`` (Prometheus text)."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Process id (also the process-group id) of the running server."""
        return self.proc.pid if self.proc else None

    # ---- command line ----------------------------------------------------------
    def command(self, backends: Path) -> list[str]:
        """The tritonserver command line."""
        inst = self.install
        assert inst is not None
        return [
            str(inst.server),
            "--model-repository", str(Path(self.model_repository).resolve()),
            "--backend-directory", str(backends),
            "--http-address", self.address,
            "--http-port", str(self.http_port),
            "--grpc-address", self.address,
            "--grpc-port", str(self.grpc_port),
            "--metrics-address", self.address,
            "--metrics-port", str(self.metrics_port),
            "--id", self.server_id,
            "--exit-timeout-secs", str(self.exit_timeout_secs),
            "--grpc-header-forward-pattern", self.header_forward_pattern,
            "--http-header-forward-pattern", self.header_forward_pattern,
            "--log-verbose", str(self.log_verbose),
            # our config.pbtxt files are complete: without this Triton starts one more Python stub per model only
            # to ask it for a config (about 4 s of CPU each)
            "--disable-auto-complete-config",
            *self.restricted_api_args(),
            *self.extra_args,
        ]

    def restricted_api_args(self) -> list[str]:
        """tritonserver's flags closing RESTRICTED_APIS, over HTTP and gRPC, to all but the admin header."""
        if not self.admin_key:
            return []
        rule = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}"
        return ["--http-restricted-api", rule, "--grpc-restricted-protocol", rule]

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> "TritonServer":
        """Launch tritonserver in a new session (its own process group); does not wait."""
        if self.proc is not None:
            if self.proc.poll() is None:
                raise TritonServerError("already running")
            self.stop(grace=0)  # what the last run left: stubs, the guard
        self.install = self.install or find_triton()
        backends = prepare_backends(self.install)
        if None in (self.http_port, self.grpc_port, self.metrics_port):
            self._auto_ports = True
        if self._auto_ports:
            self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        if self.log_path is None:
            logs = cache_dir() / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=logs, prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command(backends)
        self.stop_file.unlink(missing_ok=True)  # a previous run's
        env = server_env(self.install, {**(self.env or {}), STOP_FILE_ENV: str(self.stop_file)})
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_scanned, self._signalled, self._crash_signal = self._log_file.tell(), False, None
        self._log_partial = b""
        shown = " ".join(cmd).replace(self.admin_key, "<admin key>") if self.admin_key else " ".join(cmd)
        self._log_file.write(("$ " + shown + "\n").encode())
        self.proc = start_in_session(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT)
        self._stopped = False
        try:
            self._guard = start_guard(self.proc.pid, self.exit_timeout_secs + 5, self.stop_file, stderr=self._log_file)
        except OSError:
            self.stop(grace=0)
            raise
        return self

    @property
    def stop_file(self) -> Path:
        """Created when this server is being stopped; the model ends what it holds when it appears.

        Triton tells a decoupled model nothing before its exit timeout, and the model's
        readiness poll cannot tell a shutdown that starts right after its load from the load
        itself; this file can.
        """
        return Path(self.log_path).with_suffix(".stopping")

    def is_ready(self) -> bool:
        """Whether ``/v2/health/ready`` answers 200 right now, from this server: with auto-picked ports another
        process (a test worker's server) may hold the port this one failed to bind."""
        return answers_ok(f"{self.http_url}/v2/health/ready") and self.answers_as_itself()

    def answers_as_itself(self) -> bool:
        """Whether the HTTP port's server metadata (``GET /v2``) names this server's ``--id``."""
        metadata = get_json(f"{self.http_url}/v2")
        return isinstance(metadata, dict) and metadata.get("name") == self.server_id

    def http_listening(self) -> bool:
        """Whether the HTTP port still has a listener: Triton closes it first thing when it shuts down."""
        try:
            with socket.create_connection((self.host, self.http_port), timeout=1):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:  # slow or unreachable is not "gone"
            return True

    def signalled(self) -> bool:
        """Whether this run of tritonserver has logged a stop signal (a line "Signal (15) received.", or 2).

        Tells that someone else is stopping it even before we saw it ready, when its HTTP
        port (open only while it serves) has nothing to say. Reads only what is new.
        """
        self._scan_log()
        return self._signalled

    def crash_signal(self) -> int | None:
        """The signal this run of tritonserver logged it is crashing with ("Signal (6) received.": SIGABRT,
        SIGSEGV), if any; it then prints a stack trace and dies by that signal."""
        self._scan_log()
        return self._crash_signal

    def forget_crash_signal(self) -> None:
        """Set aside the crash line seen so far (the launcher found the server still serving after it)."""
        self._crash_signal = None

    def _scan_log(self) -> None:
        """Read what this run appended to the log since the last look, a chunk at a time; note each whole
        "Signal (N)" line."""
        if self.log_path is None:
            return
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_scanned)
                while chunk := f.read(_LOG_CHUNK):
                    self._scan_chunk(chunk)
                    self._log_scanned += len(chunk)
        except OSError:
            return

    def _scan_chunk(self, chunk: bytes) -> None:
        *lines, partial = (self._log_partial + chunk).split(b"\n")
        self._log_partial = partial if len(partial) <= _MAX_SIGNAL_LINE else b"-"  # "-": a long line, not one
        for line in lines:
            found = _SIGNAL_LINE.fullmatch(line)
            if found is None:
                continue
            if int(found.group(1)) in STOP_SIGNALS_LOGGED:
                self._signalled = True
            elif self._crash_signal is None:
                self._crash_signal = int(found.group(1))

    def log_tail(self, max_bytes: int = 8000) -> str:
        """The last part of the server log."""
        return _tail(self.log_path, max_bytes) if self.log_path else "(no log)"

    def wait_ready(self, timeout: float | None = None) -> "TritonServer":
        """Block until the server is ready; raise TritonServerError (with the log tail) if it exits or times out."""
        if self.proc is None:
            raise TritonServerError("not started")
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self._reap_group()
                raise TritonServerError(
                    f"tritonserver exited with code {rc} before becoming ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_ready():
                self.stubs()
                return self
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready after {timeout or self.ready_timeout:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def start_and_wait(self, timeout: float | None = None, retries: int = 3) -> "TritonServer":
        """Start and wait until ready, retrying with new ports if auto-picked ports were taken."""
        for attempt in range(retries):
            self.start()
            try:
                return self.wait_ready(timeout)
            except TritonServerError as exc:
                self.stop()
                port_clash = self._auto_ports and any(s in str(exc) for s in _PORT_IN_USE) \
                    and "ready after" not in str(exc)
                if not port_clash or attempt == retries - 1:
                    raise
        raise AssertionError("unreachable")

    def stubs(self, include_dead: bool = False) -> list[int]:
        """Pids of the server's Python-backend stubs (its children; dead ones not reaped yet too, if asked).

        Remembers the stubs' shm regions (the server maps each), so that ``stop()`` can unlink
        them even once the server itself has died.
        """
        if self.proc is None:
            return []
        pids = [p.pid for p in processes()
                if p.ppid == self.proc.pid and p.comm == STUB_COMM and (include_dead or p.running)]
        self._regions |= mapped_shm_regions(self.proc.pid)
        return pids

    def _group_alive(self) -> bool:
        return self.proc is not None and not self._stopped and any(p.pgid == self.proc.pid for p in processes())

    def _reap_group(self, regions: Iterable[str] = ()) -> None:
        if self._group_alive():
            kill_group(self.proc.pid, regions)
        else:
            unlink_shm(regions)

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop gracefully (SIGINT to the server), then SIGKILL its whole process group after ``grace`` s.

        SIGINT goes to the server alone: it unloads the models, which tells each Python
        stub to run ``finalize`` and exit. Whatever of the group is left after ``grace``
        seconds (a server waiting on a crashed or stuck stub for ``--exit-timeout-secs``,
        stubs stuck after the server died) is killed with SIGKILL and the stubs'
        shared-memory regions are unlinked. Returns the server's exit code; calling it
        again does nothing (the group's id may belong to someone else by then).
        """
        proc = self.proc
        if proc is None or self._stopped:
            return None if proc is None else proc.returncode
        try:
            self.stop_file.touch()  # first: the model ends its streams while Triton can still deliver the ends
            regions = self._regions | (group_shm_regions(proc.pid) if self._group_alive() else set())
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            # Anything left in the group (the server past its grace, stuck stubs) dies now.
            self._reap_group(regions)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                pass
            self._stopped = True
            self._regions.clear()
            self.stop_file.unlink(missing_ok=True)
            return proc.returncode
        finally:
            release_guard(self._guard)
            self._guard = None
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def __enter__(self) -> "TritonServer":
        return self.start_and_wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_env(model_dir: str | os.PathLike | None = None, adapter_store: str | os.PathLike | None = None,
               engine_config: Mapping | str | None = None,
               tenants_file: str | os.PathLike | None = None) -> dict[str, str]:
    """The LORAPLEX_* environment variables the engine reads."""
    env: dict[str, str] = {}
    if model_dir is not None:
        env["LORAPLEX_MODEL_DIR"] = str(Path(model_dir).resolve())
    if adapter_store is not None:
        env["LORAPLEX_ADAPTER_STORE"] = str(Path(adapter_store).resolve())
    if engine_config is not None:
        env["LORAPLEX_ENGINE_CONFIG"] = engine_config if isinstance(engine_config, str) \
            else json.dumps(dict(engine_config))
    if tenants_file is not None:
        env["LORAPLEX_TENANTS_FILE"] = str(Path(tenants_file).resolve())
    return env
