"""lora_llm over gRPC streaming with ``grpc.aio``: one bidirectional stream per request, one channel per process.

The request is built from tritonclient's protobuf messages (``service_pb2``) rather than its
``aio`` client, because that client cannot ask for Triton's empty final response
(``triton_enable_empty_final_response``), which is how a stream tells that its request is done.
Leaving the stream before the final response (a client that went away) cancels the gRPC call,
and Triton cancels the request: the engine frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc

from loraplex.clients.generate import decode_response

from loraplex.openai.errors import AUTH_TEXT, OpenAIError, bad_request, client_text, from_rpc, from_triton, unavailable

log = logging.getLogger("loraplex.openai")

MODEL = "lora_llm"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ADAPTERS_MODEL = "lora_adapters"
ADMIN_PARAMETER = "loraplex_admin_key"  # loraplex.triton.adapters_model.ADMIN_PARAMETER
ADMIN_REFUSED = "missing or invalid admin key"  # loraplex.triton.adapters_model.ADMIN_REFUSED
LIST_TIMEOUT_S = 30.0
WRITE_TIMEOUT_S = 120.0  # an upload or load: validation parses the whole adapter


@dataclass(slots=True)
class Delta:
    """One streamed lora_llm response: per-sample text, token counts, finish reasons, logprobs."""

    texts: list[str]
    num_output_tokens: list[int]
    finish_reasons: list[str | None]
    num_input_tokens: int = 0
    logprobs: list[list[dict]] = field(default_factory=list)

    @classmethod
    def from_outputs(cls, out: dict[str, Any]) -> "Delta":
        """From ``decode_response``'s dict of output tensors."""
        texts = out.get("text_output", [])
        n = len(texts)
        reasons = [None if r == "None" else r for r in out.get("finish_reason", ["None"] * n)]
        logprobs = [json.loads(blob) or [] for blob in out.get("logprobs", [])] or [[] for _ in range(n)]
        return cls(texts, list(out.get("num_output_tokens", [0] * n)), reasons,
                   int((out.get("num_input_tokens") or [0])[0]), logprobs)


def _tensor(name: str, value) -> service_pb2.ModelInferRequest.InferInputTensor:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, shape=[1])
    if isinstance(value, bool):
        tensor.datatype = "BOOL"
        tensor.contents.bool_contents.append(value)
    else:
        tensor.datatype = "BYTES"
        tensor.contents.bytes_contents.append(value.encode("utf-8"))
    return tensor


def build_request(prompt: str, params: dict, logprobs: bool, model: str = MODEL,
                  request_id: str | None = None) -> service_pb2.ModelInferRequest:
    """A streaming vllm_backend-style request: deltas, no echo, finish reasons and token counts."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id or uuid.uuid4().hex)
    request.inputs.extend([
        _tensor("text_input", prompt), _tensor("stream", True), _tensor("exclude_input_in_output", True),
        _tensor("sampling_parameters", json.dumps(params)), _tensor("return_finish_reason", True),
        _tensor("return_num_input_tokens", True), _tensor("return_num_output_tokens", True),
        _tensor("return_logprobs", logprobs),
    ])
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def adapters_request(action: str, inputs: dict[str, str | bytes] | None = None, admin_key: str | None = None,
                     model: str = ADAPTERS_MODEL) -> service_pb2.ModelInferRequest:
    """One lora_adapters action; ``inputs`` are its other STRING [1] inputs (bytes sent as they are)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=uuid.uuid4().hex)
    request.inputs.append(_tensor("action", action))
    for name, value in (inputs or {}).items():
        tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, shape=[1], datatype="BYTES")
        tensor.contents.bytes_contents.append(value if isinstance(value, bytes) else value.encode("utf-8"))
        request.inputs.append(tensor)
    if admin_key is not None:
        request.parameters[ADMIN_PARAMETER].string_param = admin_key
    request.outputs.add(name="result")
    return request


def list_request(model: str = ADAPTERS_MODEL, cursor: str | None = None, limit: int | None = None,
                 name: str | None = None) -> service_pb2.ModelInferRequest:
    """lora_adapters' ``list`` action: one page of the caller's uploads and the shared names (or one name)."""
    inputs = {k: v for k, v in (("cursor", cursor), ("limit", None if limit is None else str(limit)),
                                ("adapter_name", name)) if v is not None}
    return adapters_request("list", inputs, model=model)


def visible_names(result: dict) -> list[str]:
    """The adapter names a ``list`` result says the caller may use: its uploads and the shared ones, sorted."""
    return sorted({a["name"] for a in result.get("adapters", [])} | set(result.get("shared", [])))


class TritonClient:
    """Talks to one Triton server's lora_llm; safe for any number of concurrent requests."""

    def __init__(self, url: str, model: str = MODEL):
        self.url, self.model = url, model
        self._channel: grpc.aio.Channel | None = None
        self._stub = None

    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        """The stub on this process's channel (created in the running event loop on first use)."""
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.url, options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None

    async def ready(self) -> bool:
        """Whether Triton answers and lora_llm is ready."""
        try:
            reply = await self.stub().ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=5)
            return reply.ready
        except grpc.RpcError:
            return False

    async def generate(self, prompt: str, params: dict, headers: dict[str, str],
                       logprobs: bool = False, request_id: str | None = None) -> AsyncIterator[Delta]:
        """The deltas of one request until its final response; raises OpenAIError on any error.

        Leaving early (the consumer closes or is cancelled) cancels the gRPC call, so Triton
        cancels the request. ``request_id`` is Triton's id of it (the gateway's, one per prompt).
        """
        request = build_request(prompt, params, logprobs, self.model, request_id)
        rid = request.id
        sent = asyncio.Event()

        async def requests():
            yield request
            await sent.wait()  # keep the write side open until the request is over

        call = self.stub().ModelStreamInfer(requests(), metadata=tuple(headers.items()))
        finished = False
        try:
            async for response in call:
                if response.error_message:
                    finished = True
                    raise from_triton(response.error_message, rid)
                outputs = decode_response(InferResult(response.infer_response)) if response.infer_response.outputs else {}
                if outputs:
                    yield Delta.from_outputs(outputs)
                if response.infer_response.parameters["triton_final_response"].bool_param:
                    finished = True
                    return
            finished = True
            raise OpenAIError(503, "Triton closed the stream before the request finished",
                              "service_unavailable_error", None, "service_unavailable")
        except grpc.aio.AioRpcError as exc:
            finished = True
            raise from_rpc(exc, rid) from None
        finally:
            sent.set()
            if not finished:
                call.cancel()

    async def adapters(self, request: service_pb2.ModelInferRequest, headers: dict[str, str],
                       timeout: float = LIST_TIMEOUT_S) -> dict:
        """One lora_adapters call (authenticated as every request is): its ``result`` JSON; OpenAIError if refused."""
        try:
            reply = await self.stub().ModelInfer(request, metadata=tuple(headers.items()), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise adapters_error(exc) from None
        raw = InferResult(reply).as_numpy("result").reshape(-1)[0]
        return json.loads(raw)

    async def visible_adapters(self, headers: dict[str, str], cursor: str | None = None,
                               limit: int | None = None) -> tuple[list[str], str | None]:
        """One page of the adapters the caller may use (lora_adapters' ``list``), and the next page's cursor."""
        result = await self.adapters(list_request(cursor=cursor, limit=limit), headers)
        return visible_names(result), result.get("next")

    async def may_use(self, headers: dict[str, str], name: str) -> bool:
        """Whether the caller may use the adapter ``name`` (one lora_adapters lookup, whatever the store holds)."""
        return name in visible_names(await self.adapters(list_request(name=name), headers))


def adapters_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    """The OpenAI error for a refused lora_adapters call (its messages are the store's own, for the client)."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.NOT_FOUND and "unknown model" in details.lower():
        return unavailable(f"{ADAPTERS_MODEL} is not served by this Triton")
    text = client_text(details) or "the adapter request was refused"
    if code == grpc.StatusCode.NOT_FOUND:
        return OpenAIError(404, text, "not_found_error", None, "adapter_not_found")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if text.startswith(AUTH_TEXT) or text.startswith(ADMIN_REFUSED):
            return OpenAIError(401, text, "invalid_request_error", None, "invalid_api_key")
        return bad_request(text)
    if code == grpc.StatusCode.UNIMPLEMENTED:  # no adapter store / no admin key on the server
        return OpenAIError(404, text, "not_found_error", None, "not_enabled")
    if code == grpc.StatusCode.UNAVAILABLE and details and "store is full" in details:
        return unavailable(text)
    return from_rpc(exc)
