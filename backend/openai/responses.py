"""OpenAI response bodies and stream chunks, built from lora_llm deltas.

Choice ``index`` is ``prompt * n + sample``, as OpenAI numbers a batch of prompts with ``n`` each.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from loraplex.openai.protocol import chat_logprobs, completion_logprobs, usage
from loraplex.openai.tool_output import ToolOutput
from loraplex.openai.triton_stream import Delta


@dataclass(slots=True)
class ChoiceDelta:
    """What one lora_llm response added to one choice."""

    index: int
    text: str
    logprobs: list[dict]
    finish_reason: str | None


@dataclass
class Tally:
    """Per choice: text (kept in pieces: joining once is linear), logprobs and finish reason so far; per prompt:
    token counts."""

    num_prompts: int
    n: int
    pieces: list[list[str]] = field(default_factory=list)
    logprobs: list[list[dict]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)

    def __post_init__(self):
        k = self.num_prompts * self.n
        self.pieces, self.logprobs, self.finish = [[] for _ in range(k)], [[] for _ in range(k)], [None] * k
        self.prompt_tokens, self.completion_tokens = [0] * self.num_prompts, [0] * k

    def add(self, prompt: int, delta: Delta) -> list[ChoiceDelta]:
        """Absorb one delta of ``prompt``'s stream; what changed, per choice."""
        self.prompt_tokens[prompt] = max(self.prompt_tokens[prompt], delta.num_input_tokens)
        changed = []
        for j, text in enumerate(delta.texts):
            k = prompt * self.n + j
            self.completion_tokens[k] += delta.num_output_tokens[j] if j < len(delta.num_output_tokens) else 0
            entries = delta.logprobs[j] if j < len(delta.logprobs) else []
            reason = delta.finish_reasons[j] if j < len(delta.finish_reasons) else None
            new_finish = reason if reason is not None and self.finish[k] is None else None
            if not text and not entries and new_finish is None:
                continue
            if text:
                self.pieces[k].append(text)
            self.logprobs[k] += entries
            if new_finish is not None:
                self.finish[k] = new_finish
            changed.append(ChoiceDelta(k, text, entries, new_finish))
        return changed

    @property
    def texts(self) -> list[str]:
        """Each choice's whole text so far."""
        return ["".join(p) for p in self.pieces]

    def usage(self) -> dict[str, int]:
        """OpenAI's usage for the whole request."""
        return usage(sum(self.prompt_tokens), sum(self.completion_tokens))


def new_id(prefix: str) -> str:
    """A response id such as ``cmpl-...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class Envelope:
    """The fields every body and chunk of one response repeats."""

    id: str
    model: str
    object: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, choices: list[dict], **extra) -> dict:
        """A body or chunk with these choices."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


# ---- /v1/completions -------------------------------------------------------------------------------------

def completion_choice(index: int, text: str, entries: list[dict], top: int | None, finish: str | None,
                      offset: int = 0) -> dict:
    """One completions choice (a whole one, or a chunk's)."""
    logprobs = completion_logprobs(entries, top, offset) if top is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_body(env: Envelope, tally: Tally, top: int | None, echo_prompts: list[str] | None) -> dict:
    """The non-streamed /v1/completions body."""
    choices = []
    for k, text in enumerate(tally.texts):
        prefix = echo_prompts[k // tally.n] if echo_prompts else ""
        choices.append(completion_choice(k, prefix + text, tally.logprobs[k], top, tally.finish[k]))
    return env.wrap(choices, usage=tally.usage())


class CompletionOffsets:
    """Where each choice's next token text starts (``text_offset`` of streamed logprobs)."""

    def __init__(self, count: int):
        self.offsets = [0] * count

    def take(self, k: int, entries: list[dict]) -> int:
        """The offset for these tokens of choice ``k``, then advance past them."""
        start = self.offsets[k]
        self.offsets[k] += sum(len(next(iter(e.values()))["decoded_token"]) for e in entries)
        return start


# ---- /v1/chat/completions --------------------------------------------------------------------------------

def chat_logprobs_object(entries: list[dict], top: int | None) -> dict | None:
    """``{"content": [...]}`` when logprobs were asked for."""
    return {"content": chat_logprobs(entries, top)} if top is not None else None


def chat_body(env: Envelope, tally: Tally, top: int | None, tools: ToolOutput | None = None) -> dict:
    """The non-streamed /v1/chat/completions body (tool calls parsed out of each choice when ``tools``)."""
    choices = []
    for k, text in enumerate(tally.texts):
        message, finish = (tools.message(text, tally.finish[k]) if tools is not None
                           else ({"role": "assistant", "content": text}, tally.finish[k]))
        choices.append({"index": k, "message": message, "logprobs": chat_logprobs_object(tally.logprobs[k], top),
                        "finish_reason": finish})
    return env.wrap(choices, usage=tally.usage())


def chat_chunk_choice(change: ChoiceDelta, top: int | None) -> dict:
    """One streamed chat choice."""
    delta = {"content": change.text} if change.text else {}
    logprobs = chat_logprobs_object(change.logprobs, top) if change.logprobs else None
    return {"index": change.index, "delta": delta, "logprobs": logprobs, "finish_reason": change.finish_reason}


def tool_chunk_choices(change: ChoiceDelta, top: int | None, tools: ToolOutput) -> list[dict]:
    """The streamed chat choices for one change when tool calls are parsed (tool_output.py)."""
    logprobs = chat_logprobs_object(change.logprobs, top) if change.logprobs else None
    parts = tools.stream(change.index, change.text, change.finish_reason) or ([({}, None)] if logprobs else [])
    return [{"index": change.index, "delta": delta, "logprobs": logprobs if i == 0 else None, "finish_reason": finish}
            for i, (delta, finish) in enumerate(parts)]


def role_chunk_choice(index: int) -> dict:
    """The first streamed chat choice: the assistant's role."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
