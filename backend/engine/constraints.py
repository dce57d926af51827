"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar),
parsed from vLLM's keys, checked for size and nesting, and compiled by xgrammar off the engine loop, within a
time bound in a worker process that is killed at it (engine/compile_workers.py).

The spelling is vLLM's: ``structured_outputs`` is an object (or a JSON string of one) with exactly one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` (and optionally ``disable_any_whitespace``);
the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` keys say the same.
Compiled grammars are kept per engine (so per tokenizer) and per tenant (engine/grammar_cache.py), up to
``CACHE_BYTES`` of xgrammar's own accounting: a constraint the tenant already compiled costs a dict lookup,
never a worker nor a compile allowance; another tenant's constraints are never its hits.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import CancelledError, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from loraplex.engine.compile_worker import compile_constraint, new_compiler
from loraplex.engine.compile_workers import (CompileFailed, CompileStopped, CompileWorkers, WorkerLost,
                                             WorkerUnavailable)
from loraplex.engine.grammar_cache import GrammarCache
from loraplex.exceptions import EngineOverloaded, EngineShuttingDown, InvalidRequest, QuotaExceeded, RequestCancelled

KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex, grammar or the choices together, as sent
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # a JSON schema's nesting as a JSON document (xgrammar's compile grows faster than it)
MAX_NESTING = 32  # groups within groups in a regex (a schema's patterns too) or an EBNF grammar
COMPILE_TIMEOUT_S = 10.0  # a compile running longer is stopped (its worker process killed) and refused
COMPILE_WORKERS = 2  # compiles at once, per engine, each in its own process; more wait their turn
COMPILE_MEMORY_BYTES = 1 << 30  # what a compile may allocate in its worker, beyond xgrammar loaded
MAX_COMPILES_PER_TENANT = 1  # a tenant's compiles in flight (running or waiting): one tenant never holds both workers
STOPPED_BEHIND_S = 60.0  # a tenant whose compile was stopped this recently waits behind every other tenant's
CANCEL_POLL_S = 0.1  # how often a waiting caller asks whether its request was cancelled
CACHE_BYTES = 256 * 1024 * 1024  # compiled grammars kept, all tenants together (engine/grammar_cache.py)


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's constraint: kind (KINDS) and its text (a schema as canonical JSON, a regex, an EBNF
    grammar, the choices as a JSON list; "" for json_object)."""

    kind: str
    spec: str
    any_whitespace: bool = True

    def describe(self) -> str:
        return f"structured_outputs.{self.kind}"


def _fail(message: str):
    raise InvalidRequest(f"structured_outputs: {message}")


def _loaded(value: Any, what: str) -> Any:
    """value, or the JSON it holds when it is a string that parses as JSON."""
    if isinstance(value, str):
        if len(value.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
            _fail(f"{what} is over {MAX_CONSTRAINT_BYTES} bytes")
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _nesting(text: str, grammar: bool) -> int:
    """How deep ``(`` groups nest in a regex, or in an EBNF grammar (its string literals, character classes
    and comments left out); a linear scan."""
    depth = deepest = i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[" or (grammar and c in "\"'"):  # a character class, or a grammar's string literal
            close = "]" if c == "[" else c
            i += 1
            if c == "[" and not grammar:  # a regex class may start with ^ and then a literal ]
                i += 1 if i < n and text[i] == "^" else 0
                i += 1 if i < n and text[i] == "]" else 0
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif grammar and c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def _check_nesting(text: str, what: str, grammar: bool = False) -> None:
    depth = _nesting(text, grammar)
    if depth > MAX_NESTING:
        _fail(f"{what} nests its groups {depth} deep, more than {MAX_NESTING}")


def _check_schema(schema: dict) -> None:
    """A schema's nesting (as a JSON document) and its patterns' nesting, before xgrammar sees it."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            _fail(f"json nests more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                _check_nesting(node["pattern"], "a pattern in json")
            if isinstance(node.get("patternProperties"), dict):
                for pattern in node["patternProperties"]:
                    _check_nesting(pattern, "a patternProperties key in json")
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)


def _spec(kind: str, value: Any) -> str:
    """The text of one kind's value, checked for type and size."""
    if kind == "json":
        schema = _loaded(value, "the JSON schema")
        if isinstance(schema, bool) or not isinstance(schema, dict):
            _fail(f"json must be a JSON schema object, got {type(schema).__name__}")
        _check_schema(schema)
        try:
            text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
        except (ValueError, RecursionError):
            _fail("json is not a JSON schema object (too deep, or not JSON)")
    elif kind == "choice":
        choices = _loaded(value, "choice")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            _fail("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            _fail(f"choice has {len(choices)} strings, more than {MAX_CHOICES}")
        text = json.dumps(choices, ensure_ascii=False)
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            _fail(f"{kind} must be a non-empty string")
        _check_nesting(value, kind, grammar=kind == "grammar")
        text = value
    else:  # json_object
        if value not in (True, "true", "True", 1):
            _fail("json_object must be true")
        text = ""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        _fail(f"{kind} is over {MAX_CONSTRAINT_BYTES} bytes")
    return text


def parse_structured_outputs(value: Any) -> Constraint | None:
    """vLLM's ``structured_outputs`` (an object, or a JSON string of one) as a Constraint; None when empty.
    Raises InvalidRequest naming what is wrong."""
    fields = _loaded(value, "structured_outputs")
    if fields is None:
        return None
    if not isinstance(fields, dict):
        _fail("must be an object with one of " + ", ".join(KINDS))
    extra = sorted(set(fields) - set(KINDS) - {"disable_any_whitespace"})
    if extra:
        _fail(f"unknown field {extra[0]!r}; known: {', '.join(KINDS)}, disable_any_whitespace")
    given = [k for k in KINDS if fields.get(k) not in (None, False)]
    if len(given) != 1:
        _fail(f"give exactly one of {', '.join(KINDS)}" + (f", not {' and '.join(given)}" if given else ""))
    any_whitespace = fields.get("disable_any_whitespace") in (None, False, "false", "False", 0)
    return Constraint(given[0], _spec(given[0], fields[given[0]]), any_whitespace)


def parse_guided(key: str, value: Any) -> Constraint | None:
    """One of vLLM's older ``guided_*`` keys as a Constraint (None for a null value)."""
    if value is None:
        return None
    kind = GUIDED_KEYS[key]
    return Constraint(kind, _spec(kind, value))


def _asked(cancelled: Callable[[], bool]) -> bool:
    """Whether the request was cancelled; a sender that cannot say (already closed) counts as no."""
    try:
        return bool(cancelled())
    except Exception:  # noqa: BLE001 - the compile goes on; the request's end is the responder's to see
        return False


class ConstraintCompiler:
    """Compiles constraints for one tokenizer with xgrammar: first in a worker process (engine/compile_workers.py),
    stopped at ``timeout_s``, then, once it ended within its bounds there, in the engine process on the worker's
    slot thread (xgrammar's compiled grammars do not travel between processes cheaply: serialized, a flat schema
    of 400 properties is 61 MB). xgrammar and the workers start at the first constraint: a server without any
    loads neither."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], timeout_s: float = COMPILE_TIMEOUT_S,
                 *, wait_s: float | None = None, workers: int = COMPILE_WORKERS,
                 memory_bytes: int = COMPILE_MEMORY_BYTES, cache_bytes: int = CACHE_BYTES,
                 worker_command: list[str] | None = None):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.timeout_s = timeout_s
        self.wait_s = 2 * timeout_s if wait_s is None else wait_s  # a compile waits this long for a worker
        self._workers_size, self._memory_bytes, self._worker_command = workers, memory_bytes, worker_command
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()  # xgrammar's set-up in this process (seconds, the first time)
        self._info = None  # xgrammar's TokenizerInfo and its JSON (for the workers), built once
        self._info_json: str | None = None
        self._compiler = None
        self._pool: CompileWorkers | None = None
        self._closed = False
        self._in_flight: dict[str, int] = {}  # tenant -> compiles running or waiting (under _lock)
        self._stopped: dict[str, float] = {}  # tenant -> when a compile of theirs was last stopped (under _lock)
        self._cache = GrammarCache(cache_bytes)  # under _lock
        self.compiled = 0  # constraints compiled (cache hits not counted)

    # ---- xgrammar in the engine process ------------------------------------------------------------------------
    def _tokenizer_info(self):
        with self._setup_lock:
            if self._info is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids or None)
                self._info_json, self._info = info.serialize_json(), info
            return self._info

    def _worker_init(self) -> dict:
        self._tokenizer_info()
        return {"tokenizer_info": self._info_json}

    def _compile_here(self, constraint: Constraint):
        """The constraint compiled in this process (a worker has compiled it within its bounds already)."""
        info = self._tokenizer_info()
        with self._setup_lock:
            if self._compiler is None:
                self._compiler = new_compiler(info)
            compiler = self._compiler
        return compile_constraint(compiler, constraint.kind, constraint.spec, constraint.any_whitespace)

    def _workers(self) -> CompileWorkers:
        with self._lock:
            if self._closed:
                raise EngineShuttingDown("the model is shutting down; retry on another replica")
            if self._pool is None:
                self._pool = CompileWorkers(self._worker_init, self._workers_size, self.timeout_s,
                                            self._memory_bytes, self._worker_command)
            return self._pool

    # ---- compile --------------------------------------------------------------------------------------------------
    def compile(self, constraint: Constraint, tenant: str = "default", cancelled: Callable[[], bool] | None = None):
        """The constraint's xgrammar CompiledGrammar for this tenant. Raises InvalidRequest when xgrammar refuses
        it (an invalid schema, an unsupported feature, a regex or grammar that does not parse) or its compile ran
        past timeout_s or its memory (the compile is stopped); QuotaExceeded when the tenant has
        MAX_COMPILES_PER_TENANT compiles in flight already; EngineOverloaded when it waited wait_s for a worker;
        RequestCancelled when ``cancelled()`` turns true while it waits. A compile that has not started when its
        caller gives up never runs."""
        with self._lock:
            cached = self._cache.get(tenant, constraint)
            if cached is not None:
                return cached
            if self._in_flight.get(tenant, 0) >= MAX_COMPILES_PER_TENANT:
                raise QuotaExceeded(f"{MAX_COMPILES_PER_TENANT} structured-output constraints of this tenant are "
                                    "compiling; retry when they are done")
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
            behind = time.monotonic() - self._stopped.get(tenant, -STOPPED_BEHIND_S) < STOPPED_BEHIND_S
        job = {"kind": constraint.kind, "spec": constraint.spec, "any_whitespace": constraint.any_whitespace}
        try:
            future = self._workers().submit(job, lambda _reply: self._compile_here(constraint), behind)
        except (WorkerUnavailable, EngineShuttingDown):
            self._finished(tenant, constraint, None)
            raise EngineShuttingDown("the model is shutting down; retry on another replica") from None
        settled: list = []  # set once the compile's bookkeeping is done: by the callback or by this caller
        future.add_done_callback(lambda done: self._finished(tenant, constraint, done, settled))
        try:
            return self._result(future, constraint, cancelled)
        finally:  # a future's waiter may wake before its callbacks run: the tenant's next compile must see this one done
            if future.done():
                self._finished(tenant, constraint, future, settled)

    def _result(self, future, constraint: Constraint, cancelled: Callable[[], bool] | None):
        what = constraint.describe()
        wait_until = time.monotonic() + self.wait_s
        while True:
            try:
                return future.result(CANCEL_POLL_S)
            except FutureTimeout:
                pass
            except CancelledError:
                raise EngineShuttingDown("the model is shutting down; the request did not start") from None
            except CompileStopped:
                raise InvalidRequest(f"{what}: compiling it took over {self.timeout_s:g} s (the compile was "
                                     "stopped)") from None
            except CompileFailed as exc:
                if exc.memory:
                    raise InvalidRequest(f"{what}: compiling it needed over {self._memory_bytes >> 20} MiB of "
                                         "memory (the compile was stopped)") from None
                raise InvalidRequest(f"{what} is not valid: {exc}") from None
            except WorkerLost as exc:
                if self._closed:  # close() killed it
                    raise EngineShuttingDown("the model is shutting down; the request did not start") from None
                raise InvalidRequest(f"{what}: compiling it stopped: {exc}") from None
            except WorkerUnavailable as exc:
                raise EngineOverloaded(f"structured_outputs: no compile worker is available ({exc}); "
                                       "retry later") from None
            except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar in this process
                text = str(exc).strip()
                message = text.splitlines()[0] if text else type(exc).__name__
                raise InvalidRequest(f"{what} is not valid: {message[:300]}") from None
            if cancelled is not None and _asked(cancelled):
                self._pool.withdraw(future)  # waiting: never runs; running: ends within its bound, counted
                raise RequestCancelled(f"the request was cancelled while its {what} compiled")
            if time.monotonic() > wait_until and self._pool.withdraw(future):
                raise EngineOverloaded(f"{what}: every compile worker was busy for {self.wait_s:g} s; "
                                       "retry later")

    def _finished(self, tenant: str, constraint: Constraint, future, settled: list | None = None) -> None:
        """A compile ended (or never started): the tenant's allowance back, the grammar kept, a stop noted; once
        per compile (``settled`` records it)."""
        failure = None if future is None or future.cancelled() else future.exception()
        with self._lock:
            if settled is not None:
                if settled:
                    return
                settled.append(True)
            left = self._in_flight.pop(tenant) - 1
            if left:
                self._in_flight[tenant] = left
            if future is None or future.cancelled():
                return
            if failure is None:
                compiled = future.result()
                self.compiled += 1
                self._cache.put(tenant, constraint, compiled, compiled.memory_size_bytes)
            elif isinstance(failure, (CompileStopped, WorkerLost)) or getattr(failure, "memory", False):
                now = time.monotonic()
                self._stopped = {t: at for t, at in self._stopped.items() if now - at < STOPPED_BEHIND_S}
                self._stopped[tenant] = now

    def worker_pids(self) -> list[int]:
        """The compile worker processes running now."""
        pool = self._pool
        return pool.pids() if pool is not None else []

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.close()


def new_matcher(compiled):
    """A fresh matcher over a compiled grammar: one per sample (n > 1 samples never share one)."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)
