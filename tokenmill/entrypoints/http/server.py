"""The service app (native, OpenAI and Triton-generate routes) and the health app."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from tokenmill.entrypoints.api.anthropic_protocol import OPENAPI_BODY as ANTHROPIC_BODY
from tokenmill.entrypoints.api.anthropic_protocol import error_body as anthropic_error_body
from tokenmill.entrypoints.api.json_body import BodyError
from tokenmill.entrypoints.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    openapi_body,
)
from tokenmill.entrypoints.api.state import ApiSettings, ServerState, build_state, readiness
from tokenmill.entrypoints.auth import ApiKey
from tokenmill.entrypoints.batch import api as batch_api
from tokenmill.entrypoints.http import (
    anthropic_api,
    lora_api,
    native_api,
    openai_api,
    openai_errors,
    pooling_api,
    responses_api,
    sleep_api,
    tokenize_api,
    triton_api,
)
from tokenmill.entrypoints.http.access_log import AccessLog
from tokenmill.entrypoints.http.request_body import (
    RequestLimitMiddleware,
    read_body,
)
from tokenmill.entrypoints.http.tracing import Tracer
from tokenmill.logs import exception_line
from tokenmill.metrics import REJECT_STATUS, Metrics

logger = logging.getLogger(__name__)


def is_native(body: dict) -> bool:
    """The seed's dispatch: native when the body has `text` or `input_ids`, or `messages`
    without a `model` key; anything else is an OpenAI request."""
    return "text" in body or "input_ids" in body or ("messages" in body and "model" not in body)


async def read_json(request: Request) -> dict | Response:
    try:
        return await read_body(request)
    except BodyError as exc:
        return openai_errors.error_response(str(exc), 400)


def _family_error(path: str, message: str, status: int, headers=None) -> JSONResponse:
    """An error outside a handler, in the shape of the route family of `path`."""
    if path.startswith("/v2/") and path != "/v2/rerank":  # (Cohere's: OpenAI's shape)
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(message, status), status_code=status,
                            headers=headers)
    return JSONResponse(openai_errors.error_body(message, status), status_code=status,
                        headers=headers)


class RejectionCounter:
    """ASGI middleware: every 4xx answer counts in `tokenmill:request_rejected_total` by
    reason (`metrics.REJECT_STATUS`), whichever layer sent it (body limits, auth, validation,
    unknown routes). The 503s are counted where they are decided (queue full, not ready)."""

    def __init__(self, app, get_metrics) -> None:
        self.app = app
        self.get_metrics = get_metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                reason = REJECT_STATUS.get(message["status"])
                metrics = self.get_metrics()
                if reason is not None and metrics is not None:
                    metrics.rejected(reason)
            await send(message)

        await self.app(scope, receive, counting_send)


def create_service_app(settings: ApiSettings, state: ServerState | None = None,
                       metrics: Metrics | None = None) -> FastAPI:
    """`state` may be shared with a health app in the same process; else built at start-up
    (with `metrics`, if given)."""
    tracer = Tracer(settings.config.otlp_traces_endpoint) \
        if settings.config.otlp_traces_endpoint else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.server = state or await build_state(settings, metrics)
        yield
        batch_api.cancel_all()  # (their records say cancelled; results so far are kept)
        if state is None:
            await app.state.server.engine.shutdown()
        if tracer is not None:
            tracer.shutdown()

    # No trailing-slash redirects: their Location is built from the client's Host header.
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} \
        if settings.config.api.disable_docs else {}
    app = FastAPI(title="tokenmill", lifespan=lifespan, redirect_slashes=False, **docs)
    # --root-path, as vLLM sets it: routes answer with and without the proxy's prefix, and
    # /docs points at the prefixed openapi.json
    app.root_path = settings.config.api.root_path
    _add_middleware(app, settings, metrics, tracer)
    _add_error_handlers(app)
    key = ApiKey(settings.config.api_key) if settings.config.api_key else None
    guarded = [Depends(_key_check(key))]
    _add_generate_routes(app, key)
    _add_anthropic_routes(app, key)
    _add_tokenizer_and_model_routes(app, settings, guarded)
    batch_api.add_routes(app, guarded)
    pooling_api.add_routes(app, guarded)
    responses_api.add_routes(app, guarded)
    sleep_api.add_routes(app, guarded)
    _add_health_routes(app)
    app.include_router(triton_api.create_router(lambda request: request.app.state.server,
                                                guard=guarded))
    return app


def _add_middleware(app: FastAPI, settings: ApiSettings, metrics: Metrics | None,
                    tracer: Tracer | None) -> None:
    """Body limits (innermost), rejection counts, the access line (and its span), CORS
    (outermost: preflights answered before anything else)."""
    config = settings.config
    app.add_middleware(RequestLimitMiddleware, max_body_bytes=config.max_request_body_bytes,
                       uploads={"/v1/files": config.max_batch_file_bytes})
    app.add_middleware(RejectionCounter, get_metrics=lambda: _metrics_of(app, metrics))
    app.add_middleware(AccessLog, log_requests=config.log_requests,
                       get_tokenizer=lambda: app.state.server.tokenizer, tracer=tracer,
                       model=config.model_names[0],
                       request_id_header=config.api.request_id_headers)
    if config.api.cors is not None:
        app.add_middleware(CORSMiddleware, **config.api.cors)


def _key_check(key: ApiKey | None):
    async def check_api_key(request: Request) -> None:
        """Inference routes need `Authorization: Bearer <key>` when a key is configured;
        compared in constant time. Health, model list and metrics stay open."""
        if not _authorized(key, request):
            raise _Unauthorized()
    return check_api_key


def _authorized(key: ApiKey | None, request: Request) -> bool:
    """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`."""
    return key is None or key.accepts(request.headers.get("authorization")) or (
        "x-api-key" in request.headers and key.accepts_key(request.headers["x-api-key"]))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: Exception) -> Response:
        return _family_error(request.url.path, UNAUTHORIZED, 401, _CHALLENGE)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and methods answer in their family's error shape too.
        return _family_error(request.url.path, str(exc.detail), exc.status_code, exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: Exception) -> Response:
        # The client left while its body was arriving: nobody reads this answer.
        logger.info("client disconnected before its request body arrived (%s)",
                    request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # One log line (type, message, innermost frames); the client gets a sentence in both
        # APIs' shapes.
        logger.error("unhandled error in %s: %s", request.url.path, exception_line(exc))
        message = "Internal server error."
        return JSONResponse({"error_msg": message, "error_code": 500,
                             **openai_errors.error_body(message, 500)}, status_code=500)


def _add_generate_routes(app: FastAPI, key: ApiKey | None) -> None:
    """The native and OpenAI routes share their paths: the body says which API a request
    speaks, so they check the key once it is read (the answer's shape depends on it)."""

    async def dispatch(request: Request, chat: bool, seed_path: bool = False) -> Response:
        """`seed_path`: the seed's nested OpenAI paths; OpenAI only, `model` not checked
        (the seed's adapter ignored it)."""
        body = await read_json(request)
        if isinstance(body, Response):
            return body if _authorized(key, request) else \
                _family_error(request.url.path, UNAUTHORIZED, 401, _CHALLENGE)
        server: ServerState = request.app.state.server
        native = not seed_path and is_native(body)
        if not _authorized(key, request):
            if native:
                return native_api.error_response(body, UNAUTHORIZED, 401, _CHALLENGE)
            return _family_error(request.url.path, UNAUTHORIZED, 401, _CHALLENGE)
        if server.draining or server.engine.dead is not None:
            message = "The server is not ready: it is shutting down or its engine stopped."
            server.reject("not_ready")
            if native:
                return native_api.error_response(body, message, 503)
            return openai_errors.error_response(message, 503)
        if native:
            return await native_api.handle(body, request, server)
        create = openai_api.create_chat_completion if chat else openai_api.create_completion
        return await create(body, request, server, check_model=not seed_path)

    chat_body = openapi_body(ChatCompletionRequest)
    completion_body = openapi_body(CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=chat_body)
    async def chat_completions(request: Request) -> Response:
        return await dispatch(request, chat=True)

    @app.post("/v1/completions", openapi_extra=completion_body)
    async def completions(request: Request) -> Response:
        return await dispatch(request, chat=False)

    # The seed documents base_url=http://host:port/v1/chat/completions for OpenAI SDKs.
    @app.post("/v1/chat/completions/chat/completions", openapi_extra=chat_body)
    async def seed_chat(request: Request) -> Response:
        return await dispatch(request, chat=True, seed_path=True)

    @app.post("/v1/chat/completions/completions", openapi_extra=completion_body)
    async def seed_completions(request: Request) -> Response:
        return await dispatch(request, chat=False, seed_path=True)


def _add_anthropic_routes(app: FastAPI, key: ApiKey | None) -> None:
    """Anthropic's Messages API (its errors in its own shape, before the handler too)."""

    def route(count: bool):
        async def call(request: Request) -> Response:
            if not _authorized(key, request):
                return _family_error(request.url.path, UNAUTHORIZED, 401, _CHALLENGE)
            try:
                body = await read_body(request)
            except BodyError as exc:
                return anthropic_api.error_response(str(exc), 400)
            server: ServerState = request.app.state.server
            if server.draining or server.engine.dead is not None:
                server.reject("not_ready")
                return anthropic_api.error_response("The server is not ready: it is shutting "
                                                    "down or its engine stopped.", 503)
            if count:
                return await anthropic_api.count_tokens(body, server)
            return await anthropic_api.messages(body, request, server)
        return call

    app.add_api_route("/v1/messages", route(False), methods=["POST"],
                      openapi_extra=ANTHROPIC_BODY)
    app.add_api_route("/v1/messages/count_tokens", route(True), methods=["POST"],
                      openapi_extra=ANTHROPIC_BODY)


def _add_tokenizer_and_model_routes(app: FastAPI, settings: ApiSettings,
                                    guarded: list) -> None:
    """vLLM's tokenizer routes (at the root and under /v1), the model list, /load."""

    def tokenizer_route(kind: str):
        async def route(request: Request) -> Response:
            body = await read_json(request)
            if isinstance(body, Response):
                return body
            return await tokenize_api.handle(kind, request, body)
        return route

    for kind in ("tokenize", "detokenize"):
        for path in (f"/{kind}", f"/v1/{kind}"):
            app.add_api_route(path, tokenizer_route(kind), methods=["POST"],
                              dependencies=guarded, include_in_schema=path.startswith("/v1"))

    @app.get("/v1/models", dependencies=guarded)
    async def models(request: Request) -> dict:
        return openai_api.list_models(request.app.state.server)

    if settings.config.allow_runtime_lora_updating:  # (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        for path, handler in (("/v1/load_lora_adapter", lora_api.load),
                              ("/v1/unload_lora_adapter", lora_api.unload)):
            def route(handler=handler):
                async def call(request: Request) -> Response:
                    body = await read_json(request)
                    if isinstance(body, Response):
                        return body
                    return await handler(body, request.app.state.server)
                return call
            app.add_api_route(path, route(), methods=["POST"], dependencies=guarded)

    if settings.config.api.load_tracking:  # (vLLM's --enable-server-load-tracking)
        @app.get("/load")
        async def load(request: Request) -> dict:
            return {"server_load": request.app.state.server.engine.num_in_flight()}


def _add_health_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        ok, _ = readiness(request.app.state.server)
        return Response(status_code=200 if ok else 503)

    # vLLM's: /ping as /health (SageMaker's probe, GET or POST), /version (open, as probes)
    app.add_api_route("/ping", health, methods=["GET", "POST"], include_in_schema=False)

    @app.get("/version")
    async def version() -> dict:
        from tokenmill import __version__
        return {"version": __version__}

    # KServe v2 probes on the API port too, for Triton clients that only know one port.
    @app.get("/v2/health/live")
    async def v2_live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def v2_ready(request: Request) -> Response:
        ok, _ = readiness(request.app.state.server)
        return Response(status_code=200 if ok else 400)


class _Unauthorized(Exception):
    pass


UNAUTHORIZED = "Unauthorized: a valid API key is required."
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _metrics_of(app: FastAPI, metrics: Metrics | None) -> Metrics | None:
    server = getattr(app.state, "server", None)
    return server.engine.metrics if server is not None else metrics


def create_health_app(get_state) -> FastAPI:
    """Liveness: the process answers. Readiness: model loaded, engine loop alive (heartbeat
    fresh), not draining. `get_state()` returns the shared ServerState or None while loading."""
    app = FastAPI(title="tokenmill health")

    @app.get("/v2/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/v2/health/ready")
    async def ready() -> JSONResponse:
        state = get_state()
        ok, reason = readiness(state)
        body = {"status": "ready" if ok else "not ready", "reason": reason}
        step_s = state.engine.step_running_s() if state is not None else None
        if step_s is not None:  # a long step is visible here before it could count as a stall
            body["engine_step_running_s"] = round(step_s, 3)
        return JSONResponse(body, status_code=200 if ok else 503)

    return app
