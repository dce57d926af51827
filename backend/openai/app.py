"""The FastAPI application: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health,
/metrics; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (operator), POST /v1/lora_adapters (tenant).

Requests pass ``intake.Intake`` first (request id, bounded body, cancel on disconnect); bodies are
parsed here against ``Limits``; chat templates render on the ``RenderPool``, never on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.openai.bodies import Body, parse_json, validation_message
from loraplex.openai.callers import KnownCallers
from loraplex.openai.chat import ChatRenderer
from loraplex.openai.errors import OpenAIError, bad_request, internal_error, unavailable
from loraplex.openai.generation import Generation
from loraplex.openai.intake import Intake, on_close, request_id
from loraplex.openai.limits import AUTH_FIRST_BYTES, MAX_MODELS, Limits
from loraplex.openai.lora_api import (LoadLoraAdapterRequest, UnloadLoraAdapterRequest, check_admin, not_enabled,
                                      read_adapter_files, resolve_under, upload_parts, upload_reader)
from loraplex.openai.offload import RenderPool
from loraplex.openai.process import GATEWAY_ID_HEADER
from loraplex.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from loraplex.openai.responses import (CompletionOffsets, Envelope, Tally, chat_body, chat_chunk_choice, completion_body,
                        completion_choice, new_id, role_chunk_choice, sse, tool_chunk_choices)
from loraplex.openai.tokens import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from loraplex.openai.tool_output import ToolOutput
from loraplex.openai.triton_stream import WRITE_TIMEOUT_S, TritonClient, adapters_request

log = logging.getLogger("loraplex.openai")
UPLOAD_PATH = "/v1/lora_adapters"  # a tenant's adapter upload: its body is read after the key passed, as it arrives


@dataclass
class Settings:
    """What the gateway serves, where Triton is, and what one request may cost."""

    triton_url: str
    base_model: str  # the id of the base model in /v1/models and ``model``
    model_dir: str | None = None  # the checkpoint whose tokenizer renders chat prompts
    default_max_tokens: int = 512  # chat requests without max_tokens / max_completion_tokens
    max_model_len: int | None = None  # caps that default at the context left after the prompt
    limits: Limits = field(default_factory=Limits)
    lora_root: str | None = None  # /v1/load_lora_adapter's lora_path must resolve under it (None: API off)
    admin_key: str | None = None  # what that API and /v1/unload_lora_adapter require (None: API off)
    gateway_id: str | None = None  # /health names it in GATEWAY_ID_HEADER (process.py: the launcher's probe)


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
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def parse_body(request: Request, model: type[Body], limits: Limits,
                     authenticate: Callable[[], Awaitable[None]] | None = None) -> Body:
    """The request's JSON body as ``model`` (parse_json, on the event loop: its cost is linear in the body's
    bound); a body over AUTH_FIRST_BYTES is parsed only after ``authenticate()`` passed."""
    raw = await request.body()
    if authenticate is not None and len(raw) > AUTH_FIRST_BYTES:
        await authenticate()
    return parse_json(raw, model, limits)


class Gateway:
    """The routes' shared state: Triton, the chat renderer and its pool, the settings."""

    def __init__(self, settings: Settings, triton: TritonClient, renderer: ChatRenderer | None,
                 pool: RenderPool | None = None):
        self.settings, self.triton, self.renderer = settings, triton, renderer
        limits = settings.limits
        self.pool = pool or RenderPool(limits.render_threads, limits.render_timeout_s)
        self.callers = KnownCallers()
        self.created = int(time.time())

    def lora_name(self, model: str | None) -> str | None:
        """The adapter ``model`` names (None: the base model)."""
        if model is None or model == self.settings.base_model:
            return None
        if not model:
            raise bad_request("model is empty", "model")
        return model

    def start(self, request: Request, body: SamplingFields, prompts: list[str], params: dict,
              logprobs: bool) -> Generation:
        """One lora_llm stream per prompt, cancelled when the HTTP request ends."""
        lora = self.lora_name(body.model)
        if lora is not None:
            params = {**params, "lora_name": lora}
        rid, headers = request_id(request.scope), identity_headers(request)
        generation = Generation([self.triton.generate(p, params, headers, logprobs, f"{rid}-{i}")
                                 for i, p in enumerate(prompts)], rid)
        on_close(request.scope, generation.cancel)
        return generation

    async def models(self, headers: dict, after: str | None = None, limit: int | None = None) -> dict:
        """vLLM's /v1/models: the base model, then each adapter the caller may use with the base as ``parent``;
        all of them up to MAX_MODELS, or one page of ``limit`` after the id ``after`` (``has_more``, ``last_id``)."""
        names, cursor, want = [], after, limit or MAX_MODELS
        while len(names) < want:
            page, cursor = await self.triton.visible_adapters(headers, cursor, min(1000, want - len(names)))
            names += page
            if cursor is None:
                break
        base = self.settings.base_model
        card = {"object": "model", "created": self.created, "owned_by": "loraplex"}
        data = [] if after else [{"id": base, **card, "root": base, "parent": None}]  # vLLM's root: the served name
        data += [{"id": name, **card, "root": name, "parent": base} for name in names]
        return {"object": "list", "data": data, "has_more": cursor is not None,
                "last_id": names[-1] if names else None}

    async def parse(self, request: Request, model: type[Body]) -> Body:
        """A tenant route's JSON body as ``model`` (parse_body; a large one after the caller's key passed)."""
        return await parse_body(request, model, self.settings.limits, lambda: self.authenticate(request))

    async def authenticate(self, request: Request) -> None:
        """401 unless Triton accepts the caller's identity (asked again only after KNOWN_FOR_S)."""
        headers = identity_headers(request)
        if not self.callers.known(headers):
            await self.check_model(None, headers)
            self.callers.accepted(headers)

    async def check_model(self, model: str | None, headers: dict) -> None:
        """Authenticate the caller with Triton (lora_adapters' list); 404 unless ``model`` is one it may use."""
        lora = self.lora_name(model)
        if lora is None:
            await self.triton.visible_adapters(headers, limit=1)
        elif not await self.triton.may_use(headers, lora):
            raise OpenAIError(404, f"The model {lora[:200]!r} does not exist", "invalid_request_error", "model",
                              "model_not_found")

    async def chat_prompt(self, body: ChatCompletionRequest, params: dict, tools: list[dict] | None = None) -> str:
        """The chat's prompt text, rendered on the pool; sets ``params``' default max_tokens when it has none."""
        context = self.settings.max_model_len if "max_tokens" not in params else None
        text, used = await self.pool.run(self.renderer.prompt, body.messages, body.add_generation_prompt,
                                         body.chat_template_kwargs, context, tools)
        if "max_tokens" not in params:
            limit = self.settings.default_max_tokens
            params["max_tokens"] = max(1, min(limit, context - used)) if used is not None else limit
        return text


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
        except Exception:  # logged; the client gets the request id only
            log.exception("request %s failed while streaming", generation.request_id)
            yield sse(internal_error(generation.request_id).body())
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
    limits = settings.limits

    @asynccontextmanager
    async def lifespan(app):
        yield
        gw.pool.close()
        await triton.close()

    app = FastAPI(title="loraplex-openai", lifespan=lifespan)
    app.state.gateway = gw
    app.add_middleware(Intake, max_body_bytes=limits.max_body_bytes,
                       route_bytes={UPLOAD_PATH: limits.max_upload_bytes}, streamed=frozenset({UPLOAD_PATH}))

    def tokenizer_needed() -> ChatRenderer:
        if renderer is None:
            raise bad_request("this gateway has no tokenizer (start it with --model-dir)", "model")
        return renderer

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc: OpenAIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _error_response(bad_request(*validation_message(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                           kind))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        rid = request_id(request.scope)
        log.error("request %s failed", rid, exc_info=exc)
        return _error_response(internal_error(rid))

    @app.get("/health")
    async def health():
        if await triton.ready():
            return Response(status_code=200, headers={GATEWAY_ID_HEADER: settings.gateway_id} if settings.gateway_id
                            else None)
        return _error_response(unavailable("lora_llm is not ready"))

    @app.get("/metrics")
    async def metrics():
        pool = gw.pool
        return Response("".join(
            f"# HELP {name} {text}\n# TYPE {name} gauge\n{name} {value}\n" for name, text, value in (
                ("loraplex_openai_render_threads", "Threads that render chat templates and count tokens.",
                 pool.threads),
                ("loraplex_openai_render_threads_busy", "Render threads running a job now (including jobs "
                 "whose request already got its render_timeout 503).", pool.busy),
            )), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request, after: str | None = None, limit: int | None = None):
        if limit is not None and not 1 <= limit <= 1000:
            raise bad_request("limit must be from 1 to 1000", "limit")
        if after is not None and len(after) > 64:
            raise bad_request("after must be a model id (at most 64 characters)", "after")
        return await gw.models(identity_headers(request), after, limit)

    def admin_key_of(request: Request) -> str:
        if not settings.lora_root or not settings.admin_key:
            raise not_enabled(request.url.path)
        return check_admin(request.headers, settings.admin_key)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        key = admin_key_of(request)  # before the body or the file system is looked at
        body = await parse_body(request, LoadLoraAdapterRequest, limits)
        folder = resolve_under(settings.lora_root, body.lora_path)
        config, weights = await asyncio.to_thread(read_adapter_files, folder, settings.lora_root,
                                                  limits.max_upload_bytes)
        inputs = {"adapter_name": body.lora_name, "adapter_config": config, "adapter_weights": weights,
                  "load_inplace": "true" if body.load_inplace else "false"}
        result = await triton.adapters(adapters_request("load_shared", inputs, key), {}, WRITE_TIMEOUT_S)
        log.info("shared adapter loaded: %s version %s from %s", body.lora_name, result.get("version"), folder)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        key = admin_key_of(request)
        body = await parse_body(request, UnloadLoraAdapterRequest, limits)
        await triton.adapters(adapters_request("unload_shared", {"adapter_name": body.lora_name}, key), {})
        log.info("shared adapter unloaded: %s", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post(UPLOAD_PATH)
    async def upload_lora_adapter(request: Request):
        headers = identity_headers(request)
        await gw.check_model(None, headers)  # the caller's key, before a byte of the body is read
        reader = upload_reader(request.headers.get("content-type", ""), limits.max_upload_bytes)
        async for chunk in request.stream():  # each chunk's work is linear in it (multipart.py)
            reader.feed(chunk)
        name, config, weights = upload_parts(reader.close())
        inputs = {"adapter_name": name, "adapter_config": config, "adapter_weights": weights}
        return await triton.adapters(adapters_request("upload", inputs), headers, WRITE_TIMEOUT_S)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await gw.parse(request, CompletionRequest)
        prompts, params = body.prompts(), body.sampling_parameters()
        limits.check_choices(len(prompts), body.n)
        top = body.logprobs
        generation = gw.start(request, body, prompts, params, top is not None)
        await generation.start()
        env = Envelope(new_id("cmpl"), body.model or settings.base_model, "text_completion")
        tally = Tally(len(prompts), body.n)
        if not body.stream:
            return completion_body(env, await _collect(generation, tally), top, prompts if body.echo else None)
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
    async def chat_completions(request: Request):
        if renderer is None:
            raise bad_request("this gateway has no tokenizer for chat templates (start it with --model-dir)",
                              "messages")
        body = await gw.parse(request, ChatCompletionRequest)
        params = body.sampling_parameters(None)
        limits.check_choices(1, body.n)
        tools, choice = body.tool_plan()
        prompt = await gw.chat_prompt(body, params, tools if choice != "none" else None)
        parsed = ToolOutput(choice, {t["function"]["name"] for t in tools}) if choice != "none" else None
        top = (body.top_logprobs or 0) if body.logprobs else None
        generation = gw.start(request, body, [prompt], params, top is not None)
        await generation.start()
        env = Envelope(new_id("chatcmpl"), body.model or settings.base_model, "chat.completion")
        tally = Tally(1, body.n)
        if not body.stream:
            return chat_body(env, await _collect(generation, tally), top, parsed)
        env.object = "chat.completion.chunk"
        usage_field = {"usage": None} if body.include_usage() else {}

        async def events():
            yield sse(env.wrap([role_chunk_choice(k) for k in range(body.n)], **usage_field))
            async for index, delta in generation.deltas():
                changes = tally.add(index, delta)
                choices = [chat_chunk_choice(c, top) for c in changes] if parsed is None else \
                    [part for c in changes for part in tool_chunk_choices(c, top, parsed)]
                if choices:
                    yield sse(env.wrap(choices, **usage_field))
            if body.include_usage():
                yield sse(env.wrap([], usage=tally.usage()))

        return _event_stream(events(), generation)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        body = await gw.parse(request, TokenizeRequest)
        tools = body.checked_tools()
        await gw.check_model(body.model, identity_headers(request))
        ids, strs = await gw.pool.run(tokenize, tokenizer_needed(), body, tools)
        return {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids,
                "token_strs": strs if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        body = await gw.parse(request, DetokenizeRequest)
        await gw.check_model(body.model, identity_headers(request))
        return {"prompt": await gw.pool.run(detokenize, tokenizer_needed(), body.tokens)}

    return app
