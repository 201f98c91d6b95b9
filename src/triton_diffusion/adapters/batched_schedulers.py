"""Row math in one call: the scheduler steps of many rows, each with its own scheduler instance, as one
vectorised call per scheduler class, bit-identical to each row's own ``scheduler.step``.

The step engine runs one model forward for many jobs; each job has its own scheduler instance (its own
step count, position in its schedule and state) and its own guidance scale. Stepping them row by row costs
a few kernel launches and a few dozen Python calls per row; here rows that share a scheduler class step
in one set of tensor ops over ``[n, ...]`` with per-row scalars as ``[n, 1, ...]`` columns.

Bit-identity: every row gets exactly the bits its own ``step`` would give (``torch.equal``, measured max
abs difference 0 on CPU float32 for every class below; see tests/unit/test_batched_schedulers.py). Each
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
:func:`batched_step` (vectorised, else row by row), :func:`scale_model_inputs` and :func:`guide`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import diffusers
import torch

# Reduced-precision dtypes vectorise only on CUDA, where their rounding is reproduced (see above).
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_CACHED_ROWS = 20_000  # coefficient rows kept across schedules (a few hundred bytes each)


# ---- public API -------------------------------------------------------------------------------------------
def can_batch(scheduler: Any) -> bool:
    """Whether the scheduler's class is vectorised here and its config is on the vectorised path."""
    method = _METHODS.get(type(scheduler))  # the exact class: a subclass may step differently
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
    if not schedulers or not _vectorisable(samples, model_outputs):
        return False
    method = _METHODS.get(type(schedulers[0]))
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
        return _per_row(schedulers, model_outputs, timesteps, samples, step_kwargs)
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
    method = _METHODS[type(schedulers[0])]
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
            _rows(model_outputs, rows),
            [timesteps[r] for r in rows],
            _rows(samples, rows),
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
    scaled = [type(s) not in _UNSCALED for s in schedulers]
    if not any(scaled):
        return samples
    euler = _METHODS[diffusers.EulerDiscreteScheduler]
    vectorised = _vectorisable(samples, samples) and all(
        not scale or (type(s) is diffusers.EulerDiscreteScheduler and euler.supports(s) and euler.scale_ok(s))
        for s, scale in zip(schedulers, scaled, strict=True)
    )
    if not vectorised:
        pairs = zip(schedulers, timesteps, strict=True)
        return torch.cat([s.scale_model_input(samples[r : r + 1], t) for r, (s, t) in enumerate(pairs)])
    rows = []
    for s, t, scale in zip(schedulers, timesteps, scaled, strict=True):
        rows.append(_coefficients(s, euler, _step_index(s, t)) if scale else _ONES)
    divisor, inverse = _columns(torch.stack(rows, 1), samples)[euler.SCALE :]
    out = _Rounding(samples.device, host_scalars=True).div(samples, divisor, inverse)
    for s, scale in zip(schedulers, scaled, strict=True):
        if scale:
            s.is_scale_input_called = True
    return out


def guide(uncond: torch.Tensor, cond: torch.Tensor, scales: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance ``uncond + g * (cond - uncond)`` with each row's own scale g (a Python
    float in the per-row formula), for ``[n, ...]`` rows in one op, bit-identical to the per-row formula."""
    values = [float(g) for g in (scales.tolist() if isinstance(scales, torch.Tensor) else scales)]
    first = values[0].hex()  # the same bits (== would take -0.0 for 0.0)
    if all(g.hex() == first for g in values):  # one scale (homogeneous traffic): the per-row formula
        return uncond + values[0] * (cond - uncond)
    if not _vectorisable(uncond, cond):
        rows = [uncond[r : r + 1] + g * (cond[r : r + 1] - uncond[r : r + 1]) for r, g in enumerate(values)]
        return torch.cat(rows)
    # A Python float is a CPU scalar to the kernel: float32 on the CPU (the tensor's dtype), float
    # precision on CUDA.
    (column,) = _columns(torch.tensor([values], dtype=torch.float32), uncond)
    return uncond + _Rounding(uncond.device, host_scalars=True).mul(column, cond - uncond)


# ---- rounding of per-row scalars ---------------------------------------------------------------------------
class _Rounding:
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


def _vectorisable(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.device != b.device or a.shape != b.shape:
        return False
    if a.device.type == "cuda":
        return a.dtype in _CUDA_DTYPES
    return a.device.type == "cpu" and a.dtype == torch.float32


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows == list(range(values.shape[0])):
        return values
    return torch.cat([values[r : r + 1] for r in rows])


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor to the device without waiting for the GPU (a pageable copy would wait for the
    forward still queued, and the engine queues the next step early)."""
    if values.device == device:
        return values
    if values.device.type == "cpu" and device.type == "cuda":
        # Dense first: an expanded table (one coefficient row for every row) is copied through a
        # pageable temporary otherwise, which waits for the GPU.
        return values.contiguous().pin_memory().to(device, non_blocking=True)
    return values.to(device)


def _columns(table: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row coefficients, ``[k, n]`` (one row per coefficient: ``torch.stack(rows, 1)``), as k columns
    ``[n, 1, ...]`` on ``like``'s device, all views of one copy. Read-only: on the CPU they may be views of
    a cached coefficient row shared by every job at that step (``_columns_at``)."""
    table = _to_device(table, like.device)
    return table.reshape(table.shape + (1,) * (like.dim() - 1)).unbind(0)


def _columns_at(
    method: _Method, schedulers: Sequence[Any], indices: Sequence[Hashable], like: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Each row's coefficients at its own index, as ``_columns`` of ``like``."""
    rows = [_coefficients(s, method, index) for s, index in zip(schedulers, indices, strict=True)]
    first = rows[0]
    if all(row is first for row in rows):  # one schedule at one step (homogeneous traffic): no stacking
        return _columns(first[:, None].expand(-1, len(rows)), like)
    return _columns(torch.stack(rows, 1), like)


def _same_kind(value: Any, like: torch.Tensor) -> bool:
    """A stored per-row tensor (a past model output, a sample) that stacks with this call's rows."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == like.dtype
        and value.device == like.device
        and value.shape == (1, *like.shape[1:])
    )


# An unscaled row beside Euler rows: every coefficient 1 (scale_model_input's divisor and inverse too).
_ONES = torch.ones(8, dtype=torch.float32)


# ---- per-schedule coefficient tables --------------------------------------------------------------------
# Coefficient rows depend only on a schedule's contents (its sigmas or alphas, step count, config) and the
# step, so jobs with the same scheduler and step count share them. A scheduler instance finds its schedule's
# key through _SCHEDULES (weakly: no state is added to the scheduler), re-derived when set_timesteps replaced
# the tensors it was computed from.
_SCHEDULES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], tuple[Any, ...], Hashable]] = (
    weakref.WeakKeyDictionary()
)
_ROWS: dict[tuple[Hashable, Hashable], torch.Tensor] = {}


def _schedule_key(scheduler: Any, method: _Method) -> Hashable:
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


def _coefficients(scheduler: Any, method: _Method, index: Hashable) -> torch.Tensor:
    """The [k] float32 coefficients of ``scheduler`` at ``index`` (a step index or timesteps)."""
    key = (_schedule_key(scheduler, method), index)
    row = _ROWS.get(key)
    if row is None:
        if len(_ROWS) >= _MAX_CACHED_ROWS:
            _ROWS.clear()
        row = torch.stack([v.reshape(()).to(torch.float32) for v in method.coefficients(scheduler, index)])
        _ROWS[key] = row
    return row


def _step_index(scheduler: Any, timestep: Any) -> int:
    # The scheduler's own initialisation, as its step would do it first; it is idempotent, so doing it
    # before the math keeps a failed vectorised call harmless to the per-row retry.
    if scheduler.step_index is None:
        scheduler._init_step_index(timestep)
    return scheduler.step_index


def _integer_timestep(timestep: Any) -> bool:
    """A timestep that indexes a CPU alphas table as the scheduler's own step would (an int or a CPU
    integer tensor): the key of DDIM's and PNDM's coefficient rows."""
    if isinstance(timestep, torch.Tensor):
        return timestep.device.type == "cpu" and timestep.numel() == 1 and not timestep.is_floating_point()
    return isinstance(timestep, int)


def _float_timestep(timestep: Any) -> bool:
    """Euler's and FlowMatch's step refuse integer timesteps (indices); let those fail in their own step."""
    if isinstance(timestep, torch.Tensor):
        return timestep.is_floating_point()
    return isinstance(timestep, float)


def _per_row(
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


class _Method:
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


class _DDIM(_Method):
    """``DDIMScheduler.step`` with eta 0 (no noise, no state: DDIM keeps no step index)."""

    def supports(self, scheduler: Any) -> bool:
        config = scheduler.config
        return (
            not config.thresholding
            and not config.clip_sample
            and config.prediction_type in ("epsilon", "v_prediction", "sample")
        )

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        return (
            scheduler.num_inference_steps is not None
            and _integer_timestep(timestep)
            and set(kwargs) <= {"eta", "generator"}
            and kwargs.get("eta", 0.0) == 0
        )

    def schedule(self, scheduler: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
        tensors = (scheduler.alphas_cumprod, scheduler.final_alpha_cumprod)
        return tensors, (scheduler.num_inference_steps, scheduler.config.num_train_timesteps)

    def coefficients(self, scheduler: Any, timestep: int) -> list[torch.Tensor]:
        # DDIMScheduler.step, steps 1, 2, 5 and 6, with eta = 0.
        prev_timestep = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
        alpha_prod_t = scheduler.alphas_cumprod[timestep]
        alpha_prod_t_prev = (
            scheduler.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else scheduler.final_alpha_cumprod
        )
        beta_prod_t = 1 - alpha_prod_t
        variance = scheduler._get_variance(timestep, prev_timestep)
        std_dev_t = 0.0 * variance ** (0.5)
        direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5)
        sqrt_alpha, sqrt_beta = alpha_prod_t ** (0.5), beta_prod_t ** (0.5)
        return [
            sqrt_alpha,
            torch.reciprocal(sqrt_alpha),
            sqrt_beta,
            torch.reciprocal(sqrt_beta),
            alpha_prod_t_prev ** (0.5),
            direction,
        ]

    def step(
        self,
        schedulers: Sequence[Any],
        model_outputs: torch.Tensor,
        timesteps: Sequence[Any],
        samples: torch.Tensor,
    ) -> tuple[torch.Tensor, Commit]:
        columns = _columns_at(self, schedulers, [int(t) for t in timesteps], samples)
        sqrt_alpha, inv_sqrt_alpha, sqrt_beta, inv_sqrt_beta, sqrt_alpha_prev, direction = columns
        r = _Rounding(samples.device, host_scalars=True)
        prediction = schedulers[0].config.prediction_type
        if prediction == "epsilon":
            original = r.div(samples - r.mul(sqrt_beta, model_outputs), sqrt_alpha, inv_sqrt_alpha)
            epsilon = model_outputs
        elif prediction == "sample":
            original = model_outputs
            epsilon = r.div(samples - r.mul(sqrt_alpha, original), sqrt_beta, inv_sqrt_beta)
        else:  # v_prediction
            original = r.mul(sqrt_alpha, samples) - r.mul(sqrt_beta, model_outputs)
            epsilon = r.mul(sqrt_alpha, model_outputs) + r.mul(sqrt_beta, samples)
        prev = r.mul(sqrt_alpha_prev, original) + r.mul(direction, epsilon)
        return prev, lambda: None


class _Euler(_Method):
    """``EulerDiscreteScheduler.step`` with s_churn 0 (gamma 0: no noise drawn, the generator is untouched)
    and its ``scale_model_input``."""

    SCALE = 6  # the columns of scale_model_input's divisor and its inverse

    def supports(self, scheduler: Any) -> bool:
        return scheduler.config.prediction_type in ("epsilon", "v_prediction", "sample", "original_sample")

    def branch(self, scheduler: Any) -> Hashable:
        prediction = scheduler.config.prediction_type
        return "sample" if prediction == "original_sample" else prediction

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        return (
            _float_timestep(timestep)
            and set(kwargs) <= {"generator", "s_churn", "s_tmin", "s_tmax", "s_noise"}
            and kwargs.get("s_churn", 0.0) == 0
            and self._index_ok(scheduler, 1)
        )

    def scale_ok(self, scheduler: Any) -> bool:
        return self._index_ok(scheduler, 0)

    @staticmethod
    def _index_ok(scheduler: Any, ahead: int) -> bool:
        index = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
        return index is None or 0 <= index + ahead < len(scheduler.sigmas)

    def schedule(self, scheduler: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
        return (scheduler.sigmas,), ()

    def coefficients(self, scheduler: Any, index: int) -> list[torch.Tensor]:
        sigmas = scheduler.sigmas
        sigma = sigmas[index]
        sigma_hat = sigma * (0.0 + 1)  # gamma = 0
        denominator = sigma**2 + 1
        scale = (sigma**2 + 1) ** 0.5  # scale_model_input's divisor
        # The last step's divisor needs no next sigma: scale_model_input runs before step.
        dt = sigmas[index + 1] - sigma_hat if index + 1 < len(sigmas) else torch.zeros(())
        return [
            sigma_hat,
            torch.reciprocal(sigma_hat),
            dt,
            -sigma / (sigma**2 + 1) ** 0.5,
            denominator,
            torch.reciprocal(denominator),
            scale,
            torch.reciprocal(scale),
        ]

    def step(
        self,
        schedulers: Sequence[Any],
        model_outputs: torch.Tensor,
        timesteps: Sequence[Any],
        samples: torch.Tensor,
    ) -> tuple[torch.Tensor, Commit]:
        indices = [_step_index(s, t) for s, t in zip(schedulers, timesteps, strict=True)]
        columns = _columns_at(self, schedulers, indices, samples)
        sigma_hat, inv_sigma_hat, dt, c_out, denominator, inv_denominator, _, _ = columns
        r = _Rounding(samples.device, host_scalars=True)
        sample = samples.to(torch.float32)
        prediction = self.branch(schedulers[0])
        if prediction == "sample":
            original = model_outputs
        elif prediction == "epsilon":
            original = sample - r.mul(sigma_hat, model_outputs)
        else:  # v_prediction
            original = r.mul(c_out, model_outputs) + r.div(sample, denominator, inv_denominator)
        derivative = r.div(sample - original, sigma_hat, inv_sigma_hat)
        prev = (sample + r.mul(dt, derivative)).to(model_outputs.dtype)

        def commit() -> None:
            for s in schedulers:
                s._step_index += 1

        return prev, commit


class _FlowMatchEuler(_Method):
    """``FlowMatchEulerDiscreteScheduler.step``, deterministic: ``sample + (sigma_next - sigma) * v``."""

    def __init__(self) -> None:
        # Per instance: sigma_next - sigma for every step, where its sigmas live (the GPU for FLUX and SD3:
        # gathering rows there needs no copy and no wait).
        self._steps: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    def supports(self, scheduler: Any) -> bool:
        return not scheduler.config.stochastic_sampling

    def branch(self, scheduler: Any) -> Hashable:
        return scheduler.sigmas.device  # a CPU or a device scalar rounds differently

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        index = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
        return (
            _float_timestep(timestep)
            and set(kwargs) <= {"generator", "s_churn", "s_tmin", "s_tmax", "s_noise", "per_token_timesteps"}
            and kwargs.get("per_token_timesteps") is None
            and (index is None or 0 <= index + 1 < len(scheduler.sigmas))
        )

    def _dt(self, scheduler: Any) -> torch.Tensor:
        sigmas = scheduler.sigmas
        entry = self._steps.get(scheduler)
        if entry is None or entry[0] is not sigmas:
            entry = (sigmas, sigmas[1:] - sigmas[:-1])  # elementwise, as the 0-d sigma_next - sigma
            self._steps[scheduler] = entry
        return entry[1]

    def step(
        self,
        schedulers: Sequence[Any],
        model_outputs: torch.Tensor,
        timesteps: Sequence[Any],
        samples: torch.Tensor,
    ) -> tuple[torch.Tensor, Commit]:
        steps = [self._dt(s)[_step_index(s, t)] for s, t in zip(schedulers, timesteps, strict=True)]
        (dt,) = _columns(torch.stack(steps)[None], samples)
        r = _Rounding(samples.device, host_scalars=schedulers[0].sigmas.device.type == "cpu")
        prev = (samples.to(torch.float32) + r.mul(dt, model_outputs)).to(model_outputs.dtype)

        def commit() -> None:
            for s in schedulers:
                s._step_index += 1

        return prev, commit


class _DPMSolverPP2M(_Method):
    """``DPMSolverMultistepScheduler.step`` for DPM-Solver++ 2M (midpoint): per row, the first-order
    update on its first step and, where the scheduler says so, its last; the second-order update else."""

    def supports(self, scheduler: Any) -> bool:
        config = scheduler.config
        return (
            config.algorithm_type == "dpmsolver++"
            and config.solver_order == 2
            and config.solver_type == "midpoint"
            and not config.thresholding
            and config.variance_type not in ("learned", "learned_range")
            and config.prediction_type in ("epsilon", "v_prediction", "sample", "flow_prediction")
            and config.final_sigmas_type in ("zero", "sigma_min")
        )

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        index = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
        outputs = scheduler.model_outputs
        return (
            scheduler.num_inference_steps is not None
            and set(kwargs) <= {"generator", "variance_noise"}  # dpmsolver++ draws no noise
            and (index is None or 0 <= index + 1 < len(scheduler.sigmas))
            and len(outputs) == 2
            and (scheduler.lower_order_nums < 1 or _same_kind(outputs[-1], like))
        )

    def schedule(self, scheduler: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
        config = scheduler.config
        return (scheduler.sigmas,), (bool(config.use_flow_sigmas), config.prediction_type)

    def coefficients(self, scheduler: Any, index: int) -> list[torch.Tensor]:
        sigmas = scheduler.sigmas
        # convert_model_output
        if scheduler.config.prediction_type == "flow_prediction":
            alpha, sigma = torch.ones(()), sigmas[index]
        else:
            alpha, sigma = scheduler._sigma_to_alpha_sigma_t(sigmas[index])
        # dpm_solver_first_order_update and multistep_dpm_solver_second_order_update (their h and their
        # sample and D0 coefficients are the same values)
        sigma_t, sigma_s0, sigma_s1 = sigmas[index + 1], sigmas[index], sigmas[index - 1]
        alpha_t, sigma_t = scheduler._sigma_to_alpha_sigma_t(sigma_t)
        alpha_s0, sigma_s0 = scheduler._sigma_to_alpha_sigma_t(sigma_s0)
        alpha_s1, sigma_s1 = scheduler._sigma_to_alpha_sigma_t(sigma_s1)
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
        lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        return [
            alpha,
            torch.reciprocal(alpha),
            sigma,
            sigma_t / sigma_s0,
            alpha_t * (torch.exp(-h) - 1.0),
            0.5 * (alpha_t * (torch.exp(-h) - 1.0)),
            1.0 / r0,
        ]

    @staticmethod
    def _first_order(scheduler: Any, index: int) -> bool:
        config, steps = scheduler.config, len(scheduler.timesteps)
        lower_order_final = (index == steps - 1) and (
            config.euler_at_final
            or (config.lower_order_final and steps < 15)
            or config.final_sigmas_type == "zero"
        )
        return config.solver_order == 1 or scheduler.lower_order_nums < 1 or lower_order_final

    def step(
        self,
        schedulers: Sequence[Any],
        model_outputs: torch.Tensor,
        timesteps: Sequence[Any],
        samples: torch.Tensor,
    ) -> tuple[torch.Tensor, Commit]:
        indices = [_step_index(s, t) for s, t in zip(schedulers, timesteps, strict=True)]
        second = [not self._first_order(s, i) for s, i in zip(schedulers, indices, strict=True)]
        rows = [_coefficients(s, self, i) for s, i in zip(schedulers, indices, strict=True)]
        table = torch.cat([torch.stack(rows, 1), torch.tensor([second], dtype=torch.float32)])
        alpha, inv_alpha, sigma, a, b, c, inv_r0, is_second = _columns(table, samples)
        r = _Rounding(samples.device, host_scalars=True)
        prediction = schedulers[0].config.prediction_type
        # convert_model_output, on the sample as given (the step upcasts it afterwards)
        if prediction == "epsilon":
            x0 = r.div(samples - r.mul(sigma, model_outputs), alpha, inv_alpha)
        elif prediction == "sample":
            x0 = model_outputs
        elif prediction == "v_prediction":
            x0 = r.mul(alpha, samples) - r.mul(sigma, model_outputs)
        else:  # flow_prediction
            x0 = samples - r.mul(sigma, model_outputs)
        sample = samples.to(torch.float32)
        prev = r.mul(a, sample) - r.mul(b, x0)  # first order; second order's first two terms
        if any(second):
            # second order: ... - 0.5 * (alpha_t * (exp(-h) - 1)) * D1 with D1 = (1 / r0) * (m0 - m1); the
            # first-order rows keep their value (their m1 is a stand-in, their correction unused).
            pairs = enumerate(zip(schedulers, second, strict=True))
            m1 = torch.cat([s.model_outputs[-1] if order else x0[k : k + 1] for k, (s, order) in pairs])
            corrected = prev - r.mul(c, r.mul(inv_r0, x0 - m1))
            prev = corrected if all(second) else torch.where(is_second > 0.5, corrected, prev)
        prev = prev.to(x0.dtype)

        def commit() -> None:
            for k, s in enumerate(schedulers):
                outputs = s.model_outputs  # shifted in place, as the scheduler does
                for i in range(s.config.solver_order - 1):
                    outputs[i] = outputs[i + 1]
                outputs[-1] = x0[k : k + 1]
                if s.lower_order_nums < s.config.solver_order:
                    s.lower_order_nums += 1
                s._step_index += 1

        return prev, commit


class _PLMS(_Method):
    """``PNDMScheduler.step`` with ``skip_prk_steps`` (``step_plms``): each row's multistep combination of
    its own past noise predictions (rows at different counters grouped by formula), then one
    ``_get_prev_sample`` over every row."""

    def supports(self, scheduler: Any) -> bool:
        config = scheduler.config
        return bool(config.skip_prk_steps) and config.prediction_type in ("epsilon", "v_prediction")

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        if kwargs or scheduler.num_inference_steps is None or not _integer_timestep(timestep):
            return False
        phase = self._phase(scheduler)
        if phase is None or (scheduler.counter == 1 and phase != "average"):
            return False  # a state step_plms would fail on (or not reach with skip_prk_steps)
        past = scheduler.ets if scheduler.counter == 1 else scheduler.ets[-3:]
        stored_ok = all(_same_kind(e, like) for e in past)
        return stored_ok and (phase != "average" or _same_kind(scheduler.cur_sample, like))

    def schedule(self, scheduler: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
        tensors = (scheduler.alphas_cumprod, scheduler.final_alpha_cumprod)
        return tensors, (scheduler.num_inference_steps, scheduler.config.num_train_timesteps)

    def coefficients(self, scheduler: Any, index: tuple[int, int]) -> list[torch.Tensor]:
        # PNDMScheduler._get_prev_sample
        timestep, prev_timestep = index
        alpha_prod_t = scheduler.alphas_cumprod[timestep]
        alpha_prod_t_prev = (
            scheduler.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else scheduler.final_alpha_cumprod
        )
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_t_prev = 1 - alpha_prod_t_prev
        sample_coeff = (alpha_prod_t_prev / alpha_prod_t) ** (0.5)
        model_output_denom_coeff = alpha_prod_t * beta_prod_t_prev ** (0.5) + (
            alpha_prod_t * beta_prod_t * alpha_prod_t_prev
        ) ** (0.5)
        return [
            alpha_prod_t**0.5,
            beta_prod_t**0.5,
            sample_coeff,
            alpha_prod_t_prev - alpha_prod_t,
            model_output_denom_coeff,
            torch.reciprocal(model_output_denom_coeff),
        ]

    @staticmethod
    def _phase(scheduler: Any) -> str | None:
        """Which of step_plms's formulas this row's step takes (by the length of its ets after this step's
        update and its counter, tested in step_plms's order); None where step_plms would fail."""
        count = len(scheduler.ets) if scheduler.counter == 1 else len(scheduler.ets[-3:]) + 1
        if count == 1 and scheduler.counter == 0:
            return "first"
        if count == 1 and scheduler.counter == 1:
            return "average"
        return {2: "two", 3: "three", 4: "four"}.get(count)

    @staticmethod
    def _estimate(phase: str, current: torch.Tensor, past: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """step_plms's noise estimate for rows of one phase; ``past(k)`` is their ets[-k] before this
        step's output was added (the average) or after (the others, where ets[-1] is ``current``)."""
        if phase == "first":
            return current
        if phase == "average":
            return (current + past(1)) / 2
        if phase == "two":
            return (3 * current - past(2)) / 2
        if phase == "three":
            return (23 * current - 16 * past(2) + 5 * past(3)) / 12
        return (1 / 24) * (55 * current - 59 * past(2) + 37 * past(3) - 9 * past(4))

    def step(
        self,
        schedulers: Sequence[Any],
        model_outputs: torch.Tensor,
        timesteps: Sequence[Any],
        samples: torch.Tensor,
    ) -> tuple[torch.Tensor, Commit]:
        n = len(schedulers)
        phases = [self._phase(s) for s in schedulers]
        ets = [
            s.ets if s.counter == 1 else [*s.ets[-3:], model_outputs[k : k + 1]]
            for k, s in enumerate(schedulers)
        ]
        keys = []
        for s, t, phase in zip(schedulers, timesteps, phases, strict=True):
            ratio = s.config.num_train_timesteps // s.num_inference_steps
            t = int(t)
            keys.append((t + ratio, t) if phase == "average" else (t, t - ratio))
        columns = _columns_at(self, schedulers, keys, samples)
        sqrt_alpha, sqrt_beta, sample_coeff, alpha_diff, denominator, inv_denominator = columns

        # The noise estimate, one formula per group of rows at one phase, on their stacked tensors.
        members: dict[str, list[int]] = {}
        for k, phase in enumerate(phases):
            members.setdefault(phase, []).append(k)
        estimates = {}
        for phase, rows_of_phase in members.items():
            current = _rows(model_outputs, rows_of_phase)
            estimates[phase] = self._estimate(
                phase,
                current,
                lambda back, rows_of_phase=rows_of_phase: torch.cat([ets[k][-back] for k in rows_of_phase]),
            )
        if len(members) == 1:
            (estimate,) = estimates.values()
        else:  # back in row order
            slot = {
                k: (phase, j) for phase, rows_of_phase in members.items() for j, k in enumerate(rows_of_phase)
            }
            estimate = torch.cat([estimates[slot[k][0]][slot[k][1] : slot[k][1] + 1] for k in range(n)])
        sample = samples
        if "average" in members:  # the second step restarts from the first step's sample
            pairs = enumerate(zip(schedulers, phases, strict=True))
            sample = torch.cat(
                [s.cur_sample if phase == "average" else samples[k : k + 1] for k, (s, phase) in pairs]
            )

        r = _Rounding(samples.device, host_scalars=True)
        if schedulers[0].config.prediction_type == "v_prediction":
            estimate = r.mul(sqrt_alpha, estimate) + r.mul(sqrt_beta, sample)
        prev = r.mul(sample_coeff, sample) - r.div(r.mul(alpha_diff, estimate), denominator, inv_denominator)

        def commit() -> None:
            for k, (s, phase) in enumerate(zip(schedulers, phases, strict=True)):
                s.ets = ets[k]
                if phase == "first":
                    s.cur_sample = samples[k : k + 1]
                elif phase == "average":
                    s.cur_sample = None
                s.counter += 1

        return prev, commit


_METHODS: dict[type, _Method] = {
    diffusers.DDIMScheduler: _DDIM(),
    diffusers.EulerDiscreteScheduler: _Euler(),
    diffusers.FlowMatchEulerDiscreteScheduler: _FlowMatchEuler(),
    diffusers.DPMSolverMultistepScheduler: _DPMSolverPP2M(),
    diffusers.PNDMScheduler: _PLMS(),
}
# Their scale_model_input returns the sample itself.
_UNSCALED = (
    diffusers.DDIMScheduler,
    diffusers.DPMSolverMultistepScheduler,
    diffusers.PNDMScheduler,
    diffusers.UniPCMultistepScheduler,
)
