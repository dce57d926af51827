"""Our processes as the kernel sees them: /proc, the parent-death signal, the group guard, stub shared memory.

Standard library only: the guard runs this file as a script (``python -I -S processes.py guard``).
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterable

STUB_COMM = "triton_python_b"  # /proc/<pid>/comm of triton_python_backend_stub (15 characters)
SHM_PREFIX = "triton_python_backend_shm_region_"  # the stub's argv[2]; a file in /dev/shm
DEATH_SIGNAL = signal.SIGTERM  # why SIGTERM: docs/decisions/027-process-tree-and-faults.md
_PR_SET_PDEATHSIG = 1
GUARD_DONE = b"stopped"


@dataclass(slots=True, frozen=True)
class ProcInfo:
    """One process as ``/proc/<pid>/stat`` shows it."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int

    @property
    def running(self) -> bool:
        """Not a zombie (a zombie holds no memory, ports or files)."""
        return self.state not in ("Z", "X")


def proc_info(pid: int) -> ProcInfo | None:
    """``/proc/<pid>/stat`` parsed; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return ProcInfo(pid, comm, rest[0], int(rest[1]), int(rest[2]), int(rest[3]))


def processes() -> list[ProcInfo]:
    """Every process in ``/proc`` right now."""
    found = (proc_info(int(e)) for e in os.listdir("/proc") if e.isdigit())
    return [p for p in found if p is not None]


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    info = proc_info(pid)
    return info is not None and info.running


def shm_region(pid: int) -> str | None:
    """The shared-memory region a live Python-backend stub was given (its argv[2])."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    return argv[2].decode() if len(argv) > 2 and argv[2].startswith(SHM_PREFIX.encode()) else None


def mapped_shm_regions(pid: int) -> set[str]:
    """The stub shared-memory regions process ``pid`` has mapped.

    tritonserver maps the region of every stub it started, dead ones included, and a stub
    maps its own: unlike a dead stub's command line, this survives the stub.
    """
    marker = f"/dev/shm/{SHM_PREFIX}"
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if marker in line}
    except OSError:
        return set()
    return {path.rsplit("/", 1)[1] for path in paths if path.startswith(marker) and not path.endswith("(deleted)")}


def group_shm_regions(pgid: int) -> set[str]:
    """Shared-memory regions mapped by the live members of process group ``pgid`` (a server and its stubs)."""
    regions: set[str] = set()
    for p in processes():
        if p.pgid == pgid and p.running:
            regions |= mapped_shm_regions(p.pid)
    return regions


def kill_group(pgid: int, regions: Iterable[str] = (), timeout: float = 5.0) -> None:
    """SIGKILL process group ``pgid``, wait until it is empty, then unlink the stubs' ``regions``.

    A SIGKILLed stub or server never unlinks its /dev/shm region, so each one would leak
    (1 MiB and up, in RAM). Call only while the group has members: a pgid cannot be
    reused while any process (zombies too) still carries it.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + timeout
    while any(p.pgid == pgid and p.running for p in processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    unlink_shm(regions)


def unlink_shm(regions: Iterable[str]) -> None:
    """Remove these shared-memory regions from /dev/shm (those already gone are skipped)."""
    for name in regions:
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass


def die_with_parent(sig: int):
    """A ``preexec_fn`` asking the kernel for ``sig`` when the forking thread ends.

    Resolved before the fork (the child only calls prctl); if the parent is already gone
    by then, the child signals itself.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def start_in_session(cmd: list[str], death_signal: int = DEATH_SIGNAL, **popen) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (a terminal's Ctrl-C reaches only us) that gets
    ``death_signal`` when we die; the kernel ties that signal to the forking thread, so only
    a child forked from the main thread gets it."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    return subprocess.Popen(cmd, start_new_session=True,
                            preexec_fn=die_with_parent(death_signal) if on_main_thread else None, **popen)


def http_get(url: str, timeout: float = 2.0, max_bytes: int = 1 << 16) -> tuple[http.client.HTTPMessage, bytes] | None:
    """(headers, up to max_bytes of body) of a GET of ``url`` that answers 200 right now (health and readiness
    probes); None for anything else: nothing listening, another status, or something that does not speak
    HTTP/1 (another server's gRPC port)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return (response.headers, response.read(max_bytes)) if response.status == 200 else None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return None


def answers_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 right now."""
    return http_get(url, timeout, max_bytes=0) is not None


def get_json(url: str, timeout: float = 2.0):
    """What a GET of ``url`` answers with 200, as JSON, right now; None for no answer or no JSON."""
    answer = http_get(url, timeout)
    try:
        return json.loads(answer[1]) if answer else None
    except ValueError:
        return None


def start_guard(pgid: int, grace: float, stop_file: str | os.PathLike | None = None,
                stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """A guard process that ends process group ``pgid`` if this process dies without ``release_guard``.

    It lives in a session of its own (no signal meant for us or the group reaches it), and
    it watches a pipe whose only writer is this process, so it works whichever thread
    starts it: unlike the parent-death signal, which the kernel ties to the forking thread.
    """
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), "guard", str(pgid), str(grace)]
    return subprocess.Popen(argv + ([str(stop_file)] if stop_file else []), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


def release_guard(guard: subprocess.Popen | None) -> None:
    """Tell a guard its group was stopped in order (it exits without touching anything) and reap it."""
    if guard is None:
        return
    try:
        guard.stdin.write(GUARD_DONE)
        guard.stdin.close()
    except OSError:
        pass
    try:
        guard.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - the guard exits on EOF
        guard.kill()
        guard.wait()


def _guard_main(pgid: int, grace: float, stop_file: str | None) -> None:
    """The guard: wait for the launcher to go; if it went without stopping the group, end the group.

    Its stdin is a pipe whose only writer is the launcher, so EOF means the launcher
    process is gone, however it ended. It stops the group as the launcher would have: the
    stop file first, if any (a tritonserver's model ends its streams within 0.1 s, while
    Triton can still deliver the ends; its readiness poll alone takes up to 1 s, long enough
    for a fast engine to finish them), then ``DEATH_SIGNAL`` to the group's leader
    (graceful); it waits up to ``grace`` s for the leader to exit, then kills the whole
    group: Python-backend stubs whose parent dies while our model is sending deadlock in
    Triton 2.51 and never exit, and a gateway whose event loop is blocked never acts on
    a signal.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.stdin.buffer.read() == GUARD_DONE or not any(p.pgid == pgid for p in processes()):
        return
    regions = group_shm_regions(pgid)
    if stop_file:
        try:
            open(stop_file, "ab").close()
        except OSError:
            pass  # the readiness poll still ends the streams
    try:
        os.kill(pgid, DEATH_SIGNAL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while process_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_group(pgid, regions)
    if stop_file:
        try:
            os.unlink(stop_file)
        except OSError:
            pass


if __name__ == "__main__" and sys.argv[1:2] == ["guard"]:  # a guard process (start_guard)
    _guard_main(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
