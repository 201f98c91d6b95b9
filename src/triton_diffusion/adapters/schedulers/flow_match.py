"""FlowMatchEulerDiscreteScheduler's step, vectorised."""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.schedulers.core import (
    Commit,
    Method,
    Rounding,
    columns,
    float_timestep,
    step_index,
)


class FlowMatchEuler(Method):
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
            float_timestep(timestep)
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
        steps = [self._dt(s)[step_index(s, t)] for s, t in zip(schedulers, timesteps, strict=True)]
        (dt,) = columns(torch.stack(steps)[None], samples)
        r = Rounding(samples.device, host_scalars=schedulers[0].sigmas.device.type == "cpu")
        prev = (samples.to(torch.float32) + r.mul(dt, model_outputs)).to(model_outputs.dtype)

        def commit() -> None:
            for s in schedulers:
                compat.advance_step_index(s)

        return prev, commit
