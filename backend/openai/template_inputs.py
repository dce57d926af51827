"""What a chat request may pass to the served model's chat template: a few named switches, never a template.

A request never supplies a template (``chat_template``, anywhere, is refused) nor any other
``apply_chat_template`` argument (``tokenize``, ``tools``, ``documents``, ...): only the template
variables below (the request's checked ``tools`` field reaches the template through tools.py), each a bool or one of a few short strings. docs/decisions/010-gateway-template-inputs.md
says why.
"""

from __future__ import annotations

from typing import Any

# name -> the values it may take: bool, or the allowed strings
TEMPLATE_VARIABLES: dict[str, type | tuple[str, ...]] = {
    "add_generation_prompt": bool,  # the same as the request field (vLLM lets the kwargs win)
    "enable_thinking": bool,  # Qwen3, SmolLM3, Granite 3.x
    "thinking": bool,  # DeepSeek-V3.1
    "reasoning_effort": ("low", "medium", "high"),  # gpt-oss
}


def template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` checked against the allow-list; raises ValueError naming what is refused."""
    if not kwargs:
        return {}
    allowed = ", ".join(sorted(TEMPLATE_VARIABLES))
    for name, value in kwargs.items():
        kind = TEMPLATE_VARIABLES.get(name)
        if kind is None:
            raise ValueError(f"{name[:64]!r} is not an allowed template variable (allowed: {allowed}); "
                             "the server renders chats with the served model's own template")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false")
        if isinstance(kind, tuple) and value not in kind:
            raise ValueError(f"{name} must be one of {', '.join(kind)}")
    return dict(kwargs)
