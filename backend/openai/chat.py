"""Chat messages -> one prompt string, with the checkpoint's own chat template.

lora_llm tokenizes ``text_input`` itself, with the tokenizer's special tokens (a LLaMA
tokenizer prepends BOS). A template that writes BOS as text would then give two BOS tokens
(vLLM avoids it by tokenizing chat prompts without special tokens), so a leading BOS the
tokenizer would add again is dropped from the rendered text.

Everything here runs on a pool thread (offload.py), never on the event loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from loraplex.openai.errors import bad_request, client_text
from loraplex.openai.tools import template_messages

log = logging.getLogger("loraplex.openai")
COUNT_CHARS_PER_TOKEN = 32  # a prompt's first context x 32 characters are counted; more only if they hold fewer tokens


class ChatRenderer:
    """The tokenizer of the served checkpoint, used only to render chat prompts."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        bos = self.tokenizer.bos_token
        ids = self.tokenizer(bos).input_ids if bos else []
        self._bos_added_twice = bool(bos) and ids == [self.tokenizer.bos_token_id] * 2

    @property
    def has_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def reads_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` variable (else tools go in a fallback system prompt)."""
        return "tools" in str(getattr(self.tokenizer, "chat_template", None) or "")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``, tools.py); 400 when there is no template or it refuses
        the messages."""
        from jinja2 import TemplateError

        if not self.has_template:
            raise bad_request("the served model has no chat template; use /v1/completions with a plain prompt",
                              "messages")
        variables = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
        reads_tools = self.reads_tools
        messages = template_messages(messages, tools, reads_tools)
        if tools and reads_tools:
            variables["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **variables)
        except TemplateError as exc:  # the template's raise_exception, or a message shape it cannot read
            raise bad_request(f"the chat template refused the messages: {client_text(str(exc)[:500]) or ''}",
                              "messages") from None
        except Exception as exc:  # noqa: BLE001 - a shape the template's Python side cannot take
            log.warning("the chat template failed on a request's messages: %r", exc)
            raise bad_request("the chat template could not render these messages", "messages") from None
        return self.without_extra_bos(text)

    def count_tokens(self, text: str, limit: int) -> int:
        """Tokens of ``text`` as lora_llm counts them: exact below ``limit``, at least ``limit`` otherwise."""
        head = text[:limit * COUNT_CHARS_PER_TOKEN]
        used = len(self.tokenizer(head).input_ids)
        if used >= limit or len(head) == len(text):
            return used
        return len(self.tokenizer(text).input_ids)  # over 32 characters a token: rare, and bounded by the body

    def prompt(self, messages: Sequence[Any], add_generation_prompt: bool, template_kwargs: dict[str, Any],
               context: int | None, tools: list[dict] | None = None) -> tuple[str, int | None]:
        """One chat request's work: its messages' prompt text, and its tokens up to ``context`` (None: not counted)."""
        text = self.render([m.as_template_input() for m in messages], add_generation_prompt, template_kwargs, tools)
        return text, (self.count_tokens(text, context) if context else None)

    def without_extra_bos(self, text: str) -> str:
        """``text`` less a leading BOS that lora_llm's tokenizer would add a second time."""
        bos = self.tokenizer.bos_token
        if self._bos_added_twice and text.startswith(bos):
            return text[len(bos):]
        return text
