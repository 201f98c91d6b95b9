"""The FastAPI application: API keys, OpenAI-shaped errors for everything (unknown routes included),
health that follows Triton, the model list, the playground page and the endpoint routers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from triton_diffusion.openai_front import chat, images, videos
from triton_diffusion.openai_front.errors import INVALID_REQUEST, ApiError, server_error
from triton_diffusion.openai_front.front_state import FrontState
from triton_diffusion.openai_front.keys import check_bearer
from triton_diffusion.openai_front.video_jobs import VideoJobs, VideoLimits

log = logging.getLogger("triton_diffusion.openai_front")


async def require_key(request: Request) -> None:
    """401 unless the request carries one of the keys. Async: FastAPI runs a sync dependency in its
    threadpool, a hop per request for a check that takes microseconds."""
    front: FrontState = request.app.state.front
    check_bearer(request.headers.get("authorization"), front.keys)


def create_app(front: FrontState, video_limits: VideoLimits | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not front.keys:
            log.warning("OpenAI front: no API key file given; every client that reaches this port is served")
        yield
        if front.videos is not None:
            await front.videos.close()
        await front.bridge.close()

    app = FastAPI(
        title="triton-diffusion OpenAI front",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.front = front
    if front.videos is None:
        front.videos = VideoJobs(front.bridge, video_limits)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "invalid_request")
        body = ApiError(error.status_code, str(error.detail), INVALID_REQUEST, None, code).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        body = ApiError(
            400, f"{param}: {first.get('msg', 'invalid')}", INVALID_REQUEST, param, "invalid_value"
        )
        return JSONResponse(body.body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("OpenAI front: %s %s failed", request.method, request.url.path)
        return JSONResponse(server_error(f"internal error: {type(error).__name__}").body(), status_code=500)

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        """Ready while Triton is ready: a restarting server makes the front not ready too."""
        ready = await front.bridge.ready()
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        page = resources.files("triton_diffusion.openai_front").joinpath("static/playground.html")
        return HTMLResponse(page.read_text(encoding="utf-8"))

    protected = [Depends(require_key)]

    @app.get("/v1/models", dependencies=protected)
    async def list_models() -> JSONResponse:
        catalog = await front.bridge.models()
        return JSONResponse(
            {"object": "list", "data": [_model_entry(info.name, info.kind) for info in catalog.values()]}
        )

    @app.get("/v1/models/{name}", dependencies=protected)
    async def retrieve_model(name: str) -> JSONResponse:
        info = (await front.bridge.models()).get(name)
        if info is None:
            raise ApiError(
                404,
                f"model {name[:128]!r} does not exist or is not ready",
                INVALID_REQUEST,
                "model",
                "model_not_found",
            )
        return JSONResponse(_model_entry(info.name, info.kind))

    for router in (images.router, chat.router, videos.router):
        app.include_router(router, dependencies=protected)
    return app


def _model_entry(name: str, kind: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "triton-diffusion", "kind": kind}
