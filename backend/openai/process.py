"""The gateway as a child process of ``loraplex-serve``: start, wait until it answers, watch, stop.

Standard library only (the launcher does not import FastAPI). The child gets its own session,
so a Ctrl-C in the terminal reaches the launcher alone and the launcher stops it in order. It
never outlives the launcher: a guard process (``processes.start_guard``) sends it SIGTERM when the
launcher dies, however it dies and whichever thread started the child, and SIGKILL
``GUARD_GRACE`` s later (an event loop held up by a request cannot act on SIGTERM); a child
started from the main thread also gets the parent-death SIGTERM at once.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from loraplex.launch.processes import http_get, release_guard, start_guard, start_in_session

# loraplex-serve gives its gateway an id in this variable; /health names it in this header, so the launcher's
# probe tells its own gateway from another server that took the port
GATEWAY_ID_ENV, GATEWAY_ID_HEADER = "LORAPLEX_GATEWAY_ID", "x-loraplex-gateway"
RESTART_MIN_INTERVAL = 5.0  # a gateway that keeps dying is restarted at most this often
GUARD_GRACE = 10.0  # after the launcher died: SIGTERM, then SIGKILL this much later (past cli.GRACEFUL_SHUTDOWN_SECONDS)


def gateway_answers(url: str, gateway_id: str) -> bool:
    """Whether ``url``'s ``/health`` answers 200 right now from the gateway given ``gateway_id`` (not another server
    on its port)."""
    answer = http_get(f"{url}/health", max_bytes=0)
    return answer is not None and answer[0].get(GATEWAY_ID_HEADER) == gateway_id


class GatewayError(RuntimeError):
    """The gateway exited or did not answer in time."""


@dataclass
class GatewayProcess:
    """One ``python -m loraplex.openai`` child in front of ``triton_url``."""

    triton_url: str
    port: int
    host: str = "127.0.0.1"
    model_dir: str | None = None
    served_model_name: str | None = None
    log_level: str = "warning"
    lora_root: str | None = None  # --lora-root: vLLM's load/unload API (with admin_key)
    admin_key: str | None = None  # passed as $LORAPLEX_ADMIN_KEY (never on the command line)
    proc: subprocess.Popen | None = field(default=None, init=False)
    gateway_id: str = field(default_factory=lambda: f"gateway-{secrets.token_hex(6)}", init=False)
    started_at: float = field(default=0.0, init=False)
    _guard: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        """``http://host:port`` clients reach it at."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """Its command line."""
        cmd = [sys.executable, "-m", "loraplex.openai", "--triton-url", self.triton_url, "--host", self.host,
               "--port", str(self.port), "--log-level", self.log_level]
        if self.model_dir:
            cmd += ["--model-dir", str(self.model_dir)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.lora_root:
            cmd += ["--lora-root", str(self.lora_root)]
        return cmd

    def env(self) -> dict[str, str]:
        """Its environment: this one's, with its id, and the admin key when there is one."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{GATEWAY_ID_ENV: self.gateway_id})
        if self.admin_key:
            env["LORAPLEX_ADMIN_KEY"] = self.admin_key
        return env

    def start(self) -> "GatewayProcess":
        """Launch it (does not wait); its output goes to the launcher's stderr."""
        try:
            err = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a stderr without a file (captured): inherit fd 2
            err = None
        self._release_guard()  # a restart: the last child is gone
        self.proc = start_in_session(self.command(), signal.SIGTERM, stdin=subprocess.DEVNULL, stdout=err,
                                     stderr=err, env=self.env())
        self.started_at = time.monotonic()
        try:
            self._guard = start_guard(self.proc.pid, GUARD_GRACE)
        except OSError:
            self.proc.kill()
            raise
        return self

    def _release_guard(self) -> None:
        release_guard(self._guard)
        self._guard = None

    def running(self) -> bool:
        """Whether the child is alive."""
        return self.proc is not None and self.proc.poll() is None

    def answers(self) -> bool:
        """Whether ``/health`` answers 200 right now, from this gateway (not another server on its port)."""
        return gateway_answers(self.url, self.gateway_id)

    def wait_ready(self, timeout: float, stop=lambda: False) -> bool:
        """True once it answers, False if a stop was requested first; GatewayError if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not self.answers():
            if stop():
                return False
            if not self.running():
                raise GatewayError(f"loraplex-openai exited with code {self.proc.returncode} "
                                   f"(is port {self.port} free?)")
            if time.monotonic() > deadline:
                raise GatewayError(f"loraplex-openai did not answer on {self.url} within {timeout:.0f}s")
            time.sleep(0.2)
        return True

    def restart_if_dead(self) -> int | None:
        """Restart a gateway that died (rate-limited); its exit code if it was restarted."""
        if self.proc is None or self.running() or time.monotonic() - self.started_at < RESTART_MIN_INTERVAL:
            return None
        code = self.proc.returncode
        self.start()
        return code

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: no new connections, open streams get a bounded grace); does not wait."""
        if self.running():
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` s; its exit code."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._release_guard()
        return self.proc.returncode
