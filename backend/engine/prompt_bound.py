"""The byte bound on a prompt, checked before it is tokenized (max_prompt_bytes).

A prompt that fits the model has at most ``max_model_len`` tokens, and each token stands for
at most the tokenizer's longest token in UTF-8 bytes, so a prompt longer than
``max_model_len × longest_token_bytes`` bytes can never fit: it is refused without the cost of
tokenizing it, and no prompt that could fit is refused. ``max_prompt_bytes`` > 0 sets the
bound instead. (Byte-level BPE tokenizers, such as SmolLM2's and the demo model's, cover
every byte of the text exactly once, which is what makes the bound exact.)
"""

from __future__ import annotations

from loraplex.exceptions import InvalidRequest


def longest_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the tokenizer's longest token as text (special tokens included)."""
    return max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(len(tokenizer)))


def check_prompt_bytes(prompt: str, max_bytes: int) -> None:
    """Raise InvalidRequest if the prompt is over max_bytes in UTF-8 (cheap: no encoding while it cannot be)."""
    if len(prompt) * 4 <= max_bytes:  # a character is at most 4 bytes
        return
    size = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidRequest(f"text_input is {size} bytes; at most {max_bytes} are accepted (max_prompt_bytes)")
