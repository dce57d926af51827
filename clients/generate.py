"""Generate text from `lora_llm` over gRPC streaming with tritonclient (library + CLI).

    python -m loraplex.clients.generate --url localhost:8001 --lora demo-a "Hello"
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .identity import add_identity_arguments, identity_headers

RETURN_FLAGS = (
    "return_finish_reason", "return_cumulative_logprob", "return_logprobs",
    "return_num_input_tokens", "return_num_output_tokens",
)


@dataclass
class StreamResult:
    """Everything one request streamed back: per-response outputs, and the error if any."""

    responses: list[dict] = field(default_factory=list)
    error: Exception | None = None
    final_count: int = 0

    @property
    def text(self) -> str:
        """Concatenated text deltas of sample 0."""
        return "".join(r["text_output"][0] for r in self.responses if "text_output" in r)


def build_inputs(grpcclient, prompt: str, params: dict, stream: bool = True, **flags) -> list:
    """The vllm_backend-style input tensors for one request."""
    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
        return t

    inputs = [tensor("text_input", prompt.encode("utf-8"), "BYTES"), tensor("stream", stream, "BOOL")]
    if params is not None:
        inputs.append(tensor("sampling_parameters", json.dumps(params).encode(), "BYTES"))
    for name, value in flags.items():
        inputs.append(tensor(name, bool(value), "BOOL"))
    return inputs


def decode_response(result) -> dict:
    """Outputs of one streamed response as Python values (text decoded)."""
    out = {}
    for output in result.get_response().outputs:
        value = result.as_numpy(output.name)
        if value.dtype == np.object_:
            value = [v.decode("utf-8") if isinstance(v, bytes) else v for v in value.tolist()]
        else:
            value = value.tolist()
        out[output.name] = value
    return out


def stream_generate(url: str, prompt: str, params: dict | None = None, headers: dict | None = None,
                    model: str = "lora_llm", timeout: float = 120.0,
                    on_response: Callable[[dict], None] | None = None, **flags) -> StreamResult:
    """Send one streaming request and collect responses until the final one (or an error).

    `on_response`, if given, is called with each response that carries outputs, as it arrives.
    """
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    try:
        client.async_stream_infer(model, build_inputs(grpcclient, prompt, params, True, **flags),
                                  request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        collected = StreamResult()
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                collected.error = error
                return collected
            response = result.get_response()
            if response.outputs:
                collected.responses.append(decode_response(result))
                if on_response is not None:
                    on_response(collected.responses[-1])
            if response.parameters["triton_final_response"].bool_param:
                collected.final_count += 1
                return collected
    finally:
        client.stop_stream()
        client.close()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(prog="python -m loraplex.clients.generate", description=__doc__.split("\n")[0])
    ap.add_argument("prompt", help="text to complete")
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default localhost:8001)")
    ap.add_argument("--lora", default=None, help="adapter name (default: the base model)")
    add_identity_arguments(ap)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    args = ap.parse_args(argv)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.lora:
        params["lora_name"] = args.lora
    headers = identity_headers(args.api_key, args.tenant)
    result = stream_generate(args.url, args.prompt, params, headers, return_finish_reason=True)
    for r in result.responses:
        sys.stdout.write(r["text_output"][0])
        sys.stdout.flush()
    if result.error is not None:
        print(f"\nerror: {result.error}", file=sys.stderr)
        return 1
    print(f"\n[finish_reason: {result.responses[-1].get('finish_reason', ['?'])[0] if result.responses else '?'}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
