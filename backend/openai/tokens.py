"""vLLM's ``/tokenize`` and ``/detokenize``: the served tokenizer, as lora_llm would see the request.

``/tokenize`` takes ``{"model", "prompt"}`` (``add_special_tokens``, default true, as lora_llm tokenizes
``text_input``) or ``{"model", "messages"}`` (rendered as /v1/chat/completions renders them, then tokenized as
lora_llm tokenizes that prompt) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``/detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}``. The work runs on the render pool.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from loraplex.openai.chat import ChatRenderer
from loraplex.openai.errors import bad_request
from loraplex.openai.protocol import ChatInputs, TokenIds
from loraplex.openai.tools import ToolError, check_tools


class TokenizeRequest(ChatInputs):
    """``POST /tokenize``: a prompt, or chat messages (and their tools)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def checked_tools(self) -> list[dict] | None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        try:
            return check_tools(self.tools) if self.tools else None
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: TokenIds = Field(min_length=0)


def tokenize(renderer: ChatRenderer, body: TokenizeRequest, tools: list[dict] | None) -> tuple[list[int], list[str]]:
    """(token ids, their strings when asked for) of the request's prompt or messages (on a pool thread)."""
    if body.messages is not None:
        text, _ = renderer.prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs, None, tools)
        ids = renderer.tokenizer(text).input_ids
    else:
        ids = renderer.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
    return ids, (renderer.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else [])


def detokenize(renderer: ChatRenderer, tokens: list[int]) -> str:
    """The text of ``tokens``; 400 for an id outside the vocabulary."""
    size = len(renderer.tokenizer)
    bad = next((t for t in tokens if not 0 <= t < size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{size - 1})", "tokens")
    return renderer.tokenizer.decode(tokens)
