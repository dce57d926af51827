"""Turn a Triton request's tensors and parameters into a prompt, sampling params and flags.

Follows Triton's vllm_backend interface so its clients work unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from loraplex.engine.request import SAMPLING_KEYS, SamplingParams
from loraplex.exceptions import InvalidRequest

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


@dataclass(slots=True)
class GenerateInput:
    """Everything execute() needs from one request."""

    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    returns: dict[str, bool]
    tenant: str


# sampling_parameters over this many bytes is refused before it is parsed: room for a 64 KiB constraint written as
# JSON-escaped text (up to 6 bytes a character) and every other field at its own bound.
MAX_SAMPLING_PARAMETERS_BYTES = 512 * 1024
# A request's Triton parameters (forwarded headers, HTTP generate's other keys, gRPC parameters) over this many
# characters are refused before they are parsed, before the key in them is checked: sampling keys may come this way.
MAX_REQUEST_PARAMETERS_CHARS = MAX_SAMPLING_PARAMETERS_BYTES + 64 * 1024

# vllm_backend's exact text (its clients compare it word for word).
STREAM_ECHO_ERROR = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."


def _scalar(array, name: str) -> object:
    value = np.asarray(array).reshape(-1)
    if value.size != 1:
        raise InvalidRequest(f"{name}: expected exactly one element, got {value.size}")
    item = value[0]
    if isinstance(item, bytes):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"{name} is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 text"
            ) from None
    return item.item() if hasattr(item, "item") else item


def _flag(inputs: dict, name: str, default: bool) -> bool:
    if name not in inputs:
        return default
    return bool(_scalar(inputs[name], name))


MAX_LOGGED_ID_CHARS = 128


def loggable_id(client_id: str) -> str:
    """A client-chosen request id as it may appear in the log: at most MAX_LOGGED_ID_CHARS, control characters
    escaped (an id never writes a line of its own into the log the launcher reads)."""
    text = client_id[:MAX_LOGGED_ID_CHARS]
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def request_parameters(raw: str | None) -> dict:
    """A Triton request's parameters (its ``parameters()`` JSON) as a dict, refused unparsed past the bound."""
    if raw and len(raw) > MAX_REQUEST_PARAMETERS_CHARS:
        raise InvalidRequest(f"the request's parameters are over {MAX_REQUEST_PARAMETERS_CHARS} characters")
    return json.loads(raw or "{}")


def _sampling_json(raw) -> dict:
    size = len(raw.encode("utf-8", "surrogatepass")) if isinstance(raw, str) else len(raw or b"")
    if size > MAX_SAMPLING_PARAMETERS_BYTES:
        raise InvalidRequest(f"sampling_parameters is {size} bytes; at most {MAX_SAMPLING_PARAMETERS_BYTES} are accepted")
    try:
        sampling = json.loads(raw) if raw else {}
    except (ValueError, TypeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {reason}") from None
    if not isinstance(sampling, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    return sampling


def parse_generate_input(inputs: dict[str, np.ndarray], parameters: dict, tenant: str = "default") -> GenerateInput:
    """Validate one request of ``tenant`` (resolved by loraplex.tenancy.tenants); raises InvalidRequest for the client."""
    if "text_input" not in inputs:
        raise InvalidRequest("missing required input 'text_input'")
    prompt = _scalar(inputs["text_input"], "text_input")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("text_input is empty")
    stream = _flag(inputs, "stream", False)
    # vllm_backend: echo the prompt unless excluded; a streamed response never echoes.
    exclude_input = _flag(inputs, "exclude_input_in_output", stream)
    if stream and not exclude_input:
        raise InvalidRequest(STREAM_ECHO_ERROR)
    sampling: dict = {}
    if "sampling_parameters" in inputs:
        sampling = _sampling_json(_scalar(inputs["sampling_parameters"], "sampling_parameters"))
    for key, value in parameters.items():
        if key in SAMPLING_KEYS:
            sampling.setdefault(key, value)
    params = SamplingParams.from_dict(sampling)
    returns = {name: _flag(inputs, name, False) for name in RETURN_FLAGS}
    return GenerateInput(prompt, params, stream, exclude_input, returns, tenant)
