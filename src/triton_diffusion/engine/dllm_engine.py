"""Step-level continuous batching for masked diffusion LMs.

A running set of up to ``max_running`` requests shares one padded forward per step. Every request keeps
its own schedule (block, step in block, generator): one may be at step 1 of its first block while another
finishes its last. A request added while others run joins at the next step; a finished or cancelled one
leaves at once, so nobody waits for the slowest row. :class:`EngineWorker` runs the engine on its own
thread, fed by Triton's ``execute()``, with bounded admission.

After the forward, :func:`masked_diffusion.commit_blocks` steps every request on its own slice of the
logits with its own generator, so the tokens are exactly those of
:func:`masked_diffusion.generate_reference` run alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn.utils.rnn import pad_sequence

from triton_diffusion.adapters.masked_diffusion import (
    DecodeParams,
    commit_blocks,
    finished_text_tokens,
    guided_logits,
    transfer_schedule,
)
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# input_ids, attention_mask, position_ids (all [rows, length]) and keep [rows, k]
#   -> logits at the kept positions [rows, k, vocab]
PaddedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class DecodingRequest:
    """One request in the engine: its tokens so far and where it is in its own schedule."""

    handle: Any  # what the listener needs to answer it (a Triton response sender, a test's label)
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
    joined_at_forward: int | None = None  # the engine forward this request first took part in

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
        self.step_in_block += 1
        if bool((self.x[start:end] == self.mask_id).any()):
            return False
        self.block_index += 1
        self.step_in_block = 0
        stopped = self.params.stop_at_eos and any(int(t) in self.eos_ids for t in self.x[start:end])
        self.finished = stopped or self.block_index == self.params.num_blocks
        return True

    def generated(self) -> torch.Tensor:
        """The tokens of the completed blocks."""
        return self.x[self.prompt_length : self.prompt_length + self.block_index * self.params.block_length]

    def tokens(self) -> list[int]:
        """Completed tokens up to the first EOS: what the text is made of."""
        return finished_text_tokens(self.generated(), self.eos_ids)


class EngineListener(Protocol):
    """How the engine reports; the Triton model answers requests here, tests record."""

    def is_cancelled(self, request: DecodingRequest) -> bool: ...

    def on_block(self, request: DecodingRequest) -> None: ...  # a block just completed

    def on_finished(self, request: DecodingRequest) -> None: ...

    def on_cancelled(self, request: DecodingRequest) -> None: ...

    def on_failed(self, request: DecodingRequest, error: RequestError) -> None: ...

    def on_forward(self, rows: int, requests: int, seconds: float) -> None: ...  # one step, forward and all


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


class ContinuousBatchEngine:
    """The running set and one shared forward per :meth:`step`. Not thread-safe: one thread steps it."""

    def __init__(
        self,
        forward: PaddedForward,
        listener: EngineListener,
        pad_id: int,
        max_running: int,
        padding_side: str = "left",
        device: str = "cpu",
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.forward = forward
        self.listener = listener
        self.pad_id = pad_id
        self.max_running = max_running
        self.padding_side = padding_side
        self.device = device
        self.waiting: deque[DecodingRequest] = deque()
        self.running: list[DecodingRequest] = []
        self.forwards = 0  # shared forwards so far

    def add(self, request: DecodingRequest) -> None:
        self.waiting.append(request)

    @property
    def active(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self) -> None:
        """Admit waiting requests, drop cancelled ones, run one forward, advance every running request."""
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        for request in [r for r in self.running if self.listener.is_cancelled(r)]:
            self.running.remove(request)
            self.listener.on_cancelled(request)
        if not self.running:
            return
        in_forward = list(self.running)
        rows = [row for request in in_forward for row in request.row_tokens()]
        batch = pad_rows(rows, self.pad_id, self.padding_side)
        # Logits are needed at each row's current block only.
        width = max(request.params.block_length for request in in_forward)
        bounds = [request.block_bounds() for request in in_forward for _ in range(request.rows)]
        keep = block_positions(batch, bounds, width)
        started = time.perf_counter()
        logits = self.forward(
            batch.input_ids.to(self.device),
            batch.attention_mask.to(self.device),
            batch.position_ids.to(self.device),
            keep.to(self.device),
        )
        self.forwards += 1
        blocks = self._commit(in_forward, logits, width)
        for request, block in zip(in_forward, blocks, strict=True):
            if request.joined_at_forward is None:
                request.joined_at_forward = self.forwards
            if request.advance(block[: request.params.block_length]):
                self.listener.on_block(request)
            if request.finished:
                self.running.remove(request)
                self.listener.on_finished(request)
        self.listener.on_forward(len(rows), len(in_forward), time.perf_counter() - started)

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

    def fail_all(self, error: RequestError) -> None:
        """Answer every running and waiting request with ``error`` and forget them."""
        ended = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        for request in ended:
            self.listener.on_failed(request, error)


class EngineWorker:
    """Runs a :class:`ContinuousBatchEngine` on its own thread.

    :meth:`submit` is called from Triton's ``execute()`` and blocks while the running set and the waiting
    room are full, so the rest stays in Triton's queue (where its queue policy applies). A forward that
    raises fails the requests it held, each with one FINAL error; the thread goes on with the next ones.
    """

    def __init__(self, engine: ContinuousBatchEngine, waiting_room: int) -> None:
        self.engine = engine
        self.capacity = engine.max_running + waiting_room
        self._condition = threading.Condition()
        self._incoming: deque[DecodingRequest] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="dllm-engine", daemon=True)
        self._thread.start()

    def _in_system(self) -> int:
        return self.engine.active + len(self._incoming)

    def submit(self, request: DecodingRequest) -> float:
        """Hand a request to the engine; blocks while full. Returns the seconds it waited for room."""
        started = time.perf_counter()
        with self._condition:
            while self._in_system() >= self.capacity and not self._closed:
                self._condition.wait()
            if self._closed:
                raise RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down")
            self._incoming.append(request)
            self._condition.notify_all()
        return time.perf_counter() - started

    def close(self, timeout_s: float = 30.0) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                while self._next_round():
                    try:
                        self.engine.step()
                    except Exception as exc:  # noqa: BLE001  (each held request still gets a FINAL)
                        log.exception("diffusion LM step failed")
                        self.engine.fail_all(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            with self._condition:
                self.engine.waiting.extend(self._incoming)
                self._incoming.clear()
                self._closed = True
                self._condition.notify_all()
            self.engine.fail_all(RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down"))

    def _next_round(self) -> bool:
        """Wait for work; move submitted requests into the engine. False once closed."""
        with self._condition:
            self._condition.notify_all()  # the last step may have made room
            while not self._closed and not self._incoming and not self.engine.active:
                self._condition.wait()
            if self._closed:
                return False
            while self._incoming:
                self.engine.add(self._incoming.popleft())
            return True
