"""A latent job's resumable state, taken between two steps and put back onto a fresh start of the same
request, so that a crash loses no work: the resumed job's image is the uninterrupted one's.

What changes while a job steps, and so what a checkpoint holds (everything else a fresh ``adapter.prepare``
of the same request recomputes identically: the text conditioning, the timesteps, the scheduler's tables,
the model's extra inputs, an inpainting job's source, which the per-step blend only reads):

- the latents;
- what its noise scheduler changes while it steps, by name (the step index, DPM-Solver's and UniPC's
  history of model outputs, PNDM's ets: ``diffusers_compat.SCHEDULER_STEP_STATE``, checked against
  diffusers by a test that steps each scheduler). The rest (the schedule's tables, most of a scheduler's
  bytes, and an image job's begin index) a restore leaves as the fresh start made them from the scheduler's
  config and the request;
- the state of the row's generator (``step_kwargs["generator"]``): a stochastic sampler (Euler ancestral,
  SDE DPM-Solver) draws its step noise from it, so without it the resumed steps draw other noise.

A job with a step cache is not checkpointed (:func:`checkpoint_refusal`): its cache state (residuals,
Taylor factors, per-branch decisions) is not saved, so such a job is restarted from step 0 on resume; so
is a job whose scheduler's state is not named, or holds a value that cannot be written (a noise sampler
object).

A checkpoint is CPU tensors (contiguous copies, never views: the job steps on while it is written) and
JSON-serialisable meta; recovery/checkpoint_store.py writes it to disk.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.image_params import LatentJob
from triton_diffusion.recovery.checkpoint_format import FORMAT, JobCheckpoint

SCALARS = (bool, int, float, str, type(None))


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit the job it is restored onto (another size, scheduler or step count)."""


# ---- what cannot be checkpointed -------------------------------------------------------------------------
def checkpoint_refusal(state: object) -> str | None:
    """Why this job cannot be checkpointed exactly, or None. Such a job is restarted from step 0 on
    resume (its request is simply run again), which is exact too, only slower."""
    if not isinstance(state, LatentJob):
        return f"a {type(state).__name__} job is not a latent job"
    if state.cache is not None:
        return "its step cache's state (residuals, Taylor factors) is not saved"
    if getattr(state.scheduler, "solver_p", None) is not None:  # a nested scheduler: its state is not saved
        return f"its scheduler ({type(state.scheduler).__name__}) steps a nested solver_p"
    if compat.step_state_names(state.scheduler) is None:
        return f"its scheduler's state ({type(state.scheduler).__name__}) is not named in diffusers_compat"
    try:
        _generators(state)
        for name, value in _step_state(state.scheduler).items():
            _check_value(value, f"scheduler.{name}", state.latents.device)
    except ValueError as exc:
        return str(exc)
    return None


def _step_state(scheduler: Any) -> dict[str, Any]:
    """What the scheduler changes while it steps (its named state), those of the names it has now (some
    are set by its first step only: Heun's ``sample``)."""
    names = compat.step_state_names(scheduler) or ()
    return {name: getattr(scheduler, name) for name in names if hasattr(scheduler, name)}


def _generators(state: LatentJob) -> list[torch.Generator]:
    """The row's generators in its step arguments (the pipelines pass a list of one), or none."""
    value = state.step_kwargs.get("generator")
    if value is None:
        return []
    generators = list(value) if isinstance(value, (list, tuple)) else [value]
    for generator in generators:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"step_kwargs generator: a {type(generator).__name__}, not a torch.Generator")
    return generators


def _check_value(value: Any, name: str, device: torch.device) -> None:
    """Raise ValueError naming ``name`` and the type if ``value`` cannot be written and read back (a
    tensor goes back to the CPU or to the job's device: one elsewhere has no place to go)."""
    if isinstance(value, torch.Tensor):
        if value.device != device and value.device.type != "cpu":
            raise ValueError(f"{name}: a tensor on {value.device}, neither the CPU nor the job's {device}")
        return
    if isinstance(value, (np.generic, *SCALARS)):
        return
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise ValueError(f"{name}: a numpy array of objects cannot be checkpointed")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(item, f"{name}.{i}", device)
        return
    raise ValueError(f"{name}: a value of type {type(value).__name__} cannot be checkpointed")


# ---- snapshot ------------------------------------------------------------------------------------------
def snapshot(state: LatentJob, step: int) -> JobCheckpoint:
    """The job's state after ``step`` denoising steps, copied (the job is unchanged and steps on). Raises
    ValueError where :func:`checkpoint_refusal` gives a reason."""
    refusal = checkpoint_refusal(state)
    if refusal is not None:
        raise ValueError(f"the job cannot be checkpointed: {refusal}")
    return _taken(state, step)


def snapshot_if_able(state: object, step: int) -> JobCheckpoint | None:
    """:func:`snapshot`, or None where :func:`checkpoint_refusal` gives a reason (checked once: the
    engine's checkpoints, taken every few steps of every running job)."""
    if checkpoint_refusal(state) is not None:
        return None
    return _taken(cast(LatentJob, state), step)


def _taken(state: LatentJob, step: int) -> JobCheckpoint:
    if not 0 <= step <= len(state.timesteps):
        raise ValueError(f"step {step} is outside the job's {len(state.timesteps)} timesteps")
    device = state.latents.device
    tensors: dict[str, torch.Tensor] = {"latents": _copy(state.latents)}
    attributes = {
        name: _encode(value, f"scheduler.{name}", tensors, device)
        for name, value in _step_state(state.scheduler).items()
    }
    generators = _generators(state)
    for i, generator in enumerate(generators):
        tensors[f"generator.{i}"] = _copy(generator.get_state())
    meta = {
        "format": FORMAT,
        "timesteps": len(state.timesteps),
        "scheduler": {
            "class": type(state.scheduler).__name__,
            "attributes": attributes,
        },
        "generators": [str(generator.device) for generator in generators],
    }
    return JobCheckpoint(step, tensors, meta)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares no memory with ``tensor``."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu").contiguous()  # a new tensor already
    return tensor.clone(memory_format=torch.contiguous_format)


def _encode(value: Any, name: str, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    """``value`` as JSON, its tensors put into ``tensors`` under ``name`` (``name.i`` in a list). A tensor
    records whether it lived on the CPU or with the latents (``job``): the scheduler keeps some tables on
    the CPU while the latents are on the GPU, and each goes back where it was."""
    if isinstance(value, torch.Tensor):
        _check_value(value, name, device)
        tensors[name] = _copy(value)
        return {"tensor": name, "device": "job" if value.device == device else "cpu"}
    if isinstance(value, np.ndarray):
        _check_value(value, name, device)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value).copy())
        return {"numpy": name}
    if isinstance(value, np.generic):
        return {"numpy_scalar": value.dtype.str, "value": value.item()}
    if isinstance(value, SCALARS):
        return {"value": value}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(item, f"{name}.{i}", tensors, device) for i, item in enumerate(value)]}
    raise ValueError(f"{name}: a value of type {type(value).__name__} cannot be checkpointed")


# ---- restore -------------------------------------------------------------------------------------------
def restore(state: LatentJob, checkpoint: JobCheckpoint) -> None:
    """Put ``checkpoint`` onto a freshly started job of the same request (``adapter.prepare`` as usual):
    its latents, its scheduler's attributes and its generators' states. The caller sets the job's
    ``steps_done`` to ``checkpoint.step``. Raises CheckpointMismatch naming what differs, and then leaves
    the job as it was (everything is checked and decoded before anything is set)."""
    meta = checkpoint.meta
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"checkpoint format {meta.get('format')!r}, expected {FORMAT}")
    if meta["timesteps"] != len(state.timesteps):
        raise CheckpointMismatch(
            f"timesteps: {meta['timesteps']} in the checkpoint, {len(state.timesteps)} in the job"
        )
    if not 0 <= checkpoint.step <= len(state.timesteps):
        raise CheckpointMismatch(f"step {checkpoint.step} is outside the job's {len(state.timesteps)} steps")
    device = state.latents.device
    latents = _tensor(checkpoint, "latents")
    _same_tensor("latents", latents, state.latents)
    scheduler = state.scheduler
    saved = meta["scheduler"]
    if saved["class"] != type(scheduler).__name__:
        raise CheckpointMismatch(
            f"scheduler: {saved['class']} in the checkpoint, {type(scheduler).__name__} in the job"
        )
    current = _step_state(scheduler)
    # Some are set by the first step only (Heun's sample): the checkpoint may hold more than a fresh
    # start, never fewer.
    missing = sorted(set(current) - set(saved["attributes"]))
    if missing:
        raise CheckpointMismatch(f"scheduler attributes missing from the checkpoint: {', '.join(missing)}")
    # Only the named state: never one of its methods, its config or its tables (a checksum tells a damaged
    # file, not a forged one written into a shared folder).
    named = compat.step_state_names(scheduler) or ()
    other = sorted(set(saved["attributes"]) - set(named))
    if other:
        raise CheckpointMismatch(f"scheduler.{other[0]}: not the state {type(scheduler).__name__} steps")
    attributes = {
        name: _decode(encoded, current.get(name), f"scheduler.{name}", checkpoint, device)
        for name, encoded in saved["attributes"].items()
    }
    generators = _generators(state)
    if [str(g.device) for g in generators] != meta["generators"]:
        raise CheckpointMismatch(
            f"generators: {meta['generators']} in the checkpoint, {[str(g.device) for g in generators]} "
            "in the job"
        )
    generator_states = [_tensor(checkpoint, f"generator.{i}") for i in range(len(generators))]
    for generator, saved_state in zip(generators, generator_states, strict=True):
        if saved_state.shape != generator.get_state().shape:
            raise CheckpointMismatch(f"generator state: {tuple(saved_state.shape)} bytes, another kind")
        try:  # tried on a scratch generator first: a state torch refuses must not leave a job half set
            torch.Generator(device=generator.device).set_state(saved_state.clone())
        except RuntimeError as exc:
            raise CheckpointMismatch(f"generator state: {exc}") from exc
    # Everything fits: set it.
    state.latents = latents.to(device)
    for name, value in attributes.items():
        setattr(scheduler, name, value)
    for generator, saved_state in zip(generators, generator_states, strict=True):
        generator.set_state(saved_state.clone())


def _tensor(checkpoint: JobCheckpoint, name: str) -> torch.Tensor:
    try:
        return checkpoint.tensors[name]
    except KeyError:
        raise CheckpointMismatch(f"{name}: missing from the checkpoint") from None


def _same_tensor(name: str, saved: torch.Tensor, current: torch.Tensor) -> None:
    """A saved tensor replaces the job's own only with the same shape and dtype."""
    if saved.shape != current.shape or saved.dtype != current.dtype:
        raise CheckpointMismatch(
            f"{name}: {tuple(saved.shape)} {saved.dtype} in the checkpoint, "
            f"{tuple(current.shape)} {current.dtype} in the job"
        )


def _decode(encoded: Any, current: Any, name: str, checkpoint: JobCheckpoint, device: torch.device) -> Any:
    """The value :func:`_encode` wrote, on its device; ``current`` is the fresh job's value, whose shape and
    dtype a saved tensor must have where it is a tensor (a mismatch names the attribute)."""
    if "tensor" in encoded:
        tensor = _tensor(checkpoint, encoded["tensor"])
        if isinstance(current, torch.Tensor):
            _same_tensor(name, tensor, current)
        return tensor.to("cpu" if encoded["device"] == "cpu" else device, copy=True)
    if "numpy" in encoded:
        return _tensor(checkpoint, encoded["numpy"]).numpy().copy()
    if "numpy_scalar" in encoded:
        return np.dtype(encoded["numpy_scalar"]).type(encoded["value"])
    if "value" in encoded:
        return encoded["value"]
    kind = "list" if "list" in encoded else "tuple"
    # A history grows as the job steps (PNDM's ets, LMS's derivatives): only items the fresh job has too
    # are checked against its own.
    fresh = current if isinstance(current, (list, tuple)) else ()
    decoded = [
        _decode(item, fresh[i] if i < len(fresh) else None, f"{name}.{i}", checkpoint, device)
        for i, item in enumerate(encoded[kind])
    ]
    return decoded if kind == "list" else tuple(decoded)
