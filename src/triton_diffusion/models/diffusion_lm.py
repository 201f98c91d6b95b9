"""The diffusion language model on Triton: requests go to the shared step engine (continuous batching).

``execute()`` reads and validates each request and hands it to the engine host (serving/engine_host.py),
whose engine thread runs one shared forward per step for every running request
(adapters/diffusion_lm_adapter.py). ``execute()`` returns once its requests are admitted; it blocks while
the running set and the waiting room are full. Each completed block is streamed as a partial TEXT response
(unless ``stream`` is false); the FINAL response carries the whole text, the token count and the steps used.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np
import torch

from triton_diffusion.adapters.diffusion_lm_adapter import (
    DecodingRequest,
    DiffusionLMAdapter,
    decoding,
    padding_changes_logits,
)
from triton_diffusion.adapters.masked_diffusion import DecodeParams
from triton_diffusion.adapters.masked_lm import LoadedMaskedLM, load_masked_lm, prompt_token_ids
from triton_diffusion.engine.jobs import JobSpec, Stepped
from triton_diffusion.errors import invalid_field
from triton_diffusion.fields import (
    FieldSet,
)
from triton_diffusion.models.interfaces import DIFFUSION_LM_FIELDS, DIFFUSION_LM_OUTPUTS
from triton_diffusion.recovery.resumes import seed_from_key
from triton_diffusion.serving.engine_host import RequestRecord
from triton_diffusion.serving.engines import StepEngineKind
from triton_diffusion.serving.metrics import DIFFUSION_LM_FAMILIES, DIFFUSION_LM_METRICS, BatchingMetrics
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.triton_model import Hosting, Urgency, urgency_of
from triton_diffusion.settings import LM, ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class ParsedGeneration:
    """A validated request: its decoding state to be, the seed used and whether blocks are streamed; its
    one job (``jobs``) decided."""

    prompt: str
    decoding: DecodingRequest
    seed: int
    stream: bool
    service: Urgency = Urgency()
    # Nothing the host keeps: a generation is never cached, and has no checkpoints (its resume_key only
    # draws its seed, so a resend samples the same text).
    values: Mapping[str, Any] = field(default_factory=dict)
    result_key: None = None
    resume_key: None = None

    @property
    def jobs(self) -> tuple[JobSpec, ...]:
        params = self.decoding.params
        return (
            JobSpec(
                self.decoding,
                tier=self.service.tier,
                deadline=self.service.deadline,
                planned_steps=params.steps,
            ),
        )

    @property
    def progress(self) -> bool:
        return self.stream

    @property
    def summary(self) -> str:
        return f"{len(self.decoding.prompt)} prompt tokens, {self.decoding.params.gen_length} to generate"


def _array(value: Any, dtype: Any) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


class DiffusionLMModel:
    """The diffusion language model, a model kind (serving/triton_model.py ``ModelKind``): one job per
    request, its blocks decoded on the step engine."""

    KIND: ClassVar[str] = "text_generation"
    FIELDS: ClassVar[FieldSet] = DIFFUSION_LM_FIELDS
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]] = DIFFUSION_LM_OUTPUTS
    METRIC_FAMILIES: ClassVar[dict[str, tuple[str, str]]] = DIFFUSION_LM_FAMILIES
    CONFIG_KINDS: ClassVar[tuple[str, ...]] = (LM,)

    fields: FieldSet

    def setup(self, settings: ModelSettings, metrics: BatchingMetrics) -> Hosting:
        self.settings, self.metrics = settings, metrics
        config = settings.config
        if config.intra_op_threads is not None:
            # Each model runs in its own stub process; on a small CPU shared with Triton's own threads,
            # fewer torch threads can be faster.
            torch.set_num_threads(config.intra_op_threads)
        self.lm: LoadedMaskedLM = load_masked_lm(settings)
        self.fields = self.FIELDS.configured(settings.field_params)
        if self.fields["apply_chat_template"].default and not self.lm.tokenizer.chat_template:
            raise ValueError(
                f"model {settings.name}: default_apply_chat_template is set, but the tokenizer "
                "has no chat template"
            )
        self.max_prompt_tokens = config.max_prompt_tokens
        forward, side = self.lm.forward, self.lm.forward.padding_side
        # A model that ignores the attention mask (LLaDA's published code) must never see padding.
        unpadded = padding_changes_logits(forward, self.lm.pad_id, side, self.lm.vocab_size, self.lm.device)
        adapter = DiffusionLMAdapter(forward, self.lm.pad_id, side, self.lm.device, unpadded)
        engine_kind = StepEngineKind(adapter)
        log.info(
            "%s ready: max_running=%d padding=%s mask_id=%d eos_ids=%s device=%s",
            settings.name,
            settings.resolved("max_running", "step"),
            "none (the model ignores its attention mask: equal lengths share forwards)" if unpadded else side,
            self.lm.mask_id,
            list(self.lm.eos_ids),
            self.lm.device,
        )
        return Hosting(engine_kind, DIFFUSION_LM_METRICS)

    # ---- requests ---------------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedGeneration:
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
        seed = values["seed"]
        if seed is None:  # a resend with its key draws the same seed, so it generates the same blocks again
            key = values.get("resume_key")
            seed = seed_from_key(key) if key else random.randrange(2**32)
        generator = torch.Generator(device=self.lm.device).manual_seed(seed)
        decoding = DecodingRequest(prompt, params, generator, self.lm.mask_id, self.lm.eos_ids)
        service = urgency_of(values, tracked, self.settings.config, self.fields)
        return ParsedGeneration(values["prompt"], decoding, seed, values["stream"], service)

    def describe_more(self) -> dict[str, Any]:
        return {}

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

    # ---- the host's model kind (progress and outputs on the response thread, in order) ---------------
    def progress_outputs(self, record: RequestRecord, stepped: Stepped) -> Mapping[str, Any] | None:
        # DiffusionLMAdapter.snapshot's: the text's tokens so far, the block's index and whether it is the
        # last, or None.
        snapshot = cast("tuple[list[int], int, bool] | None", stepped.snapshot)
        if snapshot is None:
            return None  # no block completed at this step
        tokens, block, last = snapshot
        # Before the last block, only the text the last token of text leaves as it was goes: a token after
        # it may change how it decodes (the tokenizer's clean-up joins " '" and "s" as "'s"), so it waits.
        # (Special tokens after it decode to nothing: the last one that decodes to text waits.)
        tokenizer = self.lm.tokenizer
        stable = whole = tokenizer.decode(tokens, skip_special_tokens=True)
        if not last:
            special, k = set(getattr(tokenizer, "all_special_ids", ())), len(tokens)
            while k and tokens[k - 1] in special:
                k -= 1
            before = tokenizer.decode(tokens[: max(k - 1, 0)], skip_special_tokens=True)
            stable = whole[: len(os.path.commonprefix([whole, before]))]
        new_text, record.state = _new_text(record.state or "", stable)  # the text streamed so far
        return {
            "TEXT": _array(new_text.encode(), object),
            "BLOCK": _array(block, np.int32),
            "TOKENS": _array(len(tokens), np.int32),
        }

    def final_outputs(
        self, record: RequestRecord, outputs: list[object], reported: dict[str, Any]
    ) -> Mapping[str, Any]:
        (held,) = outputs
        output = decoding(held)  # its one request (DiffusionLMAdapter.finish)
        parsed = cast(ParsedGeneration, record.parsed)  # this kind's parse made it
        tokens = output.tokens()
        text = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
        self.metrics.increment("triton_diffusion_lm_tokens_total", len(tokens))
        return {
            "TEXT": _array(text.encode(), object),
            "BLOCK": _array(output.block_index, np.int32),
            "TOKENS": _array(len(tokens), np.int32),
            "STEPS": _array(output.steps_used, np.int32),
            "SEED": _array(parsed.seed, np.int64),
            "PROMPT_TOKENS": _array(len(parsed.decoding.prompt), np.int32),
            "FINISH_REASON": _array(finish_reason(output).encode(), object),
        }


def finish_reason(output: DecodingRequest) -> str:
    """Why generation stopped (OpenAI's words): "length" when all gen_length tokens were generated,
    "stop" when an EOS ended the text first."""
    return "length" if len(output.tokens()) >= output.params.gen_length else "stop"


def _new_text(sent: str, text: str) -> tuple[str, str]:
    """What ``text`` adds to what was already streamed, and the streamed text after it: a client appends
    each block's text, so only text that extends what it has goes. A trailing replacement character may be
    half of a multi-byte character: it waits for the next block. Should more tokens have changed text
    already streamed, nothing goes until the text extends it again; the FINAL response has the whole
    text."""
    text = text.rstrip("\ufffd")
    if not text.startswith(sent):
        return "", sent
    return text[len(sent) :], text
