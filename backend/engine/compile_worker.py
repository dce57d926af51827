"""A compile worker: a process that compiles structured-output constraints with xgrammar, one at a time, for the
engine's pool (engine/compile_workers.py), under a memory rlimit, dying with the thread that started it; and the
compile itself (a constraint's kind and text to xgrammar's CompiledGrammar), the same in the worker and the engine.

Run as ``python -m loraplex.engine.compile_worker <parent pid>``. Each message either way is a 4-byte big-endian
length and that many bytes of JSON: first the pool's set-up (``tokenizer_info``, ``memory_bytes``, ``nice``),
answered by ``{"ready": pid}``; then one job (``kind``, ``spec``, ``any_whitespace``, ``cpu_s``) at a time,
answered by ``{"ok": true}`` or ``{"error": message, "memory": bool}``. The worker ends at the end of its input.
Only the standard library is imported by this module; xgrammar by the worker's main and by the compile.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import struct
import sys
import time
from typing import Callable

HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 << 20  # the set-up carries the tokenizer's vocabulary; a job at most 64 KiB of text
_PR_SET_PDEATHSIG = 1

# xgrammar 0.2.9 lowers a string with minLength/maxLength to repetitions of a bare character class that admits
# raw control characters and no escapes (mlc-ai/xgrammar#800, fix open as #880): its output need not parse as
# JSON. Each repetition becomes one unescaped JSON character instead (that fix also admits an escape there, but
# an alternation inside the counted repetition costs 15-120 ms a mask fill on a 49k vocabulary, past the matching
# budget, against 0.05 ms: so a length-bounded string holds no escapes, and its output still parses). Its JSON
# characters also take UTF-8-encoded surrogates (U+D800-DFFF), which are not UTF-8: a byte-level vocabulary
# can sample them, and the text shows U+FFFD for each byte. Both classes leave them out.
_BARE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_BASIC_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


# ---- the compile (worker and engine) --------------------------------------------------------------------------
def new_compiler(tokenizer_info):
    """xgrammar's compiler for one tokenizer: one thread, no cache of its own (the engine keeps one per tenant)."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)


def json_schema_grammar(schema_text: str, any_whitespace: bool) -> str:
    """The schema's grammar as xgrammar builds it, its string characters valid UTF-8 JSON characters."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace))
    return text.replace(_BARE_STRING_CHAR, _JSON_CHAR).replace(_BASIC_STRING_CHAR, _JSON_CHAR)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_constraint(compiler, kind: str, spec: str, any_whitespace: bool = True):
    """One constraint (engine/constraints.py's kinds and texts) as xgrammar's CompiledGrammar; raises what
    xgrammar raises for a constraint it refuses."""
    if kind == "json":
        return compiler.compile_grammar(json_schema_grammar(spec, any_whitespace))
    if kind == "json_object":  # a JSON object, as OpenAI's json_object means (the builtin grammar takes any value)
        return compiler.compile_grammar(json_schema_grammar('{"type": "object"}', any_whitespace))
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec)))
    return compiler.compile_grammar(spec)


# ---- messages ---------------------------------------------------------------------------------------------------
def read_message(stream) -> dict | None:
    """The next message from a binary stream; None at its end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes is over {MAX_MESSAGE_BYTES}")
    body = stream.read(size)
    return json.loads(body) if len(body) == size else None


def encode_message(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return HEADER.pack(len(body)) + body


# ---- the worker process -----------------------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started this process ends (Linux); exit now if it is gone already."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _limit_memory(extra_bytes: int) -> None:
    """Address space: what the process maps now (xgrammar and its imports loaded) plus ``extra_bytes``."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra_bytes if hard == resource.RLIM_INFINITY else min(hard, mapped + extra_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _limit_cpu(seconds: float) -> None:
    """SIGXCPU (death) after ``seconds`` more of CPU time: the job's bound when nobody is left to kill it."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used.ru_utime + used.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def take_stdout():
    """The engine's channel (the process's stdout), kept for the messages; whatever else writes to stdout
    (a library's print) goes to stderr instead."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def serve(setup: Callable[[dict], Callable[[dict], None]], argv: list[str], channel=None) -> int:
    """The worker's life: set-up (``setup(message)`` gives the job runner), then jobs until the input ends."""
    _die_with_parent(int(argv[1]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    stdin, stdout = sys.stdin.buffer, channel or take_stdout()
    init = read_message(stdin)
    if init is None:
        return 0
    nice = int(init.get("nice", 0))
    os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), nice))
    run = setup(init)
    _limit_memory(int(init["memory_bytes"]))
    stdout.write(encode_message({"ready": os.getpid()}))
    stdout.flush()
    while (job := read_message(stdin)) is not None:
        _limit_cpu(float(job.get("cpu_s", 60)))
        t0 = time.perf_counter()
        try:
            run(job)
            reply = {"ok": True, "seconds": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 - xgrammar's refusal of the constraint, sent to the engine
            text = str(exc).strip()
            memory = isinstance(exc, MemoryError) or "bad_alloc" in text
            reply = {"error": (text.splitlines()[0] if text else type(exc).__name__)[:300], "memory": memory}
        stdout.write(encode_message(reply))
        stdout.flush()
    return 0


def _xgrammar_setup(init: dict) -> Callable[[dict], None]:
    import xgrammar as xgr

    compiler = new_compiler(xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"]))

    def run(job: dict) -> None:
        compile_constraint(compiler, job["kind"], job["spec"], job.get("any_whitespace", True))

    return run


if __name__ == "__main__":
    _channel = take_stdout()
    import xgrammar  # noqa: F401 - loaded while the engine builds the set-up

    sys.exit(serve(_xgrammar_setup, sys.argv, _channel))
