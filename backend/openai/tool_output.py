"""A chat choice's text as OpenAI's tool-call output: ``message.tool_calls`` and ``delta.tool_calls``.

Streamed, content passes as it comes until it may be a call (tools.held_back); the calls themselves are sent
when the choice ends, one ``delta.tool_calls`` entry per call holding its index, id, type, name and the whole
arguments string (OpenAI's SDKs accumulate that as they do OpenAI's pieces). A choice that returned calls ends
with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.openai.tools import OPEN_TAG, Holding, ToolCall, forced_call, parse_tool_calls


@dataclass(slots=True)
class _Streamed:
    """One streamed choice: its text not sent yet (in pieces, joined when some of it is sent) and its holding."""

    unsent: list[str] = field(default_factory=list)
    sent: int = 0
    holding: Holding = field(default_factory=Holding)


@dataclass
class ToolOutput:
    """Tool-call parsing for one request: ``choice`` is "auto" or forced ("required" or a tool's name).

    Streamed, each piece costs time linear in it: what may be sent is updated per piece (tools.Holding), and
    the held text is joined only when part of it goes out or the choice ends.
    """

    choice: str
    names: set[str]
    streams: dict[int, _Streamed] = field(default_factory=dict)

    def parse(self, text: str, emitted: int = 0) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a choice's ``text`` (what was not sent yet) when its first ``emitted`` characters
        already went out as content."""
        if self.choice != "auto":
            call = forced_call(text, self.names)
            return ("", [call]) if call is not None else (text, [])
        if emitted and OPEN_TAG not in text:  # a bare JSON call is the whole text or nothing
            return text, []
        return parse_tool_calls(text, self.names)

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The non-streamed ``message`` and finish reason of a choice that produced ``text``."""
        content, calls = self.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": content or None, "tool_calls": [c.as_openai() for c in calls]},
                "tool_calls")

    def stream(self, index: int, text: str, finish: str | None) -> list[tuple[dict, str | None]]:
        """The chunk deltas (with their finish reasons) for ``text`` just added to choice ``index``."""
        state = self.streams.setdefault(index, _Streamed())
        if text:
            state.unsent.append(text)
        if self.choice == "auto":
            held = state.holding.add(text)
        else:  # a forced call is sent whole when the choice ends
            state.holding.size += len(text)
            held = state.holding.size
        if finish is None:
            ready = state.holding.size - held
            if ready <= state.sent:
                return []
            unsent = "".join(state.unsent)
            out, state.unsent = unsent[:ready - state.sent], [unsent[ready - state.sent:]]
            state.sent = ready
            return [({"content": out}, None)]
        rest = "".join(state.unsent)
        content, calls = self.parse(rest, state.sent)
        if not calls:
            return [({"content": rest} if rest else {}, finish)]
        out = [({"content": content}, None)] if content else []
        out.append(({"tool_calls": [{"index": i, **call.as_openai()} for i, call in enumerate(calls)]},
                    "tool_calls"))
        return out
