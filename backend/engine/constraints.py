"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar),
parsed from vLLM's keys and compiled by xgrammar off the engine loop, bounded in size and time.

The spelling is vLLM's: ``structured_outputs`` is an object (or a JSON string of one) with exactly one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` (and optionally ``disable_any_whitespace``);
the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` keys say the same.
Compiled grammars are kept in an LRU per engine (so per tokenizer), keyed by the constraint, up to
``CACHE_BYTES`` of xgrammar's own accounting: a constraint already compiled costs a dict lookup, never
a compile thread nor a tenant's compile allowance.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from loraplex.exceptions import InvalidRequest, QuotaExceeded

KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex, grammar or the choices together, as sent
MAX_CHOICES = 1024
COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer to compile is refused
COMPILE_THREADS = 2  # compiles at once, per engine; more wait their turn (within their timeout)
MAX_COMPILES_PER_TENANT = 1  # a tenant's compiles in flight (running or waiting): one tenant never holds both threads
CACHE_BYTES = 256 * 1024 * 1024  # compiled grammars kept (least recently used go first)


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


def _spec(kind: str, value: Any) -> str:
    """The text of one kind's value, checked for type and size."""
    if kind == "json":
        schema = _loaded(value, "the JSON schema")
        if isinstance(schema, bool) or not isinstance(schema, dict):
            _fail(f"json must be a JSON schema object, got {type(schema).__name__}")
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


# xgrammar 0.2.9 lowers a string with minLength/maxLength to repetitions of a bare character class that admits
# raw control characters and no escapes (mlc-ai/xgrammar#800, fix open as #880): its output need not parse as
# JSON. Each repetition becomes one JSON character instead, unescaped or escaped, as in that fix. Its JSON
# characters also take UTF-8-encoded surrogates (U+D800-DFFF), which are not UTF-8: a byte-level vocabulary
# can sample them, and the text shows U+FFFD for each byte. Both classes leave them out.
_BARE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_BASIC_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _json_schema_grammar(schema_text: str, any_whitespace: bool) -> str:
    """The schema's grammar as xgrammar builds it, its string characters valid UTF-8 JSON characters."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace))
    if "basic_escape ::=" in text:
        text = text.replace(_BARE_STRING_CHAR, f'{_JSON_CHAR} | "\\\\" basic_escape')
    return text.replace(_BASIC_STRING_CHAR, _JSON_CHAR)


def _choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer with xgrammar, on COMPILE_THREADS threads, each within
    COMPILE_TIMEOUT_S; xgrammar is imported at the first constraint (a server without any never loads it)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], timeout_s: float = COMPILE_TIMEOUT_S):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.timeout_s = timeout_s
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="loraplex-grammar")
        self._in_flight: dict[str, int] = {}  # tenant -> compiles running or waiting (under _lock)
        self._cache: OrderedDict[Constraint, object] = OrderedDict()  # least recently used first (under _lock)
        self._cache_bytes = 0
        self.compiled = 0  # constraints compiled (cache hits not counted)

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_now(self, constraint: Constraint):
        compiler = self._xgrammar_compiler()
        kind, spec = constraint.kind, constraint.spec
        if kind == "json":
            return compiler.compile_grammar(_json_schema_grammar(spec, constraint.any_whitespace))
        if kind == "json_object":  # a JSON object, as OpenAI's json_object means (the builtin grammar takes any value)
            return compiler.compile_grammar(_json_schema_grammar('{"type": "object"}', constraint.any_whitespace))
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(json.loads(spec)))
        return compiler.compile_grammar(spec)

    def compile(self, constraint: Constraint, tenant: str = "default"):
        """The constraint's xgrammar CompiledGrammar; raises InvalidRequest when xgrammar refuses it (an invalid
        schema, an unsupported feature, a regex or grammar that does not parse) or it takes over timeout_s, and
        QuotaExceeded when the tenant has MAX_COMPILES_PER_TENANT compiles in flight already (so one tenant's
        slow constraints cannot hold every compile thread, nor every thread waiting for one)."""
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                return cached
            if self._in_flight.get(tenant, 0) >= MAX_COMPILES_PER_TENANT:
                raise QuotaExceeded(f"{MAX_COMPILES_PER_TENANT} structured-output constraints of this tenant are "
                                    "compiling; retry when they are done")
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        future = self._pool.submit(self._compile_now, constraint)
        future.add_done_callback(lambda _: self._done(tenant))  # counted until the compile ends, not the wait
        try:
            compiled = future.result(self.timeout_s)
        except FutureTimeout:
            raise InvalidRequest(f"{constraint.describe()}: compiling it took over {self.timeout_s:g} s") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequest(f"{constraint.describe()} is not valid: {message[:300]}") from None
        self._remember(constraint, compiled)
        return compiled

    def _remember(self, constraint: Constraint, compiled) -> None:
        """Cache a compiled grammar, dropping the least recently used past CACHE_BYTES."""
        size = compiled.memory_size_bytes
        with self._lock:
            self.compiled += 1
            if constraint in self._cache or size > CACHE_BYTES:
                return
            self._cache[constraint] = compiled
            self._cache_bytes += size
            while self._cache_bytes > CACHE_BYTES:
                _, dropped = self._cache.popitem(last=False)
                self._cache_bytes -= dropped.memory_size_bytes

    def _done(self, tenant: str) -> None:
        with self._lock:
            left = self._in_flight.pop(tenant) - 1
            if left:
                self._in_flight[tenant] = left

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled):
    """A fresh matcher over a compiled grammar: one per sample (n > 1 samples never share one)."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)
