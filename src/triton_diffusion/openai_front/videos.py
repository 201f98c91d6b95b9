"""``/v1/videos``: create (JSON or multipart, as the openai client sends it), list, retrieve, download the
MP4, delete (which cancels a running job). A job is its creating key's alone: other keys get 404 for it
and do not see it listed (no keys configured: one tenant)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from triton_diffusion.openai_front.errors import ApiError, bad_request, field_error
from triton_diffusion.openai_front.front_state import FrontState
from triton_diffusion.openai_front.keys import key_owner
from triton_diffusion.openai_front.limits import parse_form, parse_json_object, read_body
from triton_diffusion.openai_front.translation import model_name
from triton_diffusion.openai_front.triton_bridge import TEXT_TO_VIDEO
from triton_diffusion.openai_front.video_jobs import COMPLETED, VideoJobs
from triton_diffusion.openai_front.video_translation import video_call

router = APIRouter()
_VIDEO_ID = re.compile(r"^video_[0-9a-f]{32}$")


def _jobs(request: Request) -> VideoJobs:
    front: FrontState = request.app.state.front
    assert front.videos is not None
    return front.videos


def _owner(request: Request) -> str:
    """The caller's tenant: its key's SHA-256 ("" without keys); the key was checked by require_key."""
    front: FrontState = request.app.state.front
    return key_owner(request.headers.get("authorization"), front.keys)


def _checked_id(video_id: str) -> str:
    if not _VIDEO_ID.match(video_id):
        raise ApiError(
            404,
            "no such video (ids look like video_<32 hex digits>)",
            param="video_id",
            code="video_not_found",
        )
    return video_id


@router.post("/v1/videos")
async def create_video(request: Request) -> Response:
    front: FrontState = request.app.state.front
    limits = front.limits
    content_type = request.headers.get("content-type", "")
    from_form = content_type.lower().startswith(("multipart/form-data", "application/x-www-form-urlencoded"))
    if from_form:
        form = await parse_form(await read_body(request, limits.max_multipart_bytes), content_type, limits)
        params: dict[str, object] = {}
        for key, value in form.multi_items():
            if key in params:
                raise field_error(key, "was sent more than once")
            if isinstance(value, UploadFile) and key != "input_reference":
                raise field_error(key, "unexpected file (text_to_video models take a prompt only)")
            params[key] = value
    elif content_type.lower().startswith("application/json") or not content_type:
        params = parse_json_object(await read_body(request, limits.max_json_bytes), limits)
    else:
        raise bad_request("/v1/videos takes application/json or multipart/form-data", None, "invalid_request")
    name = model_name(params.get("model"), front.models.video)
    info = await front.bridge.model(name, (TEXT_TO_VIDEO,), "/v1/videos")
    call = video_call(params, info, from_form)
    job = _jobs(request).create(call, info, _owner(request))
    return JSONResponse(job.as_openai())


@router.get("/v1/videos")
async def list_videos(request: Request) -> Response:
    jobs = [job.as_openai() for job in _jobs(request).listing(_owner(request))]
    return JSONResponse(
        {
            "object": "list",
            "data": jobs,
            "has_more": False,
            "first_id": jobs[0]["id"] if jobs else None,
            "last_id": jobs[-1]["id"] if jobs else None,
        }
    )


@router.get("/v1/videos/{video_id}")
async def retrieve_video(request: Request, video_id: str) -> Response:
    return JSONResponse(_jobs(request).get(_checked_id(video_id), _owner(request)).as_openai())


@router.get("/v1/videos/{video_id}/content")
async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    job = _jobs(request).get(_checked_id(video_id), _owner(request))
    if variant != "video":
        raise field_error("variant", f"got {variant[:40]!r} (allowed: 'video')")
    if job.status != COMPLETED or job.content is None:
        raise ApiError(
            400, f"video {job.id} is {job.status}, not completed", param="video_id", code="video_not_ready"
        )
    return Response(job.content, media_type="video/mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str) -> Response:
    job = await _jobs(request).delete(_checked_id(video_id), _owner(request))
    return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})
