"""``POST /v1/chat/completions`` and ``POST /v1/completions`` on the diffusion language model: one
Triton request each; streamed as one chunk per committed block."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from triton_diffusion.openai_front.disconnects import (
    CLIENT_CLOSED_REQUEST,
    error_event,
    final_response,
    first_response,
    sse,
    stream_until_disconnected,
)
from triton_diffusion.openai_front.errors import ApiError, no_final
from triton_diffusion.openai_front.front_state import FrontState
from triton_diffusion.openai_front.limits import parse_json_object, read_body
from triton_diffusion.openai_front.text_translation import (
    TextCall,
    block_text,
    completion_chunk,
    completion_response,
    finish_reason,
    text_call,
    usage_chunk,
)
from triton_diffusion.openai_front.translation import model_name
from triton_diffusion.openai_front.triton_bridge import TEXT_GENERATION, ModelInfo, TritonResponse

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await complete(request, chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await complete(request, chat=False)


async def complete(request: Request, chat: bool) -> Response:
    front: FrontState = request.app.state.front
    limits = front.limits
    body = parse_json_object(await read_body(request, limits.max_json_bytes), limits)
    name = model_name(body.get("model"), front.models.text)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    info = await front.bridge.model(name, (TEXT_GENERATION,), endpoint)
    call = text_call(body, info, limits, chat)
    responses = front.bridge.stream(call.request, info, limits.request_timeout_s)
    if not call.stream:
        answered, response = await final_response(request, responses)
        if not answered or response is None:  # None only when the client left first
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(completion_response(call, response, chat))
    # The first response before the status line: a refused request is a plain 4xx, not a stream.
    answered, first = await first_response(request, responses)
    if not answered or first is None:  # None only when the client left first
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    chunks = text_chunks(call, chat, info, first, responses)
    return StreamingResponse(stream_until_disconnected(request, chunks), media_type="text/event-stream")


# The diffusion LM has no checkpoints: a resend (triton_bridge.py) generates again from its first block with
# the seed its resume key gives, so the blocks already sent come again and are dropped; one that differs
# cannot be taken back from the client.
REPEAT_DIFFERS = (
    "the request was resent after a failure and its block {index} came back different from the one "
    "already sent; send it again as a new request"
)


async def text_chunks(
    call: TextCall,
    chat: bool,
    info: ModelInfo,
    first: TritonResponse,
    responses: AsyncGenerator[TritonResponse, None],
) -> AsyncIterator[bytes]:
    async def all_responses() -> AsyncIterator[TritonResponse]:
        yield first
        async for response in responses:
            yield response

    sent_first, streamed = False, ""
    blocks: list[str] = []  # each block's text as sent
    try:
        async for response in all_responses():
            text = block_text(response)
            if not response.final:
                index = int(response.scalar("BLOCK"))
                if index < len(blocks):  # resent after a failure: the same seed, the same blocks again
                    if blocks[index] != text:
                        raise ApiError(
                            500, REPEAT_DIFFERS.format(index=index), "server_error", None, "resent"
                        )
                    continue
                blocks.append(text)
            if response.final and text.startswith(streamed):
                text = text[len(streamed) :]  # the FINAL response has the whole text: send what is new
            elif response.final:
                text = ""  # earlier text changed (tokenizer clean-up); the streamed blocks stand
            if text:
                yield sse(completion_chunk(call, chat, text, None, not sent_first))
                sent_first, streamed = True, streamed + text
            if not response.final:
                continue
            reason = finish_reason(response)
            yield sse(completion_chunk(call, chat, None, reason, not sent_first))
            if call.include_usage:
                yield sse(usage_chunk(call, chat, response))
            yield sse("[DONE]")
            return
        raise no_final()
    except ApiError as error:
        yield error_event(error)
    finally:
        await responses.aclose()
