"""The FastAPI application: /v1/models, /v1/completions, /v1/chat/completions, /health."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import ChatRenderer
from .errors import OpenAIError, bad_request, unavailable
from .generation import Generation
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .responses import (CompletionOffsets, Envelope, Tally, chat_body, chat_chunk_choice, completion_body,
                        completion_choice, new_id, role_chunk_choice, sse)
from .triton_stream import TritonClient

log = logging.getLogger("loraplex.openai")
DISCONNECT_POLL_SECONDS = 0.5
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away (nobody reads it)


@dataclass
class Settings:
    """What the gateway serves and where Triton is."""

    triton_url: str
    base_model: str  # the id of the base model in /v1/models and ``model``
    model_dir: str | None = None  # the checkpoint whose tokenizer renders chat prompts
    default_max_tokens: int = 512  # chat requests without max_tokens / max_completion_tokens
    max_model_len: int | None = None  # caps that default at the context left after the prompt


def identity_headers(request: Request) -> dict[str, str]:
    """What travels to Triton: the bearer key as x-api-key, and x-tenant-id (development mode)."""
    headers = {}
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        headers["x-api-key"] = key.strip()
    elif request.headers.get("x-api-key"):
        headers["x-api-key"] = request.headers["x-api-key"]
    if request.headers.get("x-tenant-id"):
        headers["x-tenant-id"] = request.headers["x-tenant-id"]
    return headers


def _error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (loc[0] if loc else None)


class Gateway:
    """The routes' shared state: Triton, the chat renderer, the settings."""

    def __init__(self, settings: Settings, triton: TritonClient, renderer: ChatRenderer | None):
        self.settings, self.triton, self.renderer = settings, triton, renderer
        self.created = int(time.time())

    def lora_name(self, model: str | None) -> str | None:
        """The adapter ``model`` names (None: the base model)."""
        if model is None or model == self.settings.base_model:
            return None
        if not model:
            raise bad_request("model is empty", "model")
        return model

    def start(self, body: SamplingFields, prompts: list[str], params: dict, headers: dict,
              logprobs: bool) -> Generation:
        """One lora_llm stream per prompt."""
        lora = self.lora_name(body.model)
        if lora is not None:
            params = {**params, "lora_name": lora}
        return Generation([self.triton.generate(p, params, headers, logprobs) for p in prompts])

    async def models(self, headers: dict) -> dict:
        """vLLM's /v1/models: the base model, then each adapter with the base as ``parent``."""
        adapters = await self.triton.visible_adapters(headers)
        base = self.settings.base_model
        card = {"object": "model", "created": self.created, "owned_by": "loraplex"}
        data = [{"id": base, **card, "root": self.settings.model_dir or base, "parent": None}]
        data += [{"id": name, **card, "root": name, "parent": base} for name in adapters]
        return {"object": "list", "data": data}

    def chat_max_tokens(self, prompt: str) -> int:
        """The default max_tokens of a chat request: the setting, within the context left."""
        limit = self.settings.default_max_tokens
        if self.settings.max_model_len and self.renderer is not None:
            used = len(self.renderer.tokenizer(prompt).input_ids)
            limit = max(1, min(limit, self.settings.max_model_len - used))
        return limit


async def _until_disconnected(request: Request, work: asyncio.Future, generation: Generation):
    """``work``'s result; if the client goes away first, cancel it and its streams."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            generation.cancel()
            return None


async def _collect(generation: Generation, tally: Tally) -> Tally:
    async for index, delta in generation.deltas():
        tally.add(index, delta)
    return tally


def _event_stream(events: AsyncIterator[str], generation: Generation) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield event
        except OpenAIError as exc:  # after the 200: OpenAI's clients read an error event
            yield sse(exc.body())
        finally:
            generation.cancel()
        yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(settings: Settings, triton: TritonClient | None = None,
               renderer: ChatRenderer | None = None) -> FastAPI:
    """The gateway for ``settings`` (Triton client and chat renderer built from them unless given)."""
    triton = triton or TritonClient(settings.triton_url)
    if renderer is None and settings.model_dir:
        renderer = ChatRenderer(settings.model_dir)
    gw = Gateway(settings, triton, renderer)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await triton.close()

    app = FastAPI(title="loraplex-openai", lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc: OpenAIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                           kind))

    @app.get("/health")
    async def health():
        if await triton.ready():
            return Response(status_code=200)
        return _error_response(unavailable(f"lora_llm on Triton at {settings.triton_url} is not ready"))

    @app.get("/v1/models")
    async def models(request: Request):
        return await gw.models(identity_headers(request))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        prompts, params = body.prompts(), body.sampling_parameters()
        top = body.logprobs
        generation = gw.start(body, prompts, params, identity_headers(request), top is not None)
        await generation.start()
        env = Envelope(new_id("cmpl"), body.model or settings.base_model, "text_completion")
        tally = Tally(len(prompts), body.n)
        if not body.stream:
            work = asyncio.ensure_future(_collect(generation, tally))
            if await _until_disconnected(request, work, generation) is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return completion_body(env, tally, top, prompts if body.echo else None)
        usage_field = {"usage": None} if body.include_usage() else {}
        offsets = CompletionOffsets(len(prompts) * body.n)

        async def events():
            if body.echo:
                yield sse(env.wrap([completion_choice(k, prompts[k // body.n], [], None, None)
                                    for k in range(len(prompts) * body.n)], **usage_field))
            async for index, delta in generation.deltas():
                changes = tally.add(index, delta)
                if changes:
                    choices = [completion_choice(c.index, c.text, c.logprobs, top, c.finish_reason,
                                                 offsets.take(c.index, c.logprobs)) for c in changes]
                    yield sse(env.wrap(choices, **usage_field))
            if body.include_usage():
                yield sse(env.wrap([], usage=tally.usage()))

        return _event_stream(events(), generation)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        if renderer is None:
            raise bad_request("this gateway has no tokenizer for chat templates (start it with --model-dir)",
                              "messages")
        prompt = renderer.render([m.as_template_input() for m in body.messages], body.add_generation_prompt,
                                 body.chat_template_kwargs)
        given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_parameters(gw.chat_max_tokens(prompt) if given is None else None)
        top = (body.top_logprobs or 0) if body.logprobs else None
        generation = gw.start(body, [prompt], params, identity_headers(request), top is not None)
        await generation.start()
        env = Envelope(new_id("chatcmpl"), body.model or settings.base_model, "chat.completion")
        tally = Tally(1, body.n)
        if not body.stream:
            work = asyncio.ensure_future(_collect(generation, tally))
            if await _until_disconnected(request, work, generation) is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return chat_body(env, tally, top)
        env.object = "chat.completion.chunk"
        usage_field = {"usage": None} if body.include_usage() else {}

        async def events():
            yield sse(env.wrap([role_chunk_choice(k) for k in range(body.n)], **usage_field))
            async for index, delta in generation.deltas():
                changes = tally.add(index, delta)
                if changes:
                    yield sse(env.wrap([chat_chunk_choice(c, top) for c in changes], **usage_field))
            if body.include_usage():
                yield sse(env.wrap([], usage=tally.usage()))

        return _event_stream(events(), generation)

    return app
