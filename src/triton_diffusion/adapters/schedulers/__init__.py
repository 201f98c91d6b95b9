"""Row math in one call: the scheduler steps of many rows, each with its own scheduler instance, as one
vectorised call per scheduler class, bit-identical to each row's own ``scheduler.step``.

The step engine runs one model forward for many jobs; each job has its own scheduler instance (its own
step count, position in its schedule and state) and its own guidance scale. Stepping them row by row costs
a few kernel launches and a few dozen Python calls per row; here rows that share a scheduler class step
in one set of tensor ops over ``[n, ...]`` with per-row scalars as ``[n, 1, ...]`` columns.

Bit-identity: every row gets exactly the bits its own ``step`` would give (``torch.equal``, measured max
abs difference 0 on CPU float32 for every class below; see tests/unit/test_noise_schedulers.py). Each
per-row scalar is computed by the scheduler's own 0-d float32 arithmetic, in its order (once per schedule
and step: cached, so the per-step cost is a table lookup), and each ``scalar op tensor`` is reproduced with
the rounding PyTorch gives that op when the scalar is a 0-d tensor:

- a CPU scalar (diffusers keeps sigmas and alphas on the CPU) enters a CUDA kernel at float precision, so
  with a float16/bfloat16 tensor the product is rounded once, to the tensor's dtype;
- CUDA divides by a CPU scalar as a multiplication by its float32 reciprocal, so that is what is done;
- a 0-d tensor on the tensor's own device (FlowMatch's sigmas on the GPU) is first cast to the tensor's
  dtype.

These CUDA rules are read from PyTorch's kernels (``opmath_gpu_kernel_with_scalars``,
``div_true_kernel_cuda``, TensorIterator's casts) and could not be measured here (no GPU): the CUDA
variants of the tests (float16, bfloat16, float32) run wherever a GPU does. On the CPU only float32 is
vectorised (CPU half-precision kernels round a scalar differently by operand order); other dtypes and
devices step row by row.

Every vectorised step is atomic: all tensor math runs first, then each row's scheduler state is updated
exactly as its own ``step`` would (step index, DPM-Solver's model outputs and lower-order count, PNDM's
ets, counter and current sample), so a row can move between this path and its own ``step`` at any step.

Vectorised (anything else steps each row with its own ``step``, see :func:`can_batch`):

- ``DDIMScheduler``: eta 0; prediction epsilon, v_prediction or sample; no clipping or thresholding.
- ``EulerDiscreteScheduler`` (and its ``scale_model_input``): s_churn 0; any sigma schedule.
- ``FlowMatchEulerDiscreteScheduler``: no stochastic sampling, no per-token timesteps.
- ``DPMSolverMultistepScheduler``: DPM-Solver++ 2M (dpmsolver++, order 2, midpoint), no thresholding;
  lower_order_final / euler_at_final / final_sigmas_type decided per row as the scheduler does.
- ``PNDMScheduler`` with ``skip_prk_steps`` (PLMS, SD 1.5's default).

UniPC steps row by row (not vectorised: its corrector solves a small linear system per row).

API: :func:`can_batch` (class and config), :func:`can_batch_step` (these rows, arguments and dtype: the
call is vectorised and atomic), :func:`vectorised_step` (the atomic call, or None where it cannot be),
:func:`batched_step` (vectorised, else row by row), :func:`scale_model_inputs` and :func:`guide`
(guidance.py). Each vectorised class is a module here (ddim.py, euler.py, flow_match.py, dpm_solver.py,
plms.py); what they share, and the cached coefficient tables, is core.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import diffusers
import torch

from triton_diffusion.adapters.schedulers.core import (
    ONES,
    Method,
    Rounding,
    coefficients,
    columns,
    per_row,
    step_index,
    take_rows,
    vectorisable,
)
from triton_diffusion.adapters.schedulers.ddim import DDIM
from triton_diffusion.adapters.schedulers.dpm_solver import DPMSolverPP2M
from triton_diffusion.adapters.schedulers.euler import Euler
from triton_diffusion.adapters.schedulers.flow_match import FlowMatchEuler
from triton_diffusion.adapters.schedulers.guidance import guide
from triton_diffusion.adapters.schedulers.plms import PLMS

__all__ = ["batched_step", "can_batch", "can_batch_step", "guide", "scale_model_inputs", "vectorised_step"]

EULER = Euler()  # scale_model_inputs' too
METHODS: dict[type, Method] = {
    diffusers.DDIMScheduler: DDIM(),
    diffusers.EulerDiscreteScheduler: EULER,
    diffusers.FlowMatchEulerDiscreteScheduler: FlowMatchEuler(),
    diffusers.DPMSolverMultistepScheduler: DPMSolverPP2M(),
    diffusers.PNDMScheduler: PLMS(),
}
# Their scale_model_input returns the sample itself.
UNSCALED = (
    diffusers.DDIMScheduler,
    diffusers.DPMSolverMultistepScheduler,
    diffusers.PNDMScheduler,
    diffusers.UniPCMultistepScheduler,
)


# ---- public API -------------------------------------------------------------------------------------------
def can_batch(scheduler: Any) -> bool:
    """Whether the scheduler's class is vectorised here and its config is on the vectorised path."""
    method = METHODS.get(type(scheduler))  # the exact class: a subclass may step differently
    return method is not None and method.supports(scheduler)


def can_batch_step(
    schedulers: Sequence[Any],
    model_outputs: torch.Tensor,
    timesteps: Sequence[Any],
    samples: torch.Tensor,
    step_kwargs: Sequence[dict[str, Any]],
) -> bool:
    """Whether :func:`batched_step` vectorises these rows (and so is atomic: if it raises, no scheduler
    changed). Otherwise it steps them one by one, and a failure leaves the rows before it stepped."""
    if not schedulers or not vectorisable(samples, model_outputs):
        return False
    method = METHODS.get(type(schedulers[0]))
    if method is None or any(type(s) is not type(schedulers[0]) for s in schedulers):
        return False
    return all(
        method.supports(s) and method.row_ok(s, t, kwargs, model_outputs)
        for s, t, kwargs in zip(schedulers, timesteps, step_kwargs, strict=True)
    )


def batched_step(
    schedulers: Sequence[Any],
    model_outputs: torch.Tensor,
    timesteps: Sequence[Any],
    samples: torch.Tensor,
    step_kwargs: Sequence[dict[str, Any]],
) -> torch.Tensor:
    """``scheduler.step(model_outputs[i:i+1], timesteps[i], samples[i:i+1], **step_kwargs[i])`` for every
    row i, as ``[n, ...]``: in one vectorised call when :func:`can_batch_step`, else row by row."""
    stepped = vectorised_step(schedulers, model_outputs, timesteps, samples, step_kwargs)
    if stepped is None:
        return per_row(schedulers, model_outputs, timesteps, samples, step_kwargs)
    return stepped


def vectorised_step(
    schedulers: Sequence[Any],
    model_outputs: torch.Tensor,
    timesteps: Sequence[Any],
    samples: torch.Tensor,
    step_kwargs: Sequence[dict[str, Any]],
) -> torch.Tensor | None:
    """:func:`batched_step` in one atomic vectorised call (a raise changes no scheduler), or None where
    :func:`can_batch_step` says these rows cannot be (nothing is stepped then)."""
    if not can_batch_step(schedulers, model_outputs, timesteps, samples, step_kwargs):
        return None
    method = METHODS[type(schedulers[0])]
    # Rows of one class may still differ in a config branch (prediction type): one call per branch,
    # every branch computed before any state changes.
    branches: dict[Hashable, list[int]] = {}
    for row, scheduler in enumerate(schedulers):
        branches.setdefault(method.branch(scheduler), []).append(row)
    if len(branches) == 1:
        out, commit = method.step(schedulers, model_outputs, timesteps, samples)
        commit()
        return out
    pieces: dict[int, torch.Tensor] = {}
    commits = []
    for rows in branches.values():
        out, commit = method.step(
            [schedulers[r] for r in rows],
            take_rows(model_outputs, rows),
            [timesteps[r] for r in rows],
            take_rows(samples, rows),
        )
        commits.append(commit)
        pieces.update({r: out[k : k + 1] for k, r in enumerate(rows)})
    for commit in commits:
        commit()
    return torch.cat([pieces[r] for r in range(len(schedulers))])


def scale_model_inputs(
    schedulers: Sequence[Any], samples: torch.Tensor, timesteps: Sequence[Any]
) -> torch.Tensor:
    """``scheduler.scale_model_input(samples[i:i+1], timesteps[i])`` for every row i, as ``[n, ...]``.

    Euler rows divide by their own ``(sigma**2 + 1) ** 0.5`` in one op; DDIM, DPM-Solver, PNDM and UniPC
    return the input unchanged (in a mixed batch: divided by 1, which is exact); any other class, or a
    dtype or device not vectorised, scales row by row."""
    scaled = [type(s) not in UNSCALED for s in schedulers]
    if not any(scaled):
        return samples
    euler = EULER
    vectorised = vectorisable(samples, samples) and all(
        not scale or (type(s) is diffusers.EulerDiscreteScheduler and euler.supports(s) and euler.scale_ok(s))
        for s, scale in zip(schedulers, scaled, strict=True)
    )
    if not vectorised:
        pairs = zip(schedulers, timesteps, strict=True)
        return torch.cat([s.scale_model_input(samples[r : r + 1], t) for r, (s, t) in enumerate(pairs)])
    rows = []
    for s, t, scale in zip(schedulers, timesteps, scaled, strict=True):
        rows.append(coefficients(s, euler, step_index(s, t)) if scale else ONES)
    divisor, inverse = columns(torch.stack(rows, 1), samples)[euler.SCALE :]
    out = Rounding(samples.device, host_scalars=True).div(samples, divisor, inverse)
    for s, scale in zip(schedulers, scaled, strict=True):
        if scale:
            s.is_scale_input_called = True
    return out
