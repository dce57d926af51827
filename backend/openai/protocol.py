"""OpenAI request bodies (pydantic) and their translation to lora_llm's ``sampling_parameters``.

Fields the engine cannot honour are refused with a 400 naming them rather than ignored;
fields no one can act on here (``user``, ``store``, ``metadata``, ...) are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.types import FailFast
from pydantic_core import PydanticCustomError

from loraplex.openai.errors import bad_request
from loraplex.openai.limits import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Limits
from loraplex.openai.template_inputs import template_variables
from loraplex.openai.tools import MAX_TOOLS, ToolError, call_schema, check_tools, chosen

GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older spelling
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions (and vLLM's)
DEFAULT_LIMITS = Limits()


class _FailFast(FailFast):
    """pydantic's FailFast (a list's validation stops at its first bad item, so a refusal costs one error, not one
    per item), hashable so that it can sit inside a Union."""

    def __hash__(self) -> int:
        return hash(FailFast)


TokenIds = Annotated[list[int], _FailFast()]
Texts = Annotated[list[str], _FailFast()]
ContentParts = Annotated[list[dict[str, Any]], _FailFast()]


def _bounded_list(value: Any, bound: int, what: str) -> Any:
    """The value unchanged, unless it is a list (or an object) longer than bound (refused, naming what it counts)."""
    if isinstance(value, (list, dict)) and len(value) > bound:
        raise _refused(f"{len(value)} {what}; at most {bound} per request")
    return value


def _limits(info: ValidationInfo) -> Limits:
    """The limits ``model_validate(..., context=limits)`` was given (the defaults otherwise)."""
    return info.context if isinstance(info.context, Limits) else DEFAULT_LIMITS


def _refused(message: str) -> PydanticCustomError:
    return PydanticCustomError("refused", message)


class StreamOptions(BaseModel):
    """``stream_options``: whether the last chunk carries ``usage``."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share, OpenAI's and vLLM's extras."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    ignore_eos: bool | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    repetition_penalty: float | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (checked by the engine)
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, value: Any) -> Any:
        """Stop strings are counted before they are validated."""
        return _bounded_list(value, MAX_STOP_STRINGS, "stop strings")

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _bounded_stop_ids(cls, value: Any) -> Any:
        """Stop token ids are counted before they are validated."""
        return _bounded_list(value, MAX_STOP_TOKEN_IDS, "stop_token_ids")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bounded_logit_bias(cls, value: Any) -> Any:
        """logit_bias entries are counted before they are validated."""
        return _bounded_list(value, MAX_LOGIT_BIAS, "logit_bias entries")

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """400 for a field set to something the engine cannot do."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by this server (only 0)", name)
        if self.repetition_penalty not in (None, 1, 1.0):
            raise bad_request("repetition_penalty is not supported by this server (only 1)", "repetition_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def common_params(self, max_tokens: int | None) -> dict[str, Any]:
        """The lora_llm sampling keys these fields set (absent ones are left to the engine's defaults)."""
        params: dict[str, Any] = {}
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "seed", "ignore_eos", "top_k", "min_tokens", "stop_token_ids",
                     "skip_special_tokens", "priority"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if self.n != 1:
            params["n"] = self.n
        if self.stop:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        params.update(self.constraint_params())
        return params

    def constraint_params(self) -> dict[str, Any]:
        """The structured-output keys for lora_llm: response_format as ``structured_outputs``, vLLM's own keys as
        they are (the engine refuses two of them, and names what is wrong in a schema, regex or grammar)."""
        params = {key: getattr(self, key) for key in ("structured_outputs", *GUIDED_KEYS)
                  if getattr(self, key) is not None}
        wanted = response_format_constraint(self.response_format)
        if wanted is not None:
            if params:
                raise bad_request(f"response_format and {next(iter(params))} were both given; give one",
                                  "response_format")
            params["structured_outputs"] = wanted
        return params


def response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as vLLM's ``structured_outputs`` (None for text)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(f"response_format type {str(kind)[:40]!r} is not supported (text, json_object, "
                          "json_schema)", "response_format")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return {"json": schema}  # strict or not, the output fits the schema (the grammar enforces it)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Union[str, Texts, TokenIds, Annotated[list[TokenIds], _FailFast()]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompts(cls, value: Any, info: ValidationInfo) -> Any:
        """A list of prompts is counted before its items are validated."""
        return _bounded_list(value, _limits(info).max_choices, "prompts")

    def prompts(self) -> list[str]:
        """The text prompts (a batch is a list of strings); token-id prompts are refused."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, str) for p in self.prompt):
            return list(self.prompt)
        if not self.prompt:
            raise bad_request("prompt is empty", "prompt")
        raise bad_request("token-id prompts are not supported: lora_llm takes text; send the prompt as a string",
                          "prompt")

    def sampling_parameters(self) -> dict[str, Any]:
        """lora_llm's sampling_parameters for each prompt of this request."""
        self.check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise bad_request("best_of is not supported by this server (only best_of = n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        params = self.common_params(max_tokens)
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, ContentParts, None] = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"only text content parts are supported, got type {part.get('type')!r}",
                                      "messages")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatInputs(BaseModel):
    """What a chat is rendered from (chat completions, /tokenize): messages, tools and the template's
    allow-listed variables, each list counted before its items are validated."""

    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    # vLLM's extras for the template (a request-supplied template is refused: template_inputs.py)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value: Any, info: ValidationInfo) -> Any:
        """The messages are counted before each is validated."""
        return _bounded_list(value, _limits(info).max_messages, "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _bounded_tools(cls, value: Any) -> Any:
        """The tools are counted before each is validated."""
        return _bounded_list(value, MAX_TOOLS, "tools")

    @field_validator("chat_template_kwargs", mode="after")
    @classmethod
    def _allowed_variables(cls, value: dict[str, Any] | None) -> dict[str, Any]:
        """Only the allow-listed template variables, with scalar values."""
        try:
            return template_variables(value)
        except ValueError as exc:
            raise _refused(str(exc)) from None


class ChatCompletionRequest(ChatInputs, SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # auto may return several calls; required and a named one return one
    functions: list[Any] | None = None
    chat_template: Any = None

    @field_validator("chat_template", mode="before")
    @classmethod
    def _no_template(cls, value: Any) -> None:
        """A request never supplies a chat template."""
        if value is not None:
            raise _refused("a request cannot supply a chat template; the server renders chats with the served "
                           "model's own template")
        return None

    def sampling_parameters(self, default_max_tokens: int | None) -> dict[str, Any]:
        """lora_llm's sampling_parameters; ``default_max_tokens`` applies when neither max field is given."""
        self.check_supported()
        if self.functions:
            raise bad_request("functions (the deprecated form) is not supported; use tools", "functions")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        given = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.common_params(default_max_tokens if given is None else given)
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        tools, choice = self.tool_plan()
        if choice not in ("none", "auto"):
            if "structured_outputs" in params or any(k in params for k in GUIDED_KEYS):
                raise bad_request("tool_choice that forces a call cannot be combined with response_format or "
                                  "structured outputs", "tool_choice")
            params["structured_outputs"] = {"json": call_schema(tools, choice), "disable_any_whitespace": True}
        return params

    def tool_plan(self) -> tuple[list[dict], str]:
        """(the checked tools, the choice: "none", "auto", "required" or a tool's name); 400 naming what is wrong."""
        try:
            tools = check_tools(self.tools) if self.tools else []
            return tools, chosen(self.tool_choice, tools)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None


# ---- lora_llm's logprobs (per token: {token_id: {logprob, rank, decoded_token}}, chosen first) -------------

def _ranked(entry: dict, top: int) -> tuple[dict, list[dict]]:
    """(the chosen token's record, the top ``top`` candidates by rank)."""
    records = list(entry.values())
    candidates = sorted((r for r in records if r["rank"] <= top), key=lambda r: r["rank"])
    return records[0], candidates[:top]


def completion_logprobs(entries: list[dict], top: int, offset: int = 0) -> dict[str, list]:
    """OpenAI's completions ``logprobs`` object for these tokens; ``offset`` is where their text starts."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        chosen, candidates = _ranked(entry, top)
        out["tokens"].append(chosen["decoded_token"])
        out["token_logprobs"].append(chosen["logprob"])
        by_text: dict[str, float] = {}
        for c in candidates:  # keyed by text: two byte tokens may both read '\ufffd'; the likelier one stays
            by_text.setdefault(c["decoded_token"], c["logprob"])
        out["top_logprobs"].append(by_text if top else None)
        out["text_offset"].append(offset)
        offset += len(chosen["decoded_token"])
    return out


def chat_logprobs(entries: list[dict], top: int) -> list[dict]:
    """OpenAI's chat ``logprobs.content`` list for these tokens."""
    def item(record: dict) -> dict:
        token = record["decoded_token"]
        return {"token": token, "logprob": record["logprob"], "bytes": list(token.encode("utf-8"))}

    content = []
    for entry in entries:
        chosen, candidates = _ranked(entry, top)
        content.append({**item(chosen), "top_logprobs": [item(c) for c in candidates]})
    return content


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


