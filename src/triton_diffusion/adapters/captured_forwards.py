"""Graph-captured denoiser forwards on a GPU (config ``cuda_graphs``).

A step of a small model at a few rows is bound by kernel launches, not by the GPU's arithmetic: replaying
a CUDA graph launches the whole forward at once. A graph is fixed in its shapes and its memory, so:

- one graph per *signature* (the latent shape, each conditioning input's shape and dtype: what one group of
  the step engine shares) and *row bucket*: a forward of ``rows`` model rows runs the graph of the smallest
  bucket (1, 2, 4, 8, then every 4 up to the most rows a forward can have) that holds them, its inputs
  copied into the graph's static buffers and the rows past ``rows`` filled with copies of the first row
  (finite values; a row's result does not depend on the other rows of a batch, only, to rounding, on the
  batch size, as with any batch the engine makes), and the first ``rows`` of its output copied out (the
  graph overwrites its output at the next replay);
- graphs are captured at load only (:meth:`CapturedForwards.warm`, largest bucket first, every graph of a
  model in one memory pool: replays never overlap, one engine thread and one stream), then the set is
  frozen: a failed capture can leave CUDA's allocator and the thread's stream in a capture state, so it
  must fail the load (a fresh process), never a serving process; each capture logs the memory it added;
- a forward without a graph (another size, more rows than the largest bucket) runs eagerly, as without
  ``cuda_graphs``.

``capture`` is the one CUDA-specific part (:func:`cuda_graph_capture`); the rest, the buckets, padding and
reuse, is plain tensor code the unit tests run on the CPU with a capture that calls the forward eagerly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from triton_diffusion.engine.failures import Failure

log = logging.getLogger("triton_diffusion")

# Eager forwards before a capture, on a side stream (PyTorch's recipe: lazy initialisation, cuBLAS
# workspaces and autotuning happen outside the graph).
WARMUP_FORWARDS = 2

Predict = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], tuple[int, int]], torch.Tensor]


class Replay(Protocol):
    """A captured forward: ``replay()`` recomputes ``output`` from the static inputs it was captured on."""

    output: torch.Tensor

    def replay(self) -> None: ...


# (the forward over static inputs, the memory pool, the device) -> its graph
Capture = Callable[[Callable[[], torch.Tensor], Any, str], Replay]


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row counts graphs are captured at: 1, 2, 4, 8, then every 4, up to ``max_rows`` (a forward of 9
    rows pads to 12, not 16: padded rows cost their compute on a busy GPU)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    buckets = [rows for rows in (1, 2, 4) if rows < max_rows]
    buckets += range(8, max_rows, 4)
    return (*buckets, max_rows)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``rows`` model rows (None: more than the largest)."""
    return next((bucket for bucket in buckets if bucket >= rows), None)


def signature(
    latents: torch.Tensor, timesteps: torch.Tensor, inputs: dict[str, torch.Tensor], size: tuple[int, int]
) -> Hashable | None:
    """What a graph is fixed in besides its rows: every tensor's shape past the row dimension and dtype.
    None where an input is not one row per model row (such a forward runs eagerly)."""
    rows = latents.shape[0]
    tensors = [("latents", latents), ("timesteps", timesteps), *sorted(inputs.items())]
    if any(tensor.dim() == 0 or tensor.shape[0] != rows for _, tensor in tensors):
        return None
    return (tuple(size), tuple((name, tuple(t.shape[1:]), t.dtype, t.device) for name, t in tensors))


def fill_rows(static: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` into the first rows of ``static``, and copies of its first row into the rest."""
    rows = values.shape[0]
    static[:rows].copy_(values)
    if rows < static.shape[0]:
        static[rows:].copy_(values[:1].expand(static.shape[0] - rows, *values.shape[1:]))


@dataclass
class CapturedForward:
    """One signature at one bucket: the static inputs a graph reads and the graph."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    inputs: dict[str, torch.Tensor]
    replay: Replay

    @torch.inference_mode()  # the static buffers are inference tensors, written in place
    def __call__(
        self, latents: torch.Tensor, timesteps: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        fill_rows(self.latents, latents)
        fill_rows(self.timesteps, timesteps)
        for name, values in inputs.items():
            fill_rows(self.inputs[name], values)
        self.replay.replay()
        return self.replay.output[: latents.shape[0]].clone()


class CaptureError(RuntimeError):
    """A forward could not be captured: the model must not load with ``cuda_graphs``."""


class CapturedForwards:
    """A family adapter's ``predict`` through captured graphs (see the module's doc). Captured by
    :meth:`warm` at load, then called on the engine thread only."""

    def __init__(self, predict: Predict, device: str, capture: Capture | None = None) -> None:
        self.predict = predict
        self.device = device
        self.buckets: dict[Hashable, tuple[int, ...]] = {}  # each captured signature's row buckets
        self.capture = capture or cuda_graph_capture
        self.graphs: dict[tuple[Hashable, int], CapturedForward] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture is cuda_graph_capture else None
        self.replays = 0  # forwards that ran a graph (the benchmark's check that graphs are used)
        self.eager = 0  # forwards that ran eagerly (no graph of their signature and bucket)

    def __call__(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> torch.Tensor:
        graph = self.graph_for(latents, timesteps, inputs, size)
        if graph is None:
            self.eager += 1
            return self.predict(latents, timesteps, inputs, size)
        self.replays += 1
        return graph(latents, timesteps, inputs)

    def graph_for(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> CapturedForward | None:
        """The graph captured for this forward's signature and bucket, if any."""
        key = signature(latents, timesteps, inputs, size)
        if key not in self.buckets:
            return None
        bucket = bucket_for(latents.shape[0], self.buckets[key])
        return None if bucket is None else self.graphs.get((key, bucket))

    def warm(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
        max_rows: int,
    ) -> int:
        """Capture one forward's signature at every bucket up to ``max_rows`` model rows (the most a forward
        of its size can have), largest first (the smaller captures then reuse its memory in the pool),
        from its rows repeated; returns the graphs captured. Raises CaptureError."""
        key = signature(latents, timesteps, inputs, size)
        if key is None:
            raise CaptureError(f"the forward at {size} has inputs that are not one row per model row")
        buckets = row_buckets(max_rows)
        self.buckets[key] = tuple(sorted({*self.buckets.get(key, ()), *buckets}))
        rows, captured = latents.shape[0], 0
        for bucket in reversed(buckets):
            if (key, bucket) in self.graphs:
                continue
            index = [row % rows for row in range(bucket)]
            self._capture(
                key, bucket, latents[index], timesteps[index], {k: v[index] for k, v in inputs.items()}, size
            )
            captured += 1
        return captured

    def _capture(
        self,
        key: Hashable,
        bucket: int,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> None:
        # Static inputs outside the graphs' pool: they live as long as the graph, whatever else replays.
        static_latents, static_timesteps = latents.clone(), timesteps.clone()
        static_inputs = {name: values.clone() for name, values in inputs.items()}
        if str(self.device).startswith("cuda"):  # what the pool holds now, not blocks cached before
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        reserved = _reserved(self.device)
        try:
            replay = self.capture(
                lambda: self.predict(static_latents, static_timesteps, static_inputs, size),
                self.pool,
                self.device,
            )
        except Exception as exc:
            if Failure.of(exc).lost:
                raise
            raise CaptureError(
                f"capturing the forward at {size}, {bucket} model rows, failed: {exc!r}"
            ) from exc
        self.graphs[(key, bucket)] = CapturedForward(static_latents, static_timesteps, static_inputs, replay)
        log.info(
            "cuda_graphs: forward at %s, %d rows captured (%d graphs; +%.1f MiB reserved, %.1f MiB in all)",
            size,
            bucket,
            len(self.graphs),
            (_reserved(self.device) - reserved) / 2**20,
            _reserved(self.device) / 2**20,
        )


@dataclass
class CudaGraphReplay:
    graph: Any  # torch.cuda.CUDAGraph
    output: torch.Tensor
    device: str

    def replay(self) -> None:
        # On the model's device's current stream (the engine thread never sets a current device).
        with torch.cuda.device(self.device):
            self.graph.replay()


@functools.cache
def capture_stream(device: str) -> Any:
    """One stream per device for every warm-up and capture: the caching allocator reuses a freed block
    only on the stream it was allocated on, so graphs sharing a pool must be captured on one stream."""
    with torch.cuda.device(device):
        return torch.cuda.Stream()


def cuda_graph_capture(forward: Callable[[], torch.Tensor], pool: Any, device: str) -> Replay:
    """PyTorch's recipe: a few eager forwards on the capture stream, then one captured into ``pool``, on
    the model's device, in thread-local mode (another thread's CUDA calls, the response thread's preview
    copies, do not invalidate it)."""
    stream = capture_stream(str(device))
    with torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_FORWARDS):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            output = forward()
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a captured forward must return one tensor, got {type(output).__name__}")
    return CudaGraphReplay(graph, output, device)


def _reserved(device: str) -> int:
    return torch.cuda.memory_reserved(device) if str(device).startswith("cuda") else 0


@dataclass(frozen=True)
class _WarmUp:
    """The request of a throwaway warm-up job (an engine's Request: nothing reads it)."""

    request_id: str = "warm-up"
    entered: float = 0.0


def capture_adapter_forwards(adapter: Any, warm: Sequence[tuple[Any, int]], capture: Capture | None) -> int:
    """A step adapter's forwards through CUDA graphs, captured now for the shape of each ``warm`` request
    (one per size to serve captured) at every row bucket up to its model rows. Sets ``adapter.captured``
    (the set, frozen), stops its packing, and returns the graphs captured; raises CaptureError."""
    from triton_diffusion.engine.jobs import Job  # the engine's job type, for a throwaway warm-up job

    if adapter.uncapturable is not None:
        raise CaptureError(adapter.uncapturable)
    captured = CapturedForwards(adapter.predict, adapter.device, capture)
    count = 0
    for request, max_rows in warm:
        # Never stepped: only its first forward's inputs are used.
        job = Job(request=_WarmUp(), params=request)
        try:
            (start,) = adapter.prepare([job])
            job.begin(start)
            with torch.inference_mode():
                rows, timesteps, inputs, _ = adapter.forward_inputs([job], [start.state.timesteps[0]])
                latents = torch.cat(rows)
        except Exception as exc:
            if Failure.of(exc).lost:
                raise
            raise CaptureError(f"the warm-up request at {request.size} failed: {exc!r}") from exc
        with torch.inference_mode():
            count += captured.warm(latents, timesteps, inputs, request.size, max_rows)
    adapter.captured = captured
    # One size per forward from now on: a packed forward's canvas is no captured shape (it would run eagerly).
    adapter.sizes.stop_packing(
        "cuda_graphs: graphs are captured per size, a packed forward would run eagerly"
    )
    return count
