"""Chat messages -> one prompt string, with the checkpoint's own chat template.

lora_llm tokenizes ``text_input`` itself, with the tokenizer's special tokens (a LLaMA
tokenizer prepends BOS). A template that writes BOS as text would then give two BOS tokens
(vLLM avoids it by tokenizing chat prompts without special tokens), so a leading BOS the
tokenizer would add again is dropped from the rendered text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import bad_request


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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages``; 400 when there is no template or it refuses the messages."""
        if not self.has_template:
            raise bad_request(f"the model at {self.model_dir} has no chat template (tokenizer_config.json "
                              "chat_template); use /v1/completions with a plain prompt", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **(template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError (raise_exception), a bad message shape
            raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
        return self.without_extra_bos(text)

    def without_extra_bos(self, text: str) -> str:
        """``text`` less a leading BOS that lora_llm's tokenizer would add a second time."""
        bos = self.tokenizer.bos_token
        if self._bos_added_twice and text.startswith(bos):
            return text[len(bos):]
        return text
