"""Process faults under load against a real tritonserver run by loraplex-serve: a killed stub, a tritonserver that
aborts, SIGTERM to the server.

What Triton 2.51 does on its own (measured; docs/decisions/027-process-tree-and-faults.md): a decoupled model's dead
stub is never restarted, its in-flight streams hang until the server exits, and the server
stays ready; the launcher restarts it, as it restarts a server that died by a signal it was not asked to stop
with (docs/decisions/063-launcher-restarts-on-a-crash.md). On SIGTERM it starts unloading the model but, with
streams open, calls finalize() only after --exit-timeout-secs (then often crashes); the
model notices the unload (readiness polling) and ends each stream with UNAVAILABLE.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tritonserver_fixture import (SERVE_EXIT_TIMEOUT, descendants, launcher_under_load, start_streams, wait_ended,
                                  wait_gone)

from loraplex.clients.generate import stream_generate
from loraplex.launch.processes import STUB_COMM, shm_region

BOUND = SERVE_EXIT_TIMEOUT + 20  # generous: "ends within" bounds, not timings


def _serves(model: str, pid: int) -> bool:
    """Whether the Python-backend stub ``pid`` runs ``model`` (its argv[1] is the model's model.py)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(argv) > 1 and f"/{model}/".encode() in argv[1]


def test_killed_stub_fails_in_flight_streams_and_the_launcher_serves_again(tmp_path, demo):
    with launcher_under_load(tmp_path, demo["model"], n=4) as (launcher, server, streams):
        stub = next(p.pid for p in descendants(server.pid) if p.comm == STUB_COMM and _serves("lora_llm", p.pid))
        region = shm_region(stub)
        os.kill(stub, signal.SIGKILL)
        wait_ended(streams, timeout=30)  # without the launcher's restart they would hang until the server exits
        for s in streams:
            kind, _, text = s.only_ending()
            assert kind == "error" and "UNAVAILABLE" in text, text
        again = launcher.wait_serving(not_pid=server.pid)
        result = stream_generate(launcher.grpc_url, "Hello", {"max_tokens": 4, "ignore_eos": True, "temperature": 0},
                                 return_num_output_tokens=True)
        assert result.error is None and result.final_count == 1
        assert sum(r["num_output_tokens"][0] for r in result.responses) == 4
        # an abort of tritonserver right after the stub died (the Python backend's lock_exception) may come first
        assert re.search(rf"Python-backend stub [\d, ]*\b{stub}\b[\d, ]* died .*restarting tritonserver",
                         launcher.stderr()), launcher.stderr()
        wait_gone({server.pid}, timeout=10)  # the old server and its dead stub are gone ...
        deadline = time.monotonic() + 5  # ... and so, once the launcher saw the group empty, is the stub's memory
        while Path("/dev/shm", region).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path("/dev/shm", region).exists(), launcher.stderr()
        assert any(p.comm == STUB_COMM for p in descendants(again.pid))


def _serves_a_request(launcher) -> None:
    result = stream_generate(launcher.grpc_url, "Hello", {"max_tokens": 4, "ignore_eos": True, "temperature": 0},
                             return_num_output_tokens=True)
    assert result.error is None and result.final_count == 1, result.error
    assert sum(r["num_output_tokens"][0] for r in result.responses) == 4


def test_a_tritonserver_killed_by_a_signal_is_restarted_and_serves_again(tmp_path, demo):
    """SIGABRT under load: what the Python backend's lock_exception does after a stub died. Triton logs it as it logs
    a SIGTERM ("Signal (6) received."); the launcher restarts it. SIGKILL (the OOM killer's) takes the same path
    (tests/unit/test_restarts.py)."""
    with launcher_under_load(tmp_path, demo["model"], n=2) as (launcher, server, streams):
        os.kill(server.pid, signal.SIGABRT)
        wait_ended(streams, timeout=30)
        # each ended once: cut as it dies (UNAVAILABLE), ended by the model if it saw the shutdown first, or whole
        # (Triton shuts down on SIGABRT as on SIGTERM: a fast machine finishes 1000 tokens within it)
        for s in streams:
            kind, _, text = s.only_ending()
            assert kind == "final" or ("UNAVAILABLE" in text or "the model is shutting down" in text), text
        again = launcher.wait_serving(not_pid=server.pid)
        _serves_a_request(launcher)
        assert launcher.wait_stderr("tritonserver is serving again (restart 1)"), launcher.stderr()
        assert "tritonserver died by SIGABRT (it was not asked to stop); restarting tritonserver" in launcher.stderr()
        wait_gone({server.pid}, timeout=10)  # the old server's group, stubs included, is gone
        assert any(p.comm == STUB_COMM for p in descendants(again.pid))


def test_sigterm_to_the_server_ends_each_in_flight_stream_once_within_the_exit_timeout(tmp_path, demo):
    with launcher_under_load(tmp_path, demo["model"], n=3) as (launcher, server, long):
        short = start_streams(launcher.grpc_url, 2, max_tokens=150, prefix="short")  # may finish in the timeout
        sessions = launcher.sessions()
        t0 = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        wait_ended(long + short, timeout=BOUND)
        for s in long + short:
            kind, at, text = s.only_ending()
            assert at - t0 < BOUND
            assert kind == "final" or "the model is shutting down" in text, text  # ended by the model, not dropped
        try:
            rc = launcher.proc.wait(timeout=BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"loraplex-serve still runs {BOUND}s after its server was stopped:\n{launcher.stderr()}")
        assert rc == 1  # it stops with its server
        wait_gone(sessions, timeout=10)


def test_the_stop_file_ends_each_in_flight_stream_with_the_shutdown_error(tmp_path, demo):
    """The launcher's stop file alone (no signal yet) makes the model end what it holds, each stream once."""
    with launcher_under_load(tmp_path, demo["model"], n=2) as (launcher, server, streams):
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        stop_file = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"LORAPLEX_STOP_FILE="))
        stop_file = Path(stop_file.decode())
        stop_file.touch()
        try:
            wait_ended(streams, timeout=10)  # the model looks for it every 0.1 s
            for s in streams:
                kind, _, text = s.only_ending()
                assert kind == "error" and "the model is shutting down" in text, text
        finally:
            stop_file.unlink(missing_ok=True)  # the launcher is SIGKILLed on the way out: nobody else removes it
