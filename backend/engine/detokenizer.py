"""Incremental detokenization that never splits a multi-byte character, and stop strings."""

from __future__ import annotations

import functools
from typing import Callable

try:
    from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
except ImportError:  # pragma: no cover - older tokenizers: the window path serves alone
    DecodeStream = None

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # tokens before the new ones decoded with them, so leading-space rules see context


def _plain_backend(tokenizer):
    """A fast tokenizer's Rust backend when HF's decode adds nothing to it (no space clean-up), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend


def decoder_of(tokenizer, skip_special: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` as one call: the Rust backend's own decode where that is all HF's does.

    HF's wrapper around it costs more than the decode itself (argument conversion, kwargs; decision 017).
    """
    backend = _plain_backend(tokenizer)
    return functools.partial(tokenizer.decode if backend is None else backend.decode, skip_special_tokens=skip_special)


def stream_of(tokenizer, skip_special: bool):
    """(backend, DecodeStream) for a tokenizer whose decode is its backend's, else None.

    The Rust ``DecodeStream`` turns one new token into its text in one call,
    holding back an incomplete UTF-8 sequence, where the window path decodes twice.
    """
    backend = _plain_backend(tokenizer)
    return None if DecodeStream is None or backend is None else (backend, DecodeStream(skip_special_tokens=skip_special))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A fast tokenizer steps a Rust ``DecodeStream``, primed with the prompt's last tokens.
    Otherwise (and for the final flush) it decodes a small window (prefix_offset..end) and
    emits what the newest tokens add to the window's text. Either way text that ends in an
    incomplete UTF-8 sequence is held back until the next token completes it, as vLLM does.
    """

    __slots__ = ("_decode", "_stream", "_fed", "prefix_offset", "read_offset", "text", "stops", "hold", "stopped",
                 "ids")

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], skip_special: bool = True):
        self._decode = decoder_of(tokenizer, skip_special)
        self.prefix_offset = max(len(prompt_ids) - CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_ids)  # tokens before it have given their text
        self._stream = stream_of(tokenizer, skip_special)
        self._fed = len(prompt_ids)  # tokens the stream has seen
        if self._stream is not None and self._decode(prompt_ids[self.prefix_offset:]).endswith(REPLACEMENT):
            self._stream = None  # a prompt cut inside a character: the stream would give its bytes to the output
        if self._stream is not None:
            backend, stream = self._stream
            for token in prompt_ids[self.prefix_offset:]:
                stream.step(backend, token)  # context only: its text is the prompt's
        self.text = ""  # output text so far (stop string excluded once matched)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop
        self.stopped = False  # a stop string matched: the text ends before it
        self.ids = list(prompt_ids)  # prompt + output tokens pushed so far (push / finish)

    def push(self, token: int, match_stops: bool = True) -> str | None:
        """Account for one new output token; returns the matched stop string, if any (only with match_stops)."""
        self.ids.append(token)
        return self.update(self.ids, match_stops=match_stops)

    def finish(self) -> None:
        """flush() over the pushed tokens."""
        self.flush(self.ids)

    def update(self, token_ids: list[int], final: bool = False, match_stops: bool = True) -> str | None:
        """Account for the newest token(s); returns the matched stop string, if any (only with match_stops)."""
        if self._stream is not None and not final:
            return self._step_stream(token_ids, match_stops)
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return None
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._match_stop(start) if match_stops else None

    def _step_stream(self, token_ids: list[int], match_stops: bool) -> str | None:
        backend, stream = self._stream
        pieces, done = [], self.read_offset
        for i in range(self._fed, len(token_ids)):
            piece = stream.step(backend, token_ids[i])
            if piece:
                pieces.append(piece)
                done = i + 1
        self._fed = len(token_ids)
        if not pieces:
            return None
        start = len(self.text)
        self.text += "".join(pieces)
        self.prefix_offset, self.read_offset = self.read_offset, done  # the window flush() decodes from
        return self._match_stop(start) if match_stops else None

    def _match_stop(self, start: int) -> str | None:
        for stop in self.stops:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                return stop
        return None

    def flush(self, token_ids: list[int]) -> None:
        """At the end: emit whatever is held back, even an incomplete character."""
        if self.read_offset < len(token_ids) and not self.stopped:
            self.update(token_ids, final=True)

    def stable_length(self, finished: bool) -> int:
        """How much of the text may be sent now (a possible stop-string prefix is held back)."""
        return len(self.text) if finished else max(len(self.text) - self.hold, 0)
