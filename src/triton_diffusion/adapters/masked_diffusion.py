"""Masked diffusion decoding (LLaDA's ``generate``), one request at a time.

The working sequence is the prompt followed by ``gen_length`` mask tokens, decoded in blocks of
``block_length``; ``steps`` are spread evenly over the blocks. At each step the model sees the whole
sequence (bidirectional attention) and :func:`commit` fills some masked positions of the current block.

:func:`commit_blocks` is one step for any number of requests, each with its own block, schedule and
generator. The step engine (through ``diffusion_lm_adapter``) calls it on the slices of a shared forward;
:func:`generate_reference` is the plain one-request loop the engine must match token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from triton_diffusion.adapters.remasking import REMASKING
from triton_diffusion.errors import invalid_field

# input_ids [rows, length], positions [rows, k] -> logits at those positions [rows, k, vocab]; no padding.
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecodeParams:
    gen_length: int
    block_length: int
    steps: int
    temperature: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None  # Fast-dLLM: also commit every position more confident than this
    cfg_scale: float = 0.0  # > 0 adds an unconditional row (prompt masked) to every forward
    stop_at_eos: bool = True  # stop after a block that holds an EOS token

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def check(self) -> None:
        """The rules between fields, as INVALID_ARG errors that name the field and what is allowed."""
        if self.gen_length % self.block_length:
            divisors = [d for d in range(1, self.gen_length + 1) if self.gen_length % d == 0]
            raise invalid_field(
                "block_length",
                f"gen_length {self.gen_length} is not a multiple of block_length {self.block_length} "
                f"(allowed block_length for this gen_length: {_listing(divisors)})",
            )
        if self.steps % self.num_blocks:
            raise invalid_field(
                "steps",
                f"got {self.steps}, not divisible by the {self.num_blocks} blocks "
                f"(gen_length {self.gen_length} / block_length {self.block_length}); "
                f"allowed: a multiple of {self.num_blocks}",
            )
        if self.steps > self.gen_length:
            raise invalid_field(
                "steps",
                f"got {self.steps}, more than gen_length {self.gen_length} (every step commits at "
                f"least one token; allowed: {self.num_blocks}..{self.gen_length} in multiples of "
                f"{self.num_blocks})",
            )
        if self.remasking not in REMASKING:
            raise invalid_field("remasking", f"got {self.remasking!r} (allowed: one of {REMASKING})")


def _listing(values: list[int]) -> str:
    return ", ".join(map(str, values)) if len(values) <= 12 else ", ".join(map(str, values[:12])) + ", ..."


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """How many tokens each step of a fully masked block commits (LLaDA's get_num_transfer_tokens):
    an even split, the remainder going to the first steps."""
    base, remainder = divmod(block_length, steps)
    return [base + 1] * remainder + [base] * (steps - remainder)


def guided_logits(cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance for n requests: ``un + (s + 1) * (cond - un)``; [n, k, vocab] logits of
    the conditional rows and of the rows with the prompt masked, [n] scales."""
    scale = cfg_scale.to(device=cond.device, dtype=cond.dtype).view(-1, 1, 1)
    return uncond + (scale + 1) * (cond - uncond)


def commit_blocks(
    logits: torch.Tensor,
    blocks: torch.Tensor,
    mask_id: int,
    scheduled: Sequence[int],
    params: Sequence[DecodeParams],
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """One denoising step for n requests, each on its own current block: ``logits`` [n, k, vocab] and
    ``blocks`` [n, k] token ids (a block shorter than k is padded with -1). Returns the blocks with the
    chosen masked positions filled in.

    Request i commits ``scheduled[i]`` positions: the most confident, or random ones; with a
    ``threshold`` also every position above it, at least one. The schedule stays a floor, so a block
    never takes more steps than its share; the threshold only lets it finish sooner.

    Sampling uses Gumbel noise in float64 from each request's own generator. LLaDA writes
    ``exp(logits) / (-log u) ** T``; its logarithm ``logits - T * log(-log u)`` has the same argmax for
    the same ``u``, cannot overflow and skips a float64 ``pow`` per vocabulary entry. Noise is drawn for
    the current block only: no other position can be committed in this step.
    """
    n, k, vocab = logits.shape
    masked = blocks == mask_id
    logits = logits.to(torch.float64, copy=True)
    # The mask token is in the vocabulary; predicting it would commit nothing (and stall the block).
    logits[..., mask_id] = -math.inf
    scores = logits.clone()
    random_confidence: dict[int, torch.Tensor] = {}
    for i, (request, generator) in enumerate(zip(params, generators, strict=True)):
        width = request.block_length
        if request.temperature > 0:
            u = torch.rand((width, vocab), generator=generator, dtype=torch.float64, device=logits.device)
            scores[i, :width] -= request.temperature * torch.log(-torch.log(u))
        if request.remasking == "random":
            random_confidence[i] = torch.rand(
                (width,), generator=generator, dtype=torch.float64, device=logits.device
            )
    x0 = scores.argmax(dim=-1)
    confidence = F.softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    for i, values in random_confidence.items():
        confidence[i, : values.shape[0]] = values
    confidence = torch.where(masked, confidence, -math.inf)

    counts = torch.tensor(list(scheduled), device=logits.device)
    thresholds = [math.inf if r.threshold is None else r.threshold for r in params]
    above = (confidence > torch.tensor(thresholds, device=logits.device).unsqueeze(1)).sum(dim=1)
    with_threshold = torch.tensor([r.threshold is not None for r in params], device=logits.device)
    counts = torch.where(
        with_threshold, torch.maximum(torch.maximum(counts, above), torch.ones_like(counts)), counts
    )
    counts = torch.minimum(counts, masked.sum(dim=1))
    # The counts[i] most confident positions of row i: rank every position, keep ranks below the count.
    order = confidence.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(k, device=logits.device).expand(n, k))
    return torch.where(rank < counts.unsqueeze(1), x0, blocks)


def finished_text_tokens(generated: torch.Tensor, eos_ids: Sequence[int]) -> list[int]:
    """The generated tokens up to (not including) the first EOS."""
    tokens = generated.tolist()
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return tokens


@dataclass(frozen=True)
class DecodeResult:
    tokens: list[int]  # generated tokens up to the first EOS
    steps_used: int  # forwards this request needed
    blocks: int  # blocks decoded (fewer than num_blocks after an EOS stop)


@torch.no_grad()
def generate_reference(
    forward: Forward,
    prompt: torch.Tensor,
    params: DecodeParams,
    mask_id: int,
    generator: torch.Generator,
    eos_ids: Sequence[int] = (),
) -> DecodeResult:
    """The algorithm for one request with nothing else around it: no padding, no batching."""
    params.check()
    length = prompt.shape[0]
    x = torch.cat([prompt, torch.full((params.gen_length,), mask_id, dtype=prompt.dtype)])
    steps_used = 0
    blocks = 0
    for block_index in range(params.num_blocks):
        start = length + block_index * params.block_length
        end = start + params.block_length
        for scheduled in transfer_schedule(params.block_length, params.steps_per_block):
            if not bool((x[start:end] == mask_id).any()):
                break  # the threshold filled the block early
            rows = x.unsqueeze(0)
            if params.cfg_scale > 0:
                unconditional = x.clone()
                unconditional[:length] = mask_id
                rows = torch.stack([x, unconditional])
            positions = torch.arange(start, end).expand(rows.shape[0], -1)
            logits = forward(rows, positions)
            if params.cfg_scale > 0:
                logits = guided_logits(logits[:1], logits[1:], torch.tensor([params.cfg_scale]))
            block = x[start:end].unsqueeze(0).to(logits.device)
            block = commit_blocks(logits, block, mask_id, [scheduled], [params], [generator])
            x[start:end] = block[0].to(x.device)
            steps_used += 1
        blocks += 1
        if params.stop_at_eos and any(int(t) in eos_ids for t in x[length:end]):
            break
    generated = x[length : length + blocks * params.block_length]
    return DecodeResult(finished_text_tokens(generated, eos_ids), steps_used, blocks)
