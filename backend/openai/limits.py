"""What one request may cost the gateway: body bytes, messages, choices, and the prompt-rendering pool.

Every bound is checked before the work it bounds: the body while it is read (a large one parsed
only after the caller's key passed), the message, prompt, stop and logit_bias counts before their
items are validated, the choices before any stream opens, and the
rendering pool before a job is queued (see docs/openai.md, "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.openai.errors import bad_request

MAX_BODY_BYTES = 2 * 1024 * 1024  # TGI's --payload-limit is 2 MB; a 128k-token prompt is ~0.5 MiB of text
MAX_MESSAGES = 1024  # chat messages per request
MAX_CHOICES = 128  # prompts x n of one request: each prompt is a gRPC stream, each choice a sequence
RENDER_THREADS = 4  # threads that render chat templates and count prompt tokens
RENDER_TIMEOUT_S = 5.0  # a render job's bound, queueing included; the demo renders 2 MiB in ~20 ms
MAX_UPLOAD_BYTES = 48 * 1024 * 1024  # an adapter's files (POST /v1/lora_adapters, a lora_path): one gRPC message
MAX_MODELS = 10_000  # adapters /v1/models lists without ?limit= (more: has_more and ?after=)
AUTH_FIRST_BYTES = 64 * 1024  # a JSON body over this is parsed only after the caller's key passed (one Triton call)
MAX_STOP_STRINGS = 64  # lora_llm's bound (loraplex.engine.request), counted here before the items are validated
MAX_STOP_TOKEN_IDS = 1024  # lora_llm's bound (loraplex.engine.request)
MAX_LOGIT_BIAS = 1024  # logit_bias entries counted before they are validated (any is refused: not supported)
RENDER_QUEUE_PER_THREAD = 16  # jobs admitted per thread (running or queued); beyond: 503 at once


@dataclass(slots=True, frozen=True)
class Limits:
    """The gateway's per-request bounds (flags of loraplex-openai)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES
    max_choices: int = MAX_CHOICES
    render_threads: int = RENDER_THREADS
    render_timeout_s: float = RENDER_TIMEOUT_S
    max_upload_bytes: int = MAX_UPLOAD_BYTES

    def check_choices(self, num_prompts: int, n: int) -> None:
        """400 when ``num_prompts * n`` is over ``max_choices`` (naming ``prompt`` or ``n``)."""
        if num_prompts * n > self.max_choices:
            param = "prompt" if num_prompts > self.max_choices else "n"
            raise bad_request(f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} choices; at most "
                              f"{self.max_choices} per request", param)
