"""Masked diffusion decoding (LLaDA's ``generate``), one request at a time.

The working sequence is the prompt followed by ``gen_length`` mask tokens, decoded in blocks of
``block_length``; ``steps`` are spread evenly over the blocks. At each step the model sees the whole
sequence (bidirectional attention) and :func:`commit` fills some masked positions of the current block.

Everything here is per request. The batched engine (``dllm_engine``) calls the same :func:`commit` on
its own slice of a shared forward; :func:`generate_reference` is the plain one-request loop it must match
token for token. Noise is drawn for the current block only: no other position can be committed in this
step, so this changes nothing but the cost (LLaDA draws it for the whole sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from triton_diffusion.errors import invalid_field

REMASKING = ("low_confidence", "random")

# input_ids [rows, length] -> logits [rows, length, vocab]; no padding in the reference.
Forward = Callable[[torch.Tensor], torch.Tensor]


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


def add_gumbel_noise(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """LLaDA's sampling noise, in float64 (low precision Gumbel noise hurts generation quality)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return logits.exp() / (-torch.log(noise)) ** temperature


def guided_logits(rows: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """One request's logits from its rows: the conditional row, or ``un + (s + 1) * (cond - un)``."""
    if cfg_scale == 0:
        return rows[0]
    cond, uncond = rows[0], rows[1]
    return uncond + (cfg_scale + 1) * (cond - uncond)


def commit(
    logits: torch.Tensor,
    block: torch.Tensor,
    mask_id: int,
    scheduled: int,
    params: DecodeParams,
    generator: torch.Generator,
) -> torch.Tensor:
    """One denoising step on one block: ``logits`` [block_length, vocab], ``block`` [block_length] token
    ids. Returns the block with the chosen masked positions filled in.

    Commits ``scheduled`` positions (the most confident, or random ones); with ``threshold`` also every
    position above it, at least one. The schedule stays a floor, so a block never takes more steps than
    its share; the threshold only lets it finish sooner.
    """
    masked = block == mask_id
    # The mask token is in the vocabulary; predicting it would commit nothing (and stall the block).
    logits = logits.clone()
    logits[:, mask_id] = -math.inf
    x0 = add_gumbel_noise(logits, params.temperature, generator).argmax(dim=-1)
    if params.remasking == "low_confidence":
        probabilities = F.softmax(logits.to(torch.float64), dim=-1)
        confidence = probabilities.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence = torch.rand(x0.shape, generator=generator, dtype=torch.float64, device=x0.device)
    confidence = torch.where(masked, confidence, -math.inf)
    available = int(masked.sum())
    count = scheduled
    if params.threshold is not None:
        count = max(count, int((confidence > params.threshold).sum()), 1)
    count = min(count, available)
    chosen = torch.topk(confidence, count).indices
    out = block.clone()
    out[chosen] = x0[chosen]
    return out


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
            logits = guided_logits(forward(rows)[:, start:end], params.cfg_scale)
            x[start:end] = commit(logits, x[start:end], mask_id, scheduled, params, generator)
            steps_used += 1
        blocks += 1
        if params.stop_at_eos and any(int(t) in eos_ids for t in x[length:end]):
            break
    generated = x[length : length + blocks * params.block_length]
    return DecodeResult(finished_text_tokens(generated, eos_ids), steps_used, blocks)
