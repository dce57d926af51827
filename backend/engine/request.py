"""Requests, their sampling parameters and the sequences the scheduler runs."""

from __future__ import annotations

import enum
import functools
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from loraplex.engine.constraints import GUIDED_KEYS, Constraint, parse_guided, parse_structured_outputs
from loraplex.exceptions import InvalidRequest

if TYPE_CHECKING:
    from loraplex.tenancy.tenants import Tenant


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the model's max length
    ABORT = "abort"  # cancelled by the client
    TIMEOUT = "timeout"  # the request's timeout elapsed


class SeqStatus(enum.Enum):
    WAITING = 0  # in the waiting queue (new, or preempted in recompute mode)
    RUNNING = 1
    FINISHED = 2
    SWAPPED = 3  # preempted in swap mode: its KV sits in host memory
    FORK_PENDING = 4  # sample 1..n-1 of a request, forked from sample 0 when its prefill ends


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
GREEDY_EPSILON = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature samples greedily
MAX_STOP_STRINGS = 64  # per request (each checked at every step)
MAX_STOP_STRING_CHARS = 256  # a stop string's prefix is held back while streaming
MAX_STOP_TOKEN_IDS = 1024


def show(value: Any, limit: int = 60) -> str:
    """A short repr of client input for error messages (never the whole of a huge value)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError


def _as_int(value: Any) -> int:
    """An int64 (floats only when integral, strings as decimal integers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    if isinstance(value, float) and not value.is_integer():
        raise ValueError
    if isinstance(value, str) and len(value) > 25:
        raise ValueError  # longer than any int64: never run int() on huge digit strings
    number = int(value)
    if not INT64_MIN <= number <= INT64_MAX:
        raise ValueError
    return number


def _as_float(value: Any) -> float:
    """A finite float (NaN and infinities, also as strings or from overflow, are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    if isinstance(value, str) and len(value) > 64:
        raise ValueError
    number = float(value)
    if not math.isfinite(number):
        raise ValueError
    return number


def _as_str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return [value]
        value = parsed if isinstance(parsed, list) else [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError
    return list(value)


def _as_int_list(value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError from None
    if not isinstance(value, list):
        raise ValueError
    return [_as_int(v) for v in value]


def _as_optional_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise ValueError


_TYPE_NAMES = {
    _as_bool: "boolean", _as_int: "integer in the signed 64-bit range", _as_float: "finite number",
    _as_str_list: "string or list of strings", _as_int_list: "list of integers in the signed 64-bit range",
    _as_optional_str: "string",
}

# Penalties are accepted only at their neutral value (OpenAI frontends send them).
_NEUTRAL_ONLY = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(slots=True)
class SamplingParams:
    """vLLM-compatible sampling parameters (the `sampling_parameters` JSON)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 0
    lora_name: str | None = None
    timeout: float | None = None
    skip_special_tokens: bool = True
    structured_outputs: Constraint | None = None  # from structured_outputs or a guided_* key (engine/constraints.py)

    _PARSERS = {
        "max_tokens": _as_int, "min_tokens": _as_int, "temperature": _as_float, "top_p": _as_float,
        "top_k": _as_int, "seed": _as_int, "stop": _as_str_list, "stop_token_ids": _as_int_list,
        "n": _as_int, "ignore_eos": _as_bool, "logprobs": _as_int, "priority": _as_int,
        "lora_name": _as_optional_str, "timeout": _as_float, "skip_special_tokens": _as_bool,
        "structured_outputs": parse_structured_outputs,
        **{key: functools.partial(parse_guided, key) for key in GUIDED_KEYS},
    }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Parse and validate; raises InvalidRequest naming the offending key."""
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key in _NEUTRAL_ONLY:
                try:
                    neutral = _as_float(raw) == _NEUTRAL_ONLY[key]
                except (TypeError, ValueError):
                    neutral = False
                if raw is not None and not neutral:
                    raise InvalidRequest(f"sampling parameter '{key}' is not supported (only {_NEUTRAL_ONLY[key]})")
                continue
            parser = cls._PARSERS.get(key)
            if parser is None:
                known = sorted(SAMPLING_KEYS)
                raise InvalidRequest(f"unknown sampling parameter {show(key)}; known: {', '.join(known)}")
            if raw is None and key in ("seed", "logprobs", "lora_name", "timeout"):
                continue
            if key in GUIDED_KEYS or key == "structured_outputs":
                constraint = parser(raw)  # raises InvalidRequest naming what is wrong
                if constraint is not None and kwargs.get("structured_outputs") is not None:
                    raise InvalidRequest(f"'{key}' and another structured output key were both given; give one")
                if constraint is not None:
                    kwargs["structured_outputs"] = constraint
                continue
            try:
                kwargs[key] = parser(raw)
            except (TypeError, ValueError, OverflowError):
                raise InvalidRequest(
                    f"sampling parameter '{key}' has value {show(raw)}, which is not a valid {_TYPE_NAMES[parser]}"
                ) from None
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        """Range checks that need no engine; raises InvalidRequest (the engine checks n, logprobs, ids)."""
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (self.timeout is None or self.timeout > 0, f"timeout must be > 0 seconds, got {self.timeout}"),
            (all(self.stop), "stop strings must be non-empty"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"),
            (all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (self.structured_outputs is None or not (self.min_tokens or self.ignore_eos),
             "min_tokens and ignore_eos cannot be combined with structured outputs: the grammar decides where "
             "EOS may come"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (a temperature below vLLM's epsilon counts as 0)."""
        return self.temperature < GREEDY_EPSILON or self.top_k == 1


SAMPLING_KEYS = frozenset(SamplingParams._PARSERS) | frozenset(_NEUTRAL_ONLY)  # every accepted key


@dataclass(slots=True)
class Request:
    """One client request: a prompt, its parameters, its tenant and adapter."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    arrival_time: float = field(default_factory=time.monotonic)
    adapter_digest: str | None = None  # set at admission; part of the prefix-cache namespace
    limits: "Tenant | None" = None  # the tenant's weight and quotas (None: weight 1, no quotas)
    adapter_key: str | None = None  # the AdapterManager name lora_name resolved to (tenant's upload or shared)
    adapter_path: str | None = None  # folder of the uploaded version it resolved to (None: a shared adapter)
    metric_label: str = "default"  # the tenant as metrics show it (bounded cardinality)
    queued: bool = False  # counted in its tenant's max_queued_requests (accepted, not yet started)
    borrowed: bool = False  # queued in the shared part of the waiting queue, not its tenant's own (queue_share)
    reserved_tokens: int = 0  # of its tokens_per_minute reservation, the generated tokens not yet served
    holds_version: bool = False  # counted as a user of its uploaded adapter version (AdapterVersions)
    preloaded: Any = None  # its adapter read off the loop thread (AdapterPreloader), until admission adopts it
    scheduled_time: float | None = None  # first admitted (metrics: queue time; None: never started)
    first_token_time: float | None = None  # its first generated token (metrics: time to first token)
    last_token_time: float = 0.0  # the latest step that generated a token for it
    token_steps: int = 0  # steps that generated tokens for it (metrics: time per output token)
    wants_logprobs: bool = True  # its sampled tokens' logprobs are used (cumulative_logprob, logprobs)
    grammar: Any = None  # xgrammar's CompiledGrammar of params.structured_outputs (compiled by make_request)
    final_reason: str | None = None  # the finish reason its final output carried (set by the output processor)
    count_pending: bool = False  # its end is counted once the output processor has made its final output

    @property
    def output_ended(self) -> bool:
        """Its final output (or error) was made: anything later is dropped."""
        return self.final_reason is not None


@dataclass(slots=True, eq=False)
class Sequence:
    """One generated sample of a request: what the scheduler schedules."""

    seq_id: int
    request: Request
    index: int  # sample index within the request (n > 1)
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    adapter_slot: int = -1
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    generator: Any = None  # torch.Generator of a seeded sample
    matcher: Any = None  # xgrammar GrammarMatcher of a constrained sample: the runner masks its logits and advances it
    namespace: bytes = b""  # prefix-cache namespace (tenant, adapter digest)
    pending_logprobs: list = field(default_factory=list)  # top candidates not yet handed to the output processor
    forks: list = field(default_factory=list)  # FORK_PENDING siblings forked from this seq after its prefill
    fork_parent: Any = None  # the seq a FORK_PENDING seq will be forked from
    host_blocks: list[int] = field(default_factory=list)  # swap-space blocks while SWAPPED
    adapter_skips: int = 0  # steps skipped at admission for want of an adapter slot
    first_scheduled_time: float | None = None  # when it first ran (None: never started)
    error: Exception | None = None  # why the scheduler failed it (its adapter broke, detokenizing raised): an error output
    suspect: bool = False  # a step it was admitted in raised: it is admitted again only as its step's sole newcomer
    stop_length: int = 0  # length at which it may have finished (max_tokens, the model's), set when queued
    stop_ids: frozenset = frozenset()  # tokens that may finish it (stop token ids, EOS unless ignore_eos)
    charge_key: tuple | None = None  # (tenant, fair-share weight) its tokens are charged to, set when queued

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Generated token ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is not yet in the cache."""
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(slots=True)
class RequestOutput:
    """A delta for one sample of one request, pushed to the response thread."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    num_input_tokens: int = 0
    error: Exception | None = None
