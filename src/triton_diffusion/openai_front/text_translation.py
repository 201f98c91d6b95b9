"""OpenAI's chat and completion requests to the diffusion LM's fields, and its outputs back to OpenAI's
shapes (image_translation.py and video_translation.py do images and videos, translation.py the
checks they share). Pure: no I/O."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.errors import short_text
from triton_diffusion.openai_front.errors import field_error
from triton_diffusion.openai_front.limits import Limits
from triton_diffusion.openai_front.translation import (
    boolean_param,
    integer_param,
    model_fields,
    scalar_value,
    text_param,
)
from triton_diffusion.openai_front.triton_bridge import ModelInfo, TritonRequest, TritonResponse

# OpenAI parameters that mean nothing for the diffusion LM: accepted and ignored, as OpenAI-compatible
# servers do, so application code written for OpenAI runs unchanged.
IGNORED_TEXT_PARAMS = frozenset(
    {
        "user",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "store",
        "metadata",
        "parallel_tool_calls",
        "logprobs",
        "safety_identifier",
        "prompt_cache_key",
    }
)
# Model fields the front sets from OpenAI parameters: a client sends the OpenAI parameter instead.
TEXT_FIELDS_SET_BY_FRONT = {"prompt": "messages / prompt", "stream": "stream", "gen_length": "max_tokens"}


@dataclass
class TextCall:
    request: TritonRequest
    stream: bool
    include_usage: bool
    model: str
    service_tier: str | None  # the tier asked for, else the model's default (OpenAI echoes it)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def decode_schedule(
    gen_length: int, block_length: Any, steps: Any, largest_block: int = 16, tokens_per_step: float = 2.0
) -> dict[str, int]:
    """The diffusion LM decodes ``gen_length`` tokens in blocks of ``block_length`` with ``steps`` steps
    in all (a multiple of the block count, at most gen_length). ``max_tokens`` alone must give a valid
    schedule: blocks of up to ``largest_block`` tokens that divide it, and about ``tokens_per_step``
    tokens per step (both from the model's defaults: see schedule_defaults). Given values are kept; the
    model checks them."""
    schedule = {"gen_length": gen_length}
    if block_length is None:
        block_length = max(d for d in range(1, min(largest_block, gen_length) + 1) if gen_length % d == 0)
        schedule["block_length"] = block_length
    valid_block = isinstance(block_length, int) and not isinstance(block_length, bool) and block_length > 0
    if steps is None and valid_block and gen_length % block_length == 0:
        blocks = gen_length // block_length
        schedule["steps"] = max(blocks, int(gen_length / tokens_per_step) // blocks * blocks)
    return schedule


def schedule_defaults(info: ModelInfo) -> tuple[int, float]:
    """The largest block and the tokens per step of the model's own default schedule (its MODEL_INFO
    defaults: 64 tokens in blocks of 16 in 32 steps gives 16 and 2.0); 16 and 2.0 where it has none."""
    block, tokens, steps = (info.default(name) for name in ("block_length", "gen_length", "steps"))
    positive = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (block, tokens, steps))
    return (block, tokens / steps) if positive else (16, 2.0)


def chat_prompt(messages: Any, limits: Limits) -> str:
    """OpenAI chat messages as one prompt. The model wraps the prompt as one user turn of its chat
    template; earlier turns (and a system message) go before the last user message as plain text."""
    if not isinstance(messages, list) or not messages:
        raise field_error("messages", "must be a non-empty list of messages")
    if len(messages) > limits.max_chat_messages:
        raise field_error(
            "messages", f"has {len(messages)} messages (allowed: at most {limits.max_chat_messages})"
        )
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise field_error(f"messages[{i}]", "must be an object with role and content", "messages")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise field_error(
                f"messages[{i}].role",
                f"got {short_text(role)} (allowed: system, developer, user, assistant)",
                "messages",
            )
        turns.append((role, message_text(message.get("content"), i)))
    if turns[-1][0] != "user":
        raise field_error("messages", "the last message must be from the user")
    *earlier, (_, last) = turns
    if not earlier:
        return last
    context = "\n".join(f"{role.capitalize()}: {text}" for role, text in earlier)
    return f"{context}\n\n{last}"


def message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise field_error(f"messages[{index}].content", "only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise field_error(f"messages[{index}].content", "must be a string or a list of text parts", "messages")


def text_call(body: Mapping[str, Any], info: ModelInfo, limits: Limits, chat: bool) -> TextCall:
    """/v1/chat/completions (``chat``) and /v1/completions to one request of the diffusion LM."""
    known = {
        "messages" if chat else "prompt",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "seed",
        "stream",
        "stream_options",
        "n",
        "stop",
    }
    if chat:
        prompt = chat_prompt(body.get("messages"), limits)
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1:
            raw = raw[0]
        prompt = text_param("prompt", raw)
    if body.get("n") not in (None, 1):
        raise field_error("n", f"got {short_text(body.get('n'))} (allowed: 1)")
    if body.get("stop") is not None:
        raise field_error("stop", "is not supported by the diffusion LM (it stops at its end-of-text token)")
    stream = boolean_param("stream", body["stream"], False) if body.get("stream") is not None else False
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise field_error("stream_options", "must be an object")
    extras = {k: v for k, v in body.items() if k not in known and k not in IGNORED_TEXT_PARAMS}
    parameters = model_fields(extras, info, TEXT_FIELDS_SET_BY_FRONT, False)
    for name in ("temperature", "seed"):
        if body.get(name) is not None:
            parameters[name] = scalar_value(name, body[name])
    tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(tokens_param)
    if max_tokens is not None:
        gen_length = integer_param(tokens_param, max_tokens, 1, 1 << 20, False)
        given = parameters.get("block_length"), parameters.get("steps")
        parameters.update(decode_schedule(gen_length, *given, *schedule_defaults(info)))
    # Chat wraps the prompt in the model's chat template; a completion continues the text as it is.
    parameters.setdefault("apply_chat_template", chat)
    parameters["stream"] = stream  # blocks as partial responses only when the client streams
    # Which OpenAI parameter each model field came from, so a model's error about the field names it.
    names = {"gen_length": tokens_param, "prompt": "messages" if chat else "prompt"}
    request = TritonRequest(info.name, {"PROMPT": prompt.encode("utf-8")}, parameters, names)
    include_usage = bool(options.get("include_usage"))
    tier = parameters.get("service_tier", info.default_service_tier)
    return TextCall(request, stream, include_usage, info.name, tier if isinstance(tier, str) else None)


def finish_reason(response: TritonResponse) -> str:
    """The model's FINISH_REASON: "stop" (an end-of-text token ended the text) or "length" (every token
    asked for was generated)."""
    reason = response.scalar("FINISH_REASON")
    return bytes(reason).decode("utf-8", errors="replace") if reason is not None else "stop"


def usage(response: TritonResponse) -> dict[str, int]:
    completion = int(response.scalar("TOKENS") or 0)
    prompt = int(response.scalar("PROMPT_TOKENS") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def block_text(response: TritonResponse) -> str:
    """The TEXT output: a committed block's new text (partial responses) or the whole text (FINAL)."""
    text = response.scalar("TEXT")
    return bytes(text).decode("utf-8", errors="replace") if text is not None else ""


def completion_response(call: TextCall, response: TritonResponse, chat: bool) -> dict[str, Any]:
    text = block_text(response)
    counts = usage(response)
    reason = finish_reason(response)
    seed = response.scalar("SEED")
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + call.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": [choice],
        "usage": counts,
        "seed": None if seed is None else int(seed),
        "service_tier": call.service_tier,
    }


def completion_chunk(
    call: TextCall, chat: bool, text: str | None, reason: str | None, first: bool
) -> dict[str, Any]:
    """One streamed chunk: a committed block's text, or (``reason`` set) the closing chunk."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + call.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": [choice],
        "service_tier": call.service_tier,
    }


def usage_chunk(call: TextCall, chat: bool, response: TritonResponse) -> dict[str, Any]:
    chunk = completion_chunk(call, chat, None, None, False)
    chunk["choices"] = []
    chunk["usage"] = usage(response)
    return chunk
