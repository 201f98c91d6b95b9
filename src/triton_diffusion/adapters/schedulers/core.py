"""What every vectorised scheduler shares: reproducing the rounding of a per-row scalar (:class:`Rounding`),
per-row coefficient columns, the cached coefficient tables per schedule and step, and the :class:`Method`
each vectorised class implements (see the package docstring for why the rounding is what it is)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.devices import take_rows, to_device

# Reduced-precision dtypes vectorise only on CUDA, where their rounding is reproduced.
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_CACHED_ROWS = 20_000  # coefficient rows kept across schedules (a few hundred bytes each)

__all__ = ["take_rows", "to_device"]


# ---- rounding of per-row scalars ---------------------------------------------------------------------------
class Rounding:
    """``scalar op tensor`` where the scalar is one row's 0-d float32 tensor, reproduced with a column of
    per-row scalars ``c`` ([n, 1, ...] float32 on the tensor's device) so every row rounds as its own op."""

    def __init__(self, device: torch.device, host_scalars: bool) -> None:
        self.host = host_scalars  # the row's scalar is a CPU 0-d tensor (or a Python number)
        self.reciprocal = host_scalars and device.type == "cuda"

    def mul(self, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``c * x`` (or ``x * c``: the same op)."""
        if x.dtype == torch.float32:
            return c * x
        if self.host:  # float precision, one rounding to x's dtype
            return (c * x.to(torch.float32)).to(x.dtype)
        return c.to(x.dtype) * x  # a device 0-d tensor is cast to x's dtype first

    def div(self, x: torch.Tensor, c: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``x / c``; ``inverse`` is ``1 / c`` in float32, what CUDA multiplies by for a CPU scalar."""
        if self.reciprocal:
            return self.mul(inverse, x)
        if x.dtype == torch.float32:
            return x / c
        return x / c.to(x.dtype)


def vectorisable(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.device != b.device or a.shape != b.shape:
        return False
    if a.device.type == "cuda":
        return a.dtype in CUDA_DTYPES
    return a.device.type == "cpu" and a.dtype == torch.float32


def columns(table: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row coefficients, ``[k, n]`` (one row per coefficient: ``torch.stack(rows, 1)``), as k columns
    ``[n, 1, ...]`` on ``like``'s device, all views of one copy. Read-only: on the CPU they may be views of
    a cached coefficient row shared by every job at that step (``columns_at``)."""
    table = to_device(table, like.device)
    return table.reshape(table.shape + (1,) * (like.dim() - 1)).unbind(0)


def columns_at(
    method: Method, schedulers: Sequence[Any], indices: Sequence[Hashable], like: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Each row's coefficients at its own index, as ``columns`` of ``like``."""
    rows = [coefficients(s, method, index) for s, index in zip(schedulers, indices, strict=True)]
    first = rows[0]
    if all(row is first for row in rows):  # one schedule at one step (homogeneous traffic): no stacking
        return columns(first[:, None].expand(-1, len(rows)), like)
    return columns(torch.stack(rows, 1), like)


def same_kind(value: Any, like: torch.Tensor) -> bool:
    """A stored per-row tensor (a past model output, a sample) that stacks with this call's rows."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == like.dtype
        and value.device == like.device
        and value.shape == (1, *like.shape[1:])
    )


# An unscaled row beside Euler rows: every coefficient 1 (scale_model_input's divisor and inverse too).
ONES = torch.ones(8, dtype=torch.float32)

# ---- per-schedule coefficient tables --------------------------------------------------------------------
# Coefficient rows depend only on a schedule's contents (its sigmas or alphas, step count, config) and the
# step, so jobs with the same scheduler and step count share them. A scheduler instance finds its schedule's
# key through _SCHEDULES (weakly: no state is added to the scheduler), re-derived when set_timesteps replaced
# the tensors it was computed from.
_SCHEDULES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], tuple[Any, ...], Hashable]] = (
    weakref.WeakKeyDictionary()
)
_ROWS: dict[tuple[Hashable, Hashable], torch.Tensor] = {}


def schedule_key(scheduler: Any, method: Method) -> Hashable:
    tensors, values = method.schedule(scheduler)
    entry = _SCHEDULES.get(scheduler)
    if entry is not None:
        old_tensors, old_values, key = entry
        if old_values == values and all(a is b for a, b in zip(old_tensors, tensors, strict=True)):
            return key
    contents = tuple(
        (str(t.dtype), tuple(t.shape), t.detach().to("cpu").contiguous().numpy().tobytes()) for t in tensors
    )
    key = (type(scheduler).__name__, values, contents)
    _SCHEDULES[scheduler] = (tensors, values, key)
    return key


def coefficients(scheduler: Any, method: Method, index: Hashable) -> torch.Tensor:
    """The [k] float32 coefficients of ``scheduler`` at ``index`` (a step index or timesteps)."""
    key = (schedule_key(scheduler, method), index)
    row = _ROWS.get(key)
    if row is None:
        if len(_ROWS) >= _MAX_CACHED_ROWS:
            _ROWS.clear()
        row = torch.stack([v.reshape(()).to(torch.float32) for v in method.coefficients(scheduler, index)])
        _ROWS[key] = row
    return row


def step_index(scheduler: Any, timestep: Any) -> int:
    # The scheduler's own initialisation, as its step would do it first; it is idempotent, so doing it
    # before the math keeps a failed vectorised call harmless to the per-row retry.
    if scheduler.step_index is None:
        compat.init_step_index(scheduler, timestep)
    return scheduler.step_index


def integer_timestep(timestep: Any) -> bool:
    """A timestep that indexes a CPU alphas table as the scheduler's own step would (an int or a CPU
    integer tensor): the key of DDIM's and PNDM's coefficient rows."""
    if isinstance(timestep, torch.Tensor):
        return timestep.device.type == "cpu" and timestep.numel() == 1 and not timestep.is_floating_point()
    return isinstance(timestep, int)


def float_timestep(timestep: Any) -> bool:
    """Euler's and FlowMatch's step refuse integer timesteps (indices); let those fail in their own step."""
    if isinstance(timestep, torch.Tensor):
        return timestep.is_floating_point()
    return isinstance(timestep, float)


def per_row(
    schedulers: Sequence[Any],
    model_outputs: torch.Tensor,
    timesteps: Sequence[Any],
    samples: torch.Tensor,
    step_kwargs: Sequence[dict[str, Any]],
) -> torch.Tensor:
    rows = [
        s.step(model_outputs[r : r + 1], t, samples[r : r + 1], **kwargs, return_dict=False)[0]
        for r, (s, t, kwargs) in enumerate(zip(schedulers, timesteps, step_kwargs, strict=True))
    ]
    return torch.cat(rows)


# ---- the vectorised classes -------------------------------------------------------------------------------
Commit = Callable[[], None]


class Method:
    """How one scheduler class steps many rows at once."""

    def supports(self, scheduler: Any) -> bool:
        """The config is on the vectorised path."""
        raise NotImplementedError

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        """This row's step (its arguments and state) is on the vectorised path; ``like`` is the model
        outputs, which a row's stored past outputs must stack with."""
        raise NotImplementedError

    def branch(self, scheduler: Any) -> Hashable:
        """Rows stepped by one formula."""
        return scheduler.config.prediction_type

    def schedule(self, scheduler: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
        """What the coefficient rows are computed from: tensors and plain values."""
        raise NotImplementedError

    def coefficients(self, scheduler: Any, index: Any) -> list[torch.Tensor]:
        """The per-row scalars at ``index``, by the scheduler's own 0-d arithmetic."""
        raise NotImplementedError

    def step(
        self,
        schedulers: Sequence[Any],
        model_outputs: torch.Tensor,
        timesteps: Sequence[Any],
        samples: torch.Tensor,
    ) -> tuple[torch.Tensor, Commit]:
        """The rows' next samples, and the state change to apply once every branch has been computed."""
        raise NotImplementedError
