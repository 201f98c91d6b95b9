"""``POST /v1/images/generations`` and ``POST /v1/images/edits``: one Triton request each, whose
``num_images_per_prompt`` rows are the ``n`` images; streamed as OpenAI's image events when asked."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile

from triton_diffusion.openai_front.disconnects import (
    CLIENT_CLOSED_REQUEST,
    error_event,
    final_response,
    first_response,
    sse,
    stream_until_disconnected,
)
from triton_diffusion.openai_front.errors import ApiError, bad_request, field_error, no_final
from triton_diffusion.openai_front.front_state import FrontState
from triton_diffusion.openai_front.image_translation import (
    ImageCall,
    completed_events,
    image_call,
    images_response,
    partial_image_event,
)
from triton_diffusion.openai_front.limits import parse_form, parse_json_object, read_body
from triton_diffusion.openai_front.translation import model_name
from triton_diffusion.openai_front.triton_bridge import (
    IMAGE_TO_IMAGE,
    TEXT_TO_IMAGE,
    ModelInfo,
    TritonResponse,
)

router = APIRouter()


@router.post("/v1/images/generations")
async def generations(request: Request) -> Response:
    front: FrontState = request.app.state.front
    limits = front.limits
    body = parse_json_object(await read_body(request, limits.max_json_bytes), limits)
    name = model_name(body.get("model"), front.models.image)
    info = await front.bridge.model(name, (TEXT_TO_IMAGE,), "/v1/images/generations")
    call = image_call(body, {}, info, limits)
    return await answer(request, front, call, info, "image_generation")


@router.post("/v1/images/edits")
async def edits(request: Request) -> Response:
    front: FrontState = request.app.state.front
    limits = front.limits
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request(
            "/v1/images/edits takes multipart/form-data (image, mask, prompt, ...)", None, "invalid_form"
        )
    form = await parse_form(await read_body(request, limits.max_multipart_bytes), content_type, limits)
    params: dict[str, str] = {}
    files: dict[str, UploadFile] = {}
    for key, value in form.multi_items():
        name = key.removesuffix("[]")  # the openai client names a list of images "image[]"
        if name in params or name in files:
            raise field_error(name, "was sent more than once (allowed: one image and one mask per request)")
        if isinstance(value, UploadFile):
            files[name] = value
        else:
            params[name] = value
    image = files.pop("image", None)
    if image is None:
        raise field_error("image", "is required: the source image as a file part")
    mask = files.pop("mask", None)
    if files:
        raise field_error(next(iter(files)), "unexpected file (allowed: image, mask)")
    name = model_name(params.get("model"), front.models.edit)
    info = await front.bridge.model(name, (IMAGE_TO_IMAGE, TEXT_TO_IMAGE), "/v1/images/edits")
    if not info.serves("image"):
        raise field_error("image", f"is not supported by model {name!r} ({info.kind}); use an image model")
    tensors = {"IMAGE": await image.read()}
    if mask is not None:
        if not info.serves("mask_image"):
            raise field_error(
                "mask", f"is not supported by model {name!r} ({info.kind}); use an inpaint model"
            )
        tensors["MASK_IMAGE"] = await mask.read()
    call = image_call(params, tensors, info, limits, from_form=True)
    return await answer(request, front, call, info, "image_edit")


async def answer(
    request: Request, front: FrontState, call: ImageCall, info: ModelInfo, prefix: str
) -> Response:
    responses = front.bridge.stream(call.request, info, front.limits.request_timeout_s)
    if not call.stream:
        answered, response = await final_response(request, responses)
        if not answered or response is None:  # None only when the client left first
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(images_response(call, response))
    # The first response before the status line: a refused request is a plain 4xx, not a stream.
    answered, first = await first_response(request, responses)
    if not answered or first is None:  # None only when the client left first
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    events = image_events(call, prefix, first, responses)
    return StreamingResponse(stream_until_disconnected(request, events), media_type="text/event-stream")


async def image_events(
    call: ImageCall, prefix: str, first: TritonResponse, responses: AsyncGenerator[TritonResponse, None]
) -> AsyncIterator[bytes]:
    partial = 0  # partial images sent: each PREVIEW the model sends (it sends as many as asked) is one

    async def all_responses() -> AsyncIterator[TritonResponse]:
        yield first
        async for response in responses:
            yield response

    try:
        async for response in all_responses():
            preview = response.scalar("PREVIEW")
            if preview is not None and not response.final and partial < call.partial_images:
                event = partial_image_event(prefix, partial, preview, call.size)
                partial += 1
                yield sse(event, event["type"])
            if response.final:
                for event in completed_events(prefix, call, response):
                    yield sse(event, event["type"])
                return
        raise no_final()
    except ApiError as error:
        yield error_event(error)
    finally:
        await responses.aclose()
