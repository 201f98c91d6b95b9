"""EulerDiscreteScheduler's step and scale_model_input, vectorised."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.schedulers.core import (
    Commit,
    Method,
    Rounding,
    columns_at,
    float_timestep,
    step_index,
)


class Euler(Method):
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
            float_timestep(timestep)
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
        indices = [step_index(s, t) for s, t in zip(schedulers, timesteps, strict=True)]
        columns = columns_at(self, schedulers, indices, samples)
        sigma_hat, inv_sigma_hat, dt, c_out, denominator, inv_denominator, _, _ = columns
        r = Rounding(samples.device, host_scalars=True)
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
                compat.advance_step_index(s)

        return prev, commit
