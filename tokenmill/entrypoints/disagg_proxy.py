"""`tokenmill disagg-proxy`: one OpenAI endpoint in front of prefill and decode instances
(servers started with `--kv-transfer-config`). Each completion or chat completion goes to a
prefill instance first, asking one token and `kv_transfer_params: {"do_remote_decode":
true}`, then, with the parameters the prefill instance answers, to a decode instance, whose
answer (streamed or whole) is the client's. Instances are taken in turn; an instance's error
is passed on as it came, an instance that cannot be reached answers 502 in OpenAI's error
shape. vLLM's toy proxy does the same with the same fields."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.api.json_body import BodyError, parse_json_object
from tokenmill.entrypoints.http.openai_errors import error_response

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # a request body (the instances behind apply their own bound too)
# headers not passed on (hop by hop, or describing the body the proxy rewrites)
_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
         "te", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding"}


def build_app(prefill: list[str], decode: list[str], timeout: float = 600.0) -> FastAPI:
    import httpx

    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="tokenmill disaggregation proxy", docs_url=None, redoc_url=None,
                  lifespan=lifespan)

    async def forward(request: Request, path: str) -> Response:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                return error_response(f"The request body is over {MAX_BODY_BYTES >> 20} MiB.",
                                      413)
        try:
            body = parse_json_object(bytes(raw))
        except BodyError as exc:
            return error_response(str(exc), 400)
        if body.get("n", 1) != 1 or body.get("use_beam_search"):
            return error_response("A disaggregated deployment answers n=1 without beam "
                                  "search.", 400, "n")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        url = next(prefills)
        try:
            answer = await client.post(url + path, json=first, headers=headers)
        except httpx.HTTPError as exc:
            return _unreachable("prefill", url, exc)
        if answer.status_code != 200:
            return _passed_on(answer)
        params = _json(answer).get("kv_transfer_params")
        if not isinstance(params, dict):
            return error_response("The prefill instance answered without kv_transfer_params: "
                                  "start it with --kv-transfer-config.", 502)
        second = {**body, "kv_transfer_params": params}
        url = next(decodes)
        try:
            upstream = await client.send(client.build_request(
                "POST", url + path, json=second, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return _unreachable("decode", url, exc)
        if not body.get("stream") or upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return _passed_on(upstream)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=200,
                                 media_type=upstream.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = decode[0]
        try:
            return _passed_on(await client.get(url + "/v1/models", headers={
                k: v for k, v in request.headers.items() if k.lower() not in _DROP}))
        except httpx.HTTPError as exc:
            return _unreachable("decode", url, exc)

    @app.get("/health")
    async def health() -> Response:
        """200 when every instance answers its /health with 200, else 503 naming them."""
        down = []
        for url in [*prefill, *decode]:
            try:
                if (await client.get(url + "/health", timeout=5.0)).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        if down:
            return error_response(f"Not ready: {', '.join(down)}.", 503)
        return JSONResponse({"status": "ok"})

    return app


def _json(answer: Any) -> dict:
    try:
        value = answer.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _passed_on(answer: Any) -> Response:
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"),
                    headers={k: v for k, v in answer.headers.items()
                             if k.lower() == "retry-after"})


def _unreachable(role: str, url: str, exc: Exception) -> Response:
    logger.warning("%s instance %s: %s", role, url, type(exc).__name__)
    return error_response(f"The {role} instance {url} cannot be reached.", 502)


def _instance(url: str) -> str:
    if not url.startswith(("http://", "https://")) or len(url) > 2048:
        raise argparse.ArgumentTypeError(f"an instance is an http:// or https:// URL, got "
                                         f"{url!r}")
    return url.rstrip("/")


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill disagg-proxy", description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, type=_instance,
                        metavar="URL", help="a prefill instance (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, type=_instance,
                        metavar="URL", help="a decode instance (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default "
                        "127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an instance may take to answer (default 600)")
    args = parser.parse_args(argv)
    try:
        import httpx  # noqa: F401
    except ImportError:
        sys.stderr.write("error: the proxy needs httpx: pip install 'tokenmill[disagg]'\n")
        return 2
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout), host=args.host,
                port=args.port, log_level="warning")
    return 0
