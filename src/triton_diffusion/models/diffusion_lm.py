"""The diffusion language model on Triton: requests go to the shared step engine (continuous batching).

``execute()`` reads and validates each request and hands it to the step engine's worker, whose thread runs
one shared forward per step for every running request (adapters/diffusion_lm_adapter.py). ``execute()``
returns once its requests are admitted; it blocks while the running set and the waiting room are full,
so the rest waits in Triton's queue under its queue policy. Each completed block is streamed as a partial
TEXT response (unless ``stream`` is false); the FINAL response carries the whole text, the token count
and the steps used.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from triton_diffusion.adapters.diffusion_lm_adapter import (
    DecodingRequest,
    DiffusionLMAdapter,
    padding_changes_logits,
)
from triton_diffusion.adapters.masked_diffusion import REMASKING, DecodeParams
from triton_diffusion.adapters.masked_lm import LoadedMaskedLM, load_masked_lm, prompt_token_ids
from triton_diffusion.engine.policies import make_policy
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, EngineWorker, Job, StepEngine
from triton_diffusion.errors import ErrorCode, RequestError, invalid_field
from triton_diffusion.faults import FaultInjection, FaultyStepAdapter
from triton_diffusion.fields import REQUIRED, Field, FieldSet, Role, seed_field
from triton_diffusion.serving.metrics import DIFFUSION_LM_FAMILIES
from triton_diffusion.serving.triton_model import TritonModel
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")

# Every field is per request (ROW): requests never wait for each other's settings, since each runs its
# own schedule inside the shared forward. Config parameters override defaults and limits.
DIFFUSION_LM_FIELDS = FieldSet(
    [
        Field("prompt", str, REQUIRED, Role.ROW, allow_empty=False, max_length=8000, doc="the prompt text"),
        Field(
            "apply_chat_template",
            bool,
            False,
            Role.ROW,
            doc="wrap the prompt as a user turn with the tokenizer's chat template (if it has one)",
        ),
        Field(
            "gen_length",
            int,
            64,
            Role.ROW,
            minimum=1,
            maximum=512,
            doc="tokens to generate: the mask tokens appended to the prompt",
        ),
        Field(
            "block_length",
            int,
            16,
            Role.ROW,
            minimum=1,
            maximum=512,
            doc="decode left to right in blocks of this many tokens (must divide gen_length); "
            "each finished block is streamed",
        ),
        Field(
            "steps",
            int,
            32,
            Role.ROW,
            minimum=1,
            maximum=512,
            doc="denoising steps over all blocks: a multiple of the block count, at most gen_length",
        ),
        Field("temperature", float, 0.0, Role.ROW, minimum=0.0, maximum=2.0, doc="0 = greedy"),
        Field(
            "remasking",
            str,
            "low_confidence",
            Role.ROW,
            choices=REMASKING,
            doc="which masked positions a step commits: the most confident, or random ones",
        ),
        Field(
            "threshold",
            float,
            None,
            Role.ROW,
            minimum=0.0,
            maximum=1.0,
            doc="Fast-dLLM: also commit every position more confident than this (a block may finish "
            "in fewer steps)",
        ),
        Field(
            "cfg_scale",
            float,
            0.0,
            Role.ROW,
            minimum=0.0,
            maximum=10.0,
            doc="classifier-free guidance; > 0 adds a row with the prompt masked",
        ),
        Field("stop_at_eos", bool, True, Role.ROW, doc="stop after a block that holds an EOS token"),
        Field(
            "stream",
            bool,
            True,
            Role.ROW,
            doc="send each finished block as a partial response; false: the FINAL response only "
            "(HTTP generate, which is not streaming, takes exactly one response)",
        ),
        seed_field("seed of the request's own generator; drawn and returned when absent"),
    ]
)

OUTPUTS = [
    ("TEXT", "TYPE_STRING", [1]),  # partial: the new text of one block; FINAL: the whole text
    ("BLOCK", "TYPE_INT32", [1]),  # partial: index of the block; FINAL: blocks decoded
    ("TOKENS", "TYPE_INT32", [1]),  # generated tokens so far (up to the first EOS)
    ("STEPS", "TYPE_INT32", [1]),  # FINAL: denoising steps (forwards) this request took part in
    ("SEED", "TYPE_INT64", [1]),  # FINAL: the seed used
]


@dataclass(eq=False)
class ResponseStream:
    """What the engine's listener keeps per request (a job's ``context``)."""

    prompt: str
    seed: int
    stream: bool
    text: str = ""  # sent so far
    first_block_seen: bool = False


def _array(value: Any, dtype: Any) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


class DiffusionLMModel(TritonModel):
    FIELDS = DIFFUSION_LM_FIELDS
    OUTPUTS = OUTPUTS
    METRIC_FAMILIES = DIFFUSION_LM_FAMILIES

    def setup(self, settings: ModelSettings) -> None:
        threads = settings.get("intra_op_threads")
        if threads is not None:
            # Each model runs in its own stub process; on a small CPU shared with Triton's own threads,
            # fewer torch threads can be faster.
            torch.set_num_threads(int(threads))
        self.lm: LoadedMaskedLM = load_masked_lm(settings)
        self.fields = self.FIELDS.configured(settings.params)
        if self.fields["apply_chat_template"].default and not self.lm.tokenizer.chat_template:
            raise ValueError(
                f"model {settings.name}: default_apply_chat_template is set, but the tokenizer "
                "has no chat template"
            )
        self.max_prompt_tokens = int(settings.get("max_prompt_tokens", "1024"))
        max_running = int(settings.get("max_running_requests", "8"))
        waiting_room = int(settings.get("waiting_room", "4"))
        self.max_wait_s = float(settings.get("max_admission_wait_s", "120"))
        forward, side = self.lm.forward, self.lm.forward.padding_side
        # A model that ignores the attention mask (LLaDA's published code) must never see padding.
        unpadded = padding_changes_logits(forward, self.lm.pad_id, side, self.lm.vocab_size, self.lm.device)
        adapter: Any = DiffusionLMAdapter(forward, self.lm.pad_id, side, self.lm.device, unpadded)
        faults = FaultInjection.from_config(settings.get("fault_injection"))
        if faults is not None:
            adapter = FaultyStepAdapter(adapter, faults, lambda job: job.context.prompt)
        cancel_poll_s = float(settings.get("cancel_poll_ms", "50")) / 1000
        limits = EngineLimits(max_running, max_running, cancel_poll_s=cancel_poll_s)
        self.engine = StepEngine(adapter, self, limits, make_policy("oldest"))
        self.worker = EngineWorker(
            self.engine, waiting_room, name="dllm-engine", on_device_lost=self.exit_for_restart
        )
        log.info(
            "%s ready: max_running_requests=%d waiting_room=%d padding=%s mask_id=%d eos_ids=%s device=%s",
            settings.name,
            max_running,
            waiting_room,
            "none (the model ignores its attention mask: equal lengths share forwards)" if unpadded else side,
            self.lm.mask_id,
            list(self.lm.eos_ids),
            self.lm.device,
        )

    def finalize(self) -> None:
        self.worker.close()  # requests still held get UNAVAILABLE
        log.info("%s unloaded", self.settings.name)

    # ---- requests ---------------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> Job:
        values = self.fields.parse(raw)
        params = DecodeParams(
            gen_length=values["gen_length"],
            block_length=values["block_length"],
            steps=values["steps"],
            temperature=values["temperature"],
            remasking=values["remasking"],
            threshold=values["threshold"],
            cfg_scale=values["cfg_scale"],
            stop_at_eos=values["stop_at_eos"],
        )
        params.check()
        prompt = self.tokenize(values["prompt"], values["apply_chat_template"])
        seed = values["seed"] if values["seed"] is not None else random.randrange(2**32)
        generator = torch.Generator(device=self.lm.device).manual_seed(seed)
        decoding = DecodingRequest(prompt, params, generator, self.lm.mask_id, self.lm.eos_ids)
        return Job(tracked, decoding, ResponseStream(values["prompt"], seed, values["stream"]))

    def run(self, admitted: list[tuple[TrackedRequest, Job]]) -> None:
        for tracked, job in admitted:
            left = self.max_wait_s - (time.perf_counter() - tracked.entered)
            try:
                waited = self.worker.submit([job], timeout_s=max(left, 0.0))
            except RequestError as error:
                tracked.fail(error)
                continue
            except Exception as exc:  # noqa: BLE001  (never the requests already in the engine)
                log.exception("request %s: handing it to the engine failed", tracked.request_id)
                tracked.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                continue
            self.metrics.observe("triton_diffusion_lm_admission_wait_seconds", waited)

    def tokenize(self, prompt: str, chat: bool) -> torch.Tensor:
        if chat and not self.lm.tokenizer.chat_template:
            raise invalid_field(
                "apply_chat_template", "this model's tokenizer has no chat template (allowed: false)"
            )
        ids = prompt_token_ids(self.lm.tokenizer, prompt, chat)
        if not 1 <= len(ids) <= self.max_prompt_tokens:
            raise invalid_field(
                "prompt", f"is {len(ids)} tokens long (allowed: 1..{self.max_prompt_tokens} tokens)"
            )
        return torch.tensor(ids, dtype=torch.long)

    # ---- engine listener (called on the engine's thread) -------------------------------------------
    def on_admitted(self, job: Job) -> None:
        log.info("request %s admitted (%d running)", job.request.request_id, len(self.engine.running) + 1)

    def on_stepped(self, job: Job) -> None:
        request: DecodingRequest = job.state
        stream: ResponseStream = job.context
        if not request.new_block:
            return
        if not stream.first_block_seen:
            stream.first_block_seen = True
            waited = time.perf_counter() - job.request.entered
            self.metrics.observe("triton_diffusion_lm_first_block_seconds", waited)
        if not stream.stream:
            return
        tokens = request.tokens()
        text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
        new_text, stream.text = _new_text(stream.text, text)
        job.request.progress(
            {
                "TEXT": _array(new_text.encode(), object),
                "BLOCK": _array(request.block_index - 1, np.int32),
                "TOKENS": _array(len(tokens), np.int32),
            }
        )

    def on_finished(self, job: Job, output: DecodingRequest) -> None:
        stream: ResponseStream = job.context
        tokens = output.tokens()
        text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
        answered = job.request.finish(
            {
                "TEXT": _array(text.encode(), object),
                "BLOCK": _array(output.block_index, np.int32),
                "TOKENS": _array(len(tokens), np.int32),
                "STEPS": _array(output.steps_used, np.int32),
                "SEED": _array(stream.seed, np.int64),
            }
        )
        if answered:
            self.metrics.increment("triton_diffusion_lm_tokens_total", len(tokens))

    def on_left(self, job: Job, reason: str) -> None:
        request: DecodingRequest = job.state or job.params
        if reason == "cancelled":
            self.metrics.increment("triton_diffusion_lm_requests_cancelled_total")
        log.info(
            "request %s %s: %d tokens, %d blocks, %d steps, joined at forward %s",
            job.request.request_id,
            reason,
            len(request.tokens()),
            request.block_index,
            request.steps_used,
            job.first_forward,
        )

    def on_forward(self, jobs: list[Job], rows: int, seconds: float) -> None:
        self.metrics.observe("triton_diffusion_lm_forward_rows", rows)
        self.metrics.observe("triton_diffusion_lm_step_seconds", seconds)
        self.metrics.increment("triton_diffusion_lm_forwards_total")
        self.metrics.set("triton_diffusion_lm_running_requests", len(self.engine.running))


def _new_text(sent: str, text: str) -> tuple[str, str]:
    """What ``text`` adds to what was already streamed, and the streamed text after it. A trailing
    replacement character may be half of a multi-byte character: it waits for the next block. Should more
    tokens change earlier text (tokenizer clean-up), only what follows the common part is sent; the FINAL
    response has the whole text."""
    text = text.rstrip("\ufffd")
    common = len(os.path.commonprefix([sent, text]))
    return text[common:], text
