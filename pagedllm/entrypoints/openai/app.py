"""The FastAPI application: routes, API-key guard, CORS, request ids, disconnect handling.

With LoRA on, /v1/models lists the adapters and a generation request's `model` may name
one (`lora_registry.py`); with runtime updating allowed, /v1/load_lora_adapter and
/v1/unload_lora_adapter exist (without it they are unknown routes: 404).

Roles (`tenants.py`): the adapter routes change what every tenant is served, so they need an
admin key (403 otherwise, before the body is read); /metrics, /dashboard/data and
/v1/models answer every key, but a tenant that is no admin sees only its own series and
figures, and adapters by name, never their paths on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagedllm
from pagedllm.entrypoints.openai.audit_log import (
    AuditLog,
    AuditMiddleware,
    audit_record,
    note_model,
)
from pagedllm.entrypoints.openai.dashboard import install_dashboard
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    as_openai_error,
    error_response,
    install_error_handlers,
)
from pagedllm.entrypoints.openai.limits import (
    RequestLimitsMiddleware,
    default_max_request_body_bytes,
)
from pagedllm.entrypoints.openai.lora_registry import LoRARegistry, adapter_checker
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.request_ids import request_id_from_header
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.responses_store import ResponsesStore
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving import now_s
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.tenant_limits import Refusal
from pagedllm.entrypoints.openai.tenants import (
    ActiveTenant,
    TenantRegistry,
    current_tenant,
    current_tenant_is_admin,
    current_tenant_name,
)
from pagedllm.entrypoints.tokenizer_files import tokenizer_info
from pagedllm.frontend.async_llm import AsyncLLM
from pagedllm.frontend.processor import check_token_ids
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics

logger = logging.getLogger("pagedllm")

# Routes anyone may call without the API key (load balancers probe it).
OPEN_PATHS = frozenset({"/health"})
# Routes only an admin key may call: they change what every tenant is served.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# Routes that start engine requests: the tenant limits apply to these.
LIMITED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"}
)
# Status for a request whose client went away (nginx's convention; the client never sees it).
CLIENT_CLOSED_REQUEST = 499


class GuardMiddleware:
    """API-key check on every route but /health (the key names the request's tenant), the
    admin role on `admin_paths`, the tenant's limits on the generation routes, and an
    `X-Request-Id` on every response.

    Plain ASGI rather than BaseHTTPMiddleware, which would buffer streams and hide
    disconnects from the routes.
    """

    def __init__(
        self, app: ASGIApp, tenants: TenantRegistry, admin_paths: frozenset[str] = frozenset()
    ) -> None:
        self.app = app
        self.tenants = tenants
        self.admin_paths = admin_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id, bad_request_id = request_id_from_header(headers.get("x-request-id"))
        tenant = None
        if scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            tenant = self.tenants.authenticate(headers.get("authorization"))
            note_caller(request_id, tenant)
            if tenant is None:
                response = error_response(401, "Unauthorized: missing or wrong API key")
                response.headers["X-Request-Id"] = request_id
                await response(scope, receive, send)
                return
            if scope["path"] in self.admin_paths and not tenant.admin:
                # One answer whatever the body names: it tells nothing about adapters.
                response = error_response(403, "Forbidden: this route needs an admin API key")
                response.headers["X-Request-Id"] = request_id
                await response(scope, receive, send)
                return
        if bad_request_id is not None:  # it would be echoed in a header: never as sent
            response = error_response(400, str(bad_request_id), bad_request_id.param)
            response.headers["X-Request-Id"] = request_id
            await response(scope, receive, send)
            return
        limited = tenant is not None and scope["path"] in LIMITED_PATHS
        if limited:
            refusal = tenant.limiter.admit()
            if refusal is not None:
                await _rate_limited(refusal, request_id)(scope, receive, send)
                return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                if "x-request-id" not in response_headers:
                    response_headers["X-Request-Id"] = request_id
            await send(message)

        context = current_tenant.set(tenant)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_tenant.reset(context)
            if limited:
                tenant.limiter.release()


def note_caller(request_id: str, tenant: ActiveTenant | None) -> None:
    """The audit line's caller: the tenant the key named and the request's id."""
    record = audit_record()
    if record is not None:
        record.request_id = request_id
        record.tenant = None if tenant is None else tenant.name


def _rate_limited(refusal: Refusal, request_id: str) -> Response:
    headers = {"Retry-After": refusal.retry_after_header, "X-Request-Id": request_id}
    return error_response(429, refusal.message, headers=headers)


async def until_disconnect(raw: Request, work: Awaitable[Response]) -> Response:
    """Run a handler, cancelling it (which aborts its requests) if the client goes away."""
    handler = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not handler.done():
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        return handler.result()
    except Exception as error:  # answered here: Starlette's catch-all would drop the connection
        mapped = as_openai_error(error)
        return error_response(mapped.status, mapped.message, mapped.param, mapped.headers)


def lora_registry(engine: AsyncLLM, config: ServerConfig) -> LoRARegistry | None:
    """The adapters requests may name, `--lora-modules` read and checked (ValueError naming
    the bad one); None when the engine runs without LoRA."""
    if engine.config.lora_config is None:
        if config.lora_modules:
            raise ValueError("lora_modules: the engine was started without enable_lora")
        return None
    checker = adapter_checker(engine)
    registry = LoRARegistry(config.served_model_names, checker, config.lora_path_roots)
    registry.add_static(config.lora_modules)
    return registry


def build_app(
    engine: AsyncLLM,
    config: ServerConfig,
    metrics: PrometheusMetrics,
    loras: LoRARegistry | None = None,
    audit_log: AuditLog | None = None,
) -> FastAPI:
    """`loras`: the server's adapters (built from `config` when not given); `audit_log`: where
    each request's audit line goes (None: nowhere)."""
    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    install_error_handlers(app)
    if loras is None:
        loras = lora_registry(engine, config)
    completions = OpenAIServingCompletion(engine, config, loras)
    chat = OpenAIServingChat(engine, config, loras)
    embeddings = OpenAIServingEmbedding(engine, config, loras)
    _add_info_routes(app, engine, config, metrics, chat)
    runtime_loras = loras is not None and config.allow_runtime_lora_updating
    if runtime_loras:
        _add_lora_routes(app, loras, chat)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await until_disconnect(raw, completions.create_completion(request, raw))

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
        return await until_disconnect(raw, embeddings.create_embedding(request, raw))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await until_disconnect(raw, chat.create_chat_completion(request, raw))

    store = ResponsesStore(config.responses_store_size) if config.responses_store_size else None
    responses = OpenAIServingResponses(chat, store)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return await until_disconnect(raw, responses.create_response(request, raw))

    app.state.tenants = TenantRegistry(
        config.api_keys,
        config.api_keys_file,
        config.tenant_limits,
        share_prefix_cache=config.share_prefix_cache_across_tenants,
        admin_api_key=config.admin_api_key,
    )
    if runtime_loras:
        _warn_about_runtime_loras(app.state.tenants, loras)
    # Added before the guard, so it runs after it: no body is read for a refused key.
    max_body_bytes = config.max_request_body_bytes or default_max_request_body_bytes(
        engine.model_config.max_model_len
    )
    app.add_middleware(
        RequestLimitsMiddleware,
        max_body_bytes=max_body_bytes,
        body_timeout_s=config.request_body_timeout,
    )
    admin_paths = ADMIN_PATHS if runtime_loras else frozenset()
    app.add_middleware(GuardMiddleware, tenants=app.state.tenants, admin_paths=admin_paths)
    # Its middleware runs before the guard: it sees the guard's refusals, hands it `?key=`.
    install_dashboard(app, metrics, app.state.tenants, LIMITED_PATHS)
    # Added last, so it runs first: preflight requests never need the API key.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
    if audit_log is not None:  # outermost: it sees every refusal and every last byte
        app.add_middleware(AuditMiddleware, audit_log=audit_log)
    return app


def _add_lora_routes(app: FastAPI, loras: LoRARegistry, chat: OpenAIServingChat) -> None:
    """vLLM's runtime adapter routes. They change only what requests may name: the engine
    core reads an adapter when the first request naming it arrives."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        chat.check_unknown(request)
        note_model(request.lora_name)
        await loras.load(request.lora_name, request.lora_path)
        message = f"Success: LoRA adapter '{request.lora_name}' added successfully."
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        chat.check_unknown(request)
        note_model(request.lora_name)
        loras.unload(request.lora_name, request.lora_int_id)
        message = f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        return PlainTextResponse(message)


def _warn_about_runtime_loras(tenants: TenantRegistry, loras: LoRARegistry) -> None:
    """Say at start-up why the runtime adapter routes would refuse everything."""
    if not tenants.has_admin:
        logger.warning(
            "--allow-runtime-lora-updating: no admin key (--admin-api-key or 'admin' in the "
            "keys file): every load and unload will be refused"
        )
    if not loras.path_roots:
        logger.warning(
            "--allow-runtime-lora-updating: no --lora-path-root and no --lora-modules: "
            "every load will be refused"
        )


def _model_cards(
    engine: AsyncLLM, config: ServerConfig, loras: LoRARegistry | None, show_paths: bool
) -> list:
    """The base model under each served name, then every adapter (vLLM's fields: `root` is
    the model's or adapter's path, `parent` the model an adapter applies to). Without
    `show_paths` (a tenant that is no admin) `root` is the card's name: paths on the
    server are the operator's business."""

    created = now_s()  # vLLM's: the time of the listing

    def card(name: str, root: str, parent: str | None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedllm",
            "root": root if show_paths else name,
            "parent": parent,
            "max_model_len": engine.model_config.max_model_len,
        }

    base = config.served_model_names[0]
    cards = [card(name, engine.model_config.model, None) for name in config.served_model_names]
    for lora in loras.adapters() if loras is not None else ():
        cards.append(card(lora.lora_name, lora.lora_path, lora.base_model_name or base))
    return cards


def _add_info_routes(app, engine: AsyncLLM, config, metrics, chat: OpenAIServingChat) -> None:
    def check_model(model: str | None) -> None:
        chat.resolve_model(model)  # an adapter's tokenizer is the base model's

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return error_response(503, engine.unavailable_reason or "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        cards = _model_cards(engine, config, chat.loras, current_tenant_is_admin())
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # An admin sees every series; a tenant its own per-tenant ones alone.
        tenant = None if current_tenant_is_admin() else current_tenant_name()
        return Response(metrics.render(tenant), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        check_model(request.model)
        chat.check_unknown(request)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "tokenize: give exactly one of prompt and messages", "prompt")
        if request.messages is not None:
            if "add_special_tokens" not in request.model_fields_set:
                request.add_special_tokens = False  # the template holds them
            tokens = (await chat.render(request)).token_ids
        else:
            text = request.prompt or ""
            tokens = await chat.tokenize(text, request.add_special_tokens, check_length=False)
        max_model_len = engine.model_config.max_model_len
        return JSONResponse(
            {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
        )

    if config.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            if engine.tokenizer is None:
                raise OpenAIError(404, "tokenizer_info: the server runs without a tokenizer")
            return JSONResponse(tokenizer_info(engine.tokenizer))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        check_model(request.model)
        chat.check_unknown(request)
        vocab_size = engine.model_config.vocab_size
        token_ids = check_token_ids(request.tokens, vocab_size, "tokens")
        token_ids = chat.check_prompt(token_ids) if token_ids else []
        return JSONResponse({"prompt": engine.tokenizer.decode(token_ids)})
