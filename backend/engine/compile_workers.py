"""The engine's compile workers: processes that compile structured-output constraints, each compile within a time
bound past which its process is killed (its CPU and memory stop with it) and a new one is started.

Each of ``size`` slots is a thread that owns one worker process (engine/compile_worker.py), started by the slot's
first job: a server that never sees a constraint starts none, and the second slot only when two compiles run at
once. Processes are started with fork and exec (never a bare fork of the engine: it has threads, and CUDA), by
the interpreter that runs the engine, and die with the slot thread that started them. Jobs wait in order, those
marked ``behind`` after all others; a job withdrawn while it waits never reaches a worker. Slot threads and their
processes run niced, so compiles yield the CPU to the engine loop and the request threads.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from loraplex.engine.compile_worker import HEADER, encode_message

log = logging.getLogger("loraplex.compile_workers")

STARTUP_TIMEOUT_S = 120.0  # a new worker's set-up: Python, xgrammar and its imports, the tokenizer's vocabulary
NICE = 10  # slot threads and worker processes: below the engine loop and the request threads
MAX_REPLY_BYTES = 64 << 10
WORKER_MODULE = "loraplex.engine.compile_worker"


class CompileStopped(Exception):
    """The compile ran past its time bound; its worker process was killed."""


class CompileFailed(Exception):
    """xgrammar refused the constraint (the message says why); ``memory``: it ran out of the worker's memory."""

    def __init__(self, message: str, memory: bool = False):
        super().__init__(message)
        self.memory = memory


class WorkerLost(Exception):
    """The worker process died during the compile (the kernel killed it, or it crashed)."""


class WorkerUnavailable(Exception):
    """No worker process could be started."""


def python_executable() -> str:
    """The interpreter that runs the engine (in Triton's Python-backend stub, the one PATH names first)."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    for candidate in (os.path.join(sys.prefix, "bin", "python3"), shutil.which("python3")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise WorkerUnavailable(f"no Python interpreter to run compile workers (sys.executable is {sys.executable!r})")


def default_command() -> list[str]:
    return [python_executable(), "-m", WORKER_MODULE]


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


class Worker:
    """One worker process and its pipes; every write and read within a deadline (time.monotonic())."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(command + [str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, close_fds=True)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.ready = False  # set up: it has answered the set-up message

    @property
    def pid(self) -> int:
        return self.proc.pid

    def set_up(self, init: dict, deadline: float) -> None:
        self._send(init, deadline)
        reply = self._receive(deadline)
        if reply.get("ready") != self.pid:
            raise WorkerLost(f"the worker answered its set-up with {reply!r}")
        self.ready = True

    def run(self, job: dict, deadline: float) -> dict:
        """The worker's reply to one job; TimeoutError past the deadline, WorkerLost when it dies."""
        self._send(job, deadline)
        return self._receive(deadline)

    def kill(self) -> None:
        """SIGKILL, reaped: its CPU and memory are free when this returns."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def _lost(self) -> WorkerLost:
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        return WorkerLost(f"its worker process died ({_signal_name(self.proc.returncode)})")

    def _send(self, message: dict, deadline: float) -> None:
        data, fd = memoryview(encode_message(message)), self.proc.stdin.fileno()
        while data:
            self._wait(fd, select.POLLOUT, deadline)
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError):
                raise self._lost() from None

    def _receive(self, deadline: float) -> dict:
        (size,) = HEADER.unpack(self._read(HEADER.size, deadline))
        if size > MAX_REPLY_BYTES:
            raise WorkerLost(f"its worker sent a reply of {size} bytes")
        return json.loads(self._read(size, deadline))

    def _read(self, size: int, deadline: float) -> bytes:
        fd, data = self.proc.stdout.fileno(), bytearray()
        while len(data) < size:
            self._wait(fd, select.POLLIN, deadline)
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise self._lost()
            data += chunk
        return bytes(data)

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, event)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if poller.poll(max(1, int(left * 1000))):
                return


@dataclass(slots=True)
class _Job:
    future: Future
    job: dict
    then: Callable[[dict], Any]


class _Slot:
    __slots__ = ("worker", "thread")

    def __init__(self):
        self.worker: Worker | None = None
        self.thread: threading.Thread | None = None


class CompileWorkers:
    """``size`` slots, each running one job at a time in its worker process within ``timeout_s``.

    ``init()`` gives a new worker's set-up message (the tokenizer's vocabulary: built at the first start).
    """

    def __init__(self, init: Callable[[], dict], size: int, timeout_s: float, memory_bytes: int,
                 command: list[str] | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self._init, self.size, self.timeout_s = init, size, timeout_s
        self.memory_bytes, self.startup_timeout_s = memory_bytes, startup_timeout_s
        self._command = command
        self._env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self._cond = threading.Condition()
        self._queues: tuple[deque[_Job], deque[_Job]] = (deque(), deque())  # in order; the second behind
        self._slots: list[_Slot] = []
        self._idle = 0  # slot threads waiting for a job (under _cond)
        self._closed = False
        self.started = 0  # worker processes started
        self.stopped = 0  # compiles stopped at the time bound (their workers killed)

    # ---- the callers' side -------------------------------------------------------------------------------------
    def submit(self, job: dict, then: Callable[[dict], Any], behind: bool = False) -> Future:
        """A future of ``then(reply)``, called on the slot's thread once a worker compiled ``job`` within the
        bound; it raises CompileStopped, CompileFailed, WorkerLost or WorkerUnavailable instead."""
        item = _Job(Future(), job, then)
        with self._cond:
            if self._closed:
                raise WorkerUnavailable("the compile workers are closed")
            self._queues[1 if behind else 0].append(item)
            if sum(map(len, self._queues)) > self._idle and len(self._slots) < self.size:
                self._start_slot()
            self._cond.notify()
        return item.future

    def withdraw(self, future: Future) -> bool:
        """Take a waiting job out of the queue (it never runs); False when a slot has it already."""
        with self._cond:
            for queue in self._queues:
                for item in queue:
                    if item.future is future:
                        queue.remove(item)
                        future.cancel()
                        return True
        return False

    def pids(self) -> list[int]:
        """The worker processes running now."""
        with self._cond:
            return [slot.worker.pid for slot in self._slots if slot.worker is not None]

    def close(self) -> None:
        """Cancel the waiting jobs, kill the workers, let the slot threads end."""
        with self._cond:
            self._closed = True
            waiting = [item for queue in self._queues for item in queue]
            for queue in self._queues:
                queue.clear()
            workers = [slot.worker for slot in self._slots if slot.worker is not None]
            self._cond.notify_all()
        for item in waiting:
            item.future.cancel()
        for worker in workers:
            worker.kill()

    # ---- the slots' side ---------------------------------------------------------------------------------------
    def _start_slot(self) -> None:
        slot = _Slot()
        slot.thread = threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                       name=f"loraplex-grammar-{len(self._slots)}")
        self._slots.append(slot)
        slot.thread.start()

    def _take(self) -> _Job | None:
        with self._cond:
            while not self._closed:
                for queue in self._queues:
                    while queue:
                        item = queue.popleft()
                        if item.future.set_running_or_notify_cancel():
                            return item
                self._idle += 1
                self._cond.wait()
                self._idle -= 1
            return None

    def _serve(self, slot: _Slot) -> None:
        if sys.platform == "linux":  # a thread's own nice value (Linux); the processes it starts inherit it
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            except OSError:
                pass
        while (item := self._take()) is not None:
            try:
                item.future.set_result(item.then(self._run(slot, item.job)))
            except BaseException as exc:  # noqa: BLE001 - the caller gets every failure
                if self._closed and not isinstance(exc, WorkerLost):  # close() killed the worker mid-job (a pipe
                    exc = WorkerLost("the compile workers were closed")  # read may then fail with EBADF)
                item.future.set_exception(exc)
            if slot.worker is None and not self._closed:  # killed: its successor loads xgrammar meanwhile
                try:
                    self._set_worker(slot, self._spawn())
                except WorkerUnavailable as exc:
                    log.warning("%s", exc)
        if slot.worker is not None:
            slot.worker.kill()

    def _set_worker(self, slot: _Slot, worker: Worker | None) -> None:
        with self._cond:
            slot.worker = worker
            closed = self._closed
        if closed and worker is not None:
            worker.kill()

    def _run(self, slot: _Slot, job: dict) -> dict:
        if slot.worker is not None and slot.worker.proc.poll() is not None:  # it died while idle
            slot.worker.kill()
            self._set_worker(slot, None)
        if slot.worker is None:
            self._set_worker(slot, self._spawn())
        worker = slot.worker
        if not worker.ready:  # a job waits for its worker's start, not counted against its bound
            self._set_up(slot, worker)
        try:
            reply = worker.run(dict(job, cpu_s=self.timeout_s + 1.0), time.monotonic() + self.timeout_s)
        except TimeoutError:
            worker.kill()
            self._set_worker(slot, None)
            with self._cond:
                self.stopped += 1
            raise CompileStopped(f"it ran past {self.timeout_s:g} s; the compile was stopped") from None
        except WorkerLost:
            worker.kill()
            self._set_worker(slot, None)
            raise
        if "error" in reply:
            raise CompileFailed(str(reply["error"]), bool(reply.get("memory")))
        return reply

    def _spawn(self) -> Worker:
        """A worker process started (it loads xgrammar while it waits for its set-up)."""
        try:
            return Worker(self._command or default_command(), self._env)
        except OSError as exc:
            raise WorkerUnavailable(f"a compile worker could not start: {exc}") from exc

    def _set_up(self, slot: _Slot, worker: Worker) -> None:
        """Send a started worker its set-up and wait until it is ready; WorkerUnavailable when it cannot be."""
        try:
            init = dict(self._init(), memory_bytes=self.memory_bytes, nice=NICE)
            worker.set_up(init, time.monotonic() + self.startup_timeout_s)
        except Exception as exc:
            worker.kill()
            self._set_worker(slot, None)
            raise WorkerUnavailable(f"a compile worker did not start: {exc or 'timed out'}") from exc
        with self._cond:
            self.started += 1
