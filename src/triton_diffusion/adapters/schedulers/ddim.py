"""DDIMScheduler's step, vectorised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.schedulers.core import (
    Commit,
    Method,
    Rounding,
    columns_at,
    integer_timestep,
)


class DDIM(Method):
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
            and integer_timestep(timestep)
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
        variance = compat.ddim_variance(scheduler, timestep, prev_timestep)
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
        columns = columns_at(self, schedulers, [int(t) for t in timesteps], samples)
        sqrt_alpha, inv_sqrt_alpha, sqrt_beta, inv_sqrt_beta, sqrt_alpha_prev, direction = columns
        r = Rounding(samples.device, host_scalars=True)
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
