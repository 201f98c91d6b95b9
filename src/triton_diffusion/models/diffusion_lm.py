"""The diffusion language model on Triton: requests go to a step-level continuous-batching engine.

``execute()`` parses each request and hands it to :class:`~triton_diffusion.engine.dllm_engine.EngineWorker`,
whose thread runs one shared forward per step for every running request. ``execute()`` returns once its
requests are admitted; it blocks while the running set and the waiting room are full, so the rest waits
in Triton's queue under its queue policy. Each completed block is streamed as a partial TEXT response;
the FINAL response carries the whole text, the token count and the steps used.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from triton_diffusion.adapters.masked_diffusion import REMASKING, DecodeParams
from triton_diffusion.adapters.masked_lm import LoadedMaskedLM, load_masked_lm, prompt_token_ids
from triton_diffusion.engine.dllm_engine import (
    ContinuousBatchEngine,
    DecodingRequest,
    EngineWorker,
    PaddedForward,
)
from triton_diffusion.errors import ErrorCode, RequestError, invalid_field
from triton_diffusion.faults import FaultInjection
from triton_diffusion.fields import REQUIRED, Field, FieldSet, Role, seed_field
from triton_diffusion.serving.metrics import DIFFUSION_LM_FAMILIES
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
    """What the engine's listener needs to answer one request after ``execute()`` has returned."""

    sender: Any  # the request's pb_utils response sender
    request_id: str
    prompt: str
    seed: int
    entered: float  # perf_counter() at execute()
    text: str = ""  # sent so far
    first_block_seen: bool = False


def _array(value: Any, dtype: Any) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


class DiffusionLMModel:
    FIELDS: ClassVar[FieldSet] = DIFFUSION_LM_FIELDS
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]] = OUTPUTS

    # ---- Triton entry points ----------------------------------------------------------------------
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        from triton_diffusion.serving.triton_io import add_io_to_config

        return add_io_to_config(auto_complete_model_config, cls.FIELDS, cls.OUTPUTS)

    def initialize(self, args: dict[str, str]) -> None:
        from triton_diffusion.serving.triton_io import batching_metrics, install_log_handler

        install_log_handler()
        self.settings = settings = ModelSettings.from_triton_args(args)
        self.metrics = batching_metrics(settings.name, DIFFUSION_LM_FAMILIES)
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
        faults = FaultInjection.from_config(settings.get("fault_injection"))
        self.engine = ContinuousBatchEngine(
            self.lm.forward if faults is None else self._with_faults(self.lm.forward, faults),
            listener=self,
            pad_id=self.lm.pad_id,
            max_running=max_running,
            padding_side=self.lm.forward.padding_side,
            device=self.lm.device,
        )
        self.worker = EngineWorker(self.engine, waiting_room)
        log.info(
            "%s ready: max_running_requests=%d waiting_room=%d padding=%s mask_id=%d eos_ids=%s device=%s",
            settings.name,
            max_running,
            waiting_room,
            self.engine.padding_side,
            self.lm.mask_id,
            list(self.lm.eos_ids),
            self.lm.device,
        )

    def _with_faults(self, forward: PaddedForward, faults: FaultInjection) -> PaddedForward:
        """The forward with the test-only faults (``fault_injection``): a failing or stalled step."""

        def faulty(*inputs: torch.Tensor) -> torch.Tensor:
            faults.before_call([request.handle.prompt for request in self.engine.running])
            logits = forward(*inputs)
            faults.after_step()
            return logits

        return faulty

    def execute(self, requests: Sequence[Any]) -> None:
        from triton_diffusion.serving.triton_io import read_raw_fields

        entered = time.perf_counter()
        for request in requests:
            sender = request.get_response_sender()
            try:
                raw = read_raw_fields(request, self.fields)
                decoding = self.parse(raw, sender, request.request_id(), entered)
                waited = self.worker.submit(decoding)
                self.metrics.observe("triton_diffusion_lm_admission_wait_seconds", waited)
            except RequestError as error:
                self._fail(sender, error)
            except Exception as exc:  # noqa: BLE001  (every request must still get its FINAL response)
                log.exception("could not admit request %s", request.request_id())
                self._fail(sender, RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        return None

    def finalize(self) -> None:
        self.worker.close()  # requests still held get UNAVAILABLE
        log.info("%s unloaded", self.settings.name)

    # ---- requests ---------------------------------------------------------------------------------
    def parse(self, raw: dict[str, Any], sender: Any, request_id: str, entered: float) -> DecodingRequest:
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
        stream = ResponseStream(sender, request_id, values["prompt"], seed, entered)
        return DecodingRequest(stream, prompt, params, generator, self.lm.mask_id, self.lm.eos_ids)

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

    def _fail(self, sender: Any, error: RequestError) -> None:
        from triton_diffusion.serving.triton_io import send_error

        self.metrics.increment("triton_diffusion_requests_failed_total", code=error.code.value)
        send_error(sender, error)

    # ---- engine listener (called on the engine's thread) -------------------------------------------
    def is_cancelled(self, request: DecodingRequest) -> bool:
        return request.handle.sender.is_cancelled()

    def on_block(self, request: DecodingRequest) -> None:
        from triton_diffusion.serving.triton_io import send_partial

        stream: ResponseStream = request.handle
        if not stream.first_block_seen:
            stream.first_block_seen = True
            waited = time.perf_counter() - stream.entered
            self.metrics.observe("triton_diffusion_lm_first_block_seconds", waited)
        tokens = request.tokens()
        text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
        new_text, stream.text = _new_text(stream.text, text)
        send_partial(
            stream.sender,
            {
                "TEXT": _array(new_text.encode(), object),
                "BLOCK": _array(request.block_index - 1, np.int32),
                "TOKENS": _array(len(tokens), np.int32),
            },
        )

    def on_finished(self, request: DecodingRequest) -> None:
        from triton_diffusion.serving.triton_io import send_final

        stream: ResponseStream = request.handle
        tokens = request.tokens()
        text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
        self.metrics.increment("triton_diffusion_lm_tokens_total", len(tokens))
        send_final(
            stream.sender,
            {
                "TEXT": _array(text.encode(), object),
                "BLOCK": _array(request.block_index, np.int32),
                "TOKENS": _array(len(tokens), np.int32),
                "STEPS": _array(request.steps_used, np.int32),
                "SEED": _array(stream.seed, np.int64),
            },
        )
        log.info(
            "request %s finished: %d tokens, %d blocks, %d steps, joined at forward %s",
            stream.request_id,
            len(tokens),
            request.block_index,
            request.steps_used,
            request.joined_at_forward,
        )

    def on_cancelled(self, request: DecodingRequest) -> None:
        stream: ResponseStream = request.handle
        total = request.params.steps
        log.info("request %s cancelled after step %d/%d", stream.request_id, request.steps_used, total)
        self.metrics.increment("triton_diffusion_lm_requests_cancelled_total")
        self._fail(
            stream.sender,
            RequestError(ErrorCode.CANCELLED, f"cancelled after step {request.steps_used}/{total}"),
        )

    def on_failed(self, request: DecodingRequest, error: RequestError) -> None:
        self._fail(request.handle.sender, error)

    def on_forward(self, rows: int, requests: int, seconds: float) -> None:
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
