"""Incremental detokenization that never splits a multi-byte character, and stop strings."""

from __future__ import annotations

import functools
from typing import Callable

REPLACEMENT = "\ufffd"


def decoder_of(tokenizer, skip_special: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` as one call: the Rust backend's own decode where that is all HF's does.

    A fast tokenizer without space clean-up decodes exactly as its backend; HF's wrapper around
    it costs about 4x the decode itself (argument conversion, kwargs), twice per sequence per step.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(tokenizer.decode, skip_special_tokens=skip_special)
    return functools.partial(backend.decode, skip_special_tokens=skip_special)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (prefix_offset..end) and emits what the newest tokens add to the
    window's text, holding back text that ends in an incomplete UTF-8 sequence (decoded as
    U+FFFD) until the next token completes it, as vLLM does.
    """

    __slots__ = ("_decode", "prefix_offset", "read_offset", "text", "stops", "hold", "stopped")

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], skip_special: bool = True):
        self._decode = decoder_of(tokenizer, skip_special)
        # Start the window a few prompt tokens back so leading-space rules see context.
        self.prefix_offset = max(len(prompt_ids) - 5, 0)
        self.read_offset = len(prompt_ids)
        self.text = ""  # output text so far (stop string excluded once matched)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop
        self.stopped = False  # a stop string matched: the text ends before it

    def update(self, token_ids: list[int], final: bool = False) -> str | None:
        """Account for the newest token(s); returns the matched stop string, if any."""
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return None
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._match_stop(start)

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
