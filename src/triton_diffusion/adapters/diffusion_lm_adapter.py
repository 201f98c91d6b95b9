"""The diffusion LM's step adapter: masked diffusion decoding in the shared step engine.

Each job is one request (:class:`DecodingRequest`: its tokens so far, its own block/step schedule and
generator). One step pads the rows of every job in the forward into one batch, runs the model once, and
lets :func:`masked_diffusion.commit_blocks` step every request on its own slice of the logits with its
own generator, so the tokens are exactly those of :func:`masked_diffusion.generate_reference` run alone.
One request may be at step 1 of its first block while another finishes its last.

Models whose logits depend on padding (LLaDA's published code ignores ``attention_mask``; the loader's
probe finds out) get ``group_by_length``: only rows of equal length share a forward, unpadded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.nn.utils.rnn import pad_sequence

from triton_diffusion.adapters.masked_diffusion import (
    DecodeParams,
    commit_blocks,
    finished_text_tokens,
    guided_logits,
    transfer_schedule,
)
from triton_diffusion.engine.jobs import ForwardResult, Job, JobStart, JobStep

# input_ids, attention_mask, position_ids (all [rows, length]) and keep [rows, k]
#   -> logits at the kept positions [rows, k, vocab]
PaddedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class DecodingRequest:
    """One request in the engine: its tokens so far and where it is in its own schedule."""

    prompt: torch.Tensor  # [prompt_length] token ids
    params: DecodeParams
    generator: torch.Generator
    mask_id: int
    eos_ids: tuple[int, ...] = ()
    x: torch.Tensor = field(init=False)
    block_index: int = 0
    step_in_block: int = 0
    steps_used: int = 0
    finished: bool = False
    new_block: bool = False  # the last step completed a block (streamed as a partial response)

    def __post_init__(self) -> None:
        mask = torch.full((self.params.gen_length,), self.mask_id, dtype=self.prompt.dtype)
        self.x = torch.cat([self.prompt, mask])
        self._schedule = transfer_schedule(self.params.block_length, self.params.steps_per_block)

    @property
    def prompt_length(self) -> int:
        return self.prompt.shape[0]

    @property
    def rows(self) -> int:
        return 2 if self.params.cfg_scale > 0 else 1

    def block_bounds(self) -> tuple[int, int]:
        start = self.prompt_length + self.block_index * self.params.block_length
        return start, start + self.params.block_length

    def row_tokens(self) -> list[torch.Tensor]:
        """The rows this request adds to the next forward: the sequence, and with CFG the same sequence
        with its prompt masked."""
        if self.params.cfg_scale == 0:
            return [self.x]
        unconditional = self.x.clone()
        unconditional[: self.prompt_length] = self.mask_id
        return [self.x, unconditional]

    def scheduled(self) -> int:
        """How many tokens the next step commits (at least)."""
        return self._schedule[self.step_in_block]

    def current_block(self) -> torch.Tensor:
        start, end = self.block_bounds()
        return self.x[start:end]

    def advance(self, block: torch.Tensor) -> bool:
        """Take the current block as one step left it. Returns True when the step completed it."""
        start, end = self.block_bounds()
        self.x[start:end] = block
        self.steps_used += 1
        self.new_block = False
        self.step_in_block += 1
        if bool((self.x[start:end] == self.mask_id).any()):
            return False
        self.block_index += 1
        self.step_in_block = 0
        self.new_block = True
        stopped = self.params.stop_at_eos and any(int(t) in self.eos_ids for t in self.x[start:end])
        self.finished = stopped or self.block_index == self.params.num_blocks
        return True

    def generated(self) -> torch.Tensor:
        """The tokens of the completed blocks."""
        return self.x[self.prompt_length : self.prompt_length + self.block_index * self.params.block_length]

    def tokens(self) -> list[int]:
        """Completed tokens up to the first EOS: what the text is made of."""
        return finished_text_tokens(self.generated(), self.eos_ids)


def decoding(held: object) -> DecodingRequest:
    """A job's params and its state (the same request, the model's): the engine holds them as ``object``
    (a cast: no check at run time, as before)."""
    return cast(DecodingRequest, held)


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor  # [rows]: where each row's first real token sits


def pad_rows(rows: Sequence[torch.Tensor], pad_id: int, side: str = "left") -> PaddedBatch:
    """Pad rows of different lengths into one batch. Positions count from each row's first real token, so
    a row sees the same positions as it would alone; the attention mask hides the padding."""
    lengths = torch.tensor([row.shape[0] for row in rows])
    input_ids = pad_sequence(list(rows), batch_first=True, padding_value=pad_id, padding_side=side)
    length = input_ids.shape[1]
    starts = length - lengths if side == "left" else torch.zeros_like(lengths)
    positions = torch.arange(length).unsqueeze(0) - starts.unsqueeze(1)
    attention_mask = ((positions >= 0) & (positions < lengths.unsqueeze(1))).long()
    return PaddedBatch(input_ids, attention_mask, positions.clamp(min=0) * attention_mask, starts)


def block_positions(batch: PaddedBatch, bounds: Sequence[tuple[int, int]], width: int) -> torch.Tensor:
    """[rows, width]: where each row's current block sits in the padded batch; a block shorter than
    ``width`` repeats its last position."""
    begins = torch.tensor([begin for begin, _ in bounds]).unsqueeze(1)
    ends = torch.tensor([end for _, end in bounds]).unsqueeze(1)
    within = torch.minimum(begins + torch.arange(width).unsqueeze(0), ends - 1)
    return batch.starts.unsqueeze(1) + within


class DiffusionLMAdapter:
    """The engine's step adapter for masked diffusion LMs. A job's ``params`` is its DecodingRequest."""

    def __init__(
        self,
        forward: PaddedForward,
        pad_id: int,
        padding_side: str = "left",
        device: str = "cpu",
        group_by_length: bool = False,
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.forward = forward
        self.pad_id = pad_id
        self.padding_side = padding_side
        self.device = device
        self.group_by_length = group_by_length

    def prepare(self, jobs: list[Job]) -> list[JobStart]:
        starts = []
        for job in jobs:
            request = decoding(job.spec.params)
            group = int(request.x.shape[0]) if self.group_by_length else None
            starts.append(JobStart(request, group, request.params.steps))
        return starts

    @staticmethod
    def snapshot(request: DecodingRequest) -> tuple[list[int], int, bool] | None:
        """After a step that completed a block: the text's tokens so far, the block's index and whether it
        is the request's last."""
        if not request.new_block:
            return None
        return request.tokens(), request.block_index - 1, request.finished

    def step(self, jobs: list[Job], previews: Sequence[bool] | None = None) -> ForwardResult:
        """One padded forward for every job, then one commit step each; a job is done when its request
        finished (its last block, or an EOS), which may be before its planned steps."""
        requests = [decoding(job.state) for job in jobs]
        rows = [row for request in requests for row in request.row_tokens()]
        batch = pad_rows(rows, self.pad_id, self.padding_side)
        # Logits are needed at each row's current block only.
        width = max(request.params.block_length for request in requests)
        bounds = [request.block_bounds() for request in requests for _ in range(request.rows)]
        keep = block_positions(batch, bounds, width)
        logits = self.forward(
            batch.input_ids.to(self.device),
            batch.attention_mask.to(self.device),
            batch.position_ids.to(self.device),
            keep.to(self.device),
        )
        blocks = self._commit(requests, logits, width)
        steps = []
        for job, request, block in zip(jobs, requests, blocks, strict=True):
            request.advance(block[: request.params.block_length])
            step = job.run.steps_done + 1
            snapshot = self.snapshot(request)
            steps.append(JobStep(step, request.finished, rows_computed=request.rows, snapshot=snapshot))
        return ForwardResult(steps, rows=len(rows))

    def finish(self, jobs: list[Job]) -> list[DecodingRequest]:
        return [decoding(job.state) for job in jobs]

    def _commit(self, requests: list[DecodingRequest], logits: torch.Tensor, width: int) -> torch.Tensor:
        """One step for every request of the forward; ``logits`` [rows, width, vocab] in row order."""
        first_rows, row = [], 0
        for request in requests:
            first_rows.append(row)
            row += request.rows
        cfg = [i for i, request in enumerate(requests) if request.params.cfg_scale > 0]
        guided = logits[first_rows]
        if cfg:
            conditional = torch.tensor([first_rows[i] for i in cfg])
            scales = torch.tensor([requests[i].params.cfg_scale for i in cfg])
            guided[cfg] = guided_logits(logits[conditional], logits[conditional + 1], scales)
        blocks = torch.full((len(requests), width), -1, dtype=torch.long)
        for i, request in enumerate(requests):
            blocks[i, : request.params.block_length] = request.current_block()
        committed = commit_blocks(
            guided,
            blocks.to(logits.device),
            requests[0].mask_id,
            [r.scheduled() for r in requests],
            [r.params for r in requests],
            [r.generator for r in requests],
        )
        return committed.cpu()


def padding_changes_logits(
    forward: PaddedForward, pad_id: int, padding_side: str, vocab_size: int, device: str = "cpu"
) -> bool:
    """Probe at load time whether a row's logits change when it is padded next to a longer row (LLaDA's
    published code calls attention with no mask, so its padding leaks into every row). Returns True when
    they change by more than batch-size rounding: then only rows of equal length may share a forward."""
    ids = torch.arange(5, 5 + 14) % vocab_size
    short, long = ids[:6], ids
    alone = pad_rows([short], pad_id, padding_side)
    keep_alone = block_positions(alone, [(0, 6)], 6)
    batch = pad_rows([short, long], pad_id, padding_side)
    keep_batch = block_positions(batch, [(0, 6), (0, 6)], 6)

    def run(padded: PaddedBatch, keep: torch.Tensor) -> torch.Tensor:
        tensors = (padded.input_ids, padded.attention_mask, padded.position_ids, keep)
        return forward(*(t.to(device) for t in tensors))[0].float().cpu()

    with torch.inference_mode():
        reference, padded = run(alone, keep_alone), run(batch, keep_batch)
    scale = reference.abs().max().clamp_min(1e-6)
    # fp32 batch-size rounding is ~1e-6 of the scale and bf16's ~1e-2; ignored padding is far above.
    return bool((reference - padded).abs().max() / scale > 0.05)
