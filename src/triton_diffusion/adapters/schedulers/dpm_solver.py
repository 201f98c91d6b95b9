"""DPMSolverMultistepScheduler's DPM-Solver++ 2M step, vectorised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.schedulers.core import (
    Commit,
    Method,
    Rounding,
    coefficients,
    columns,
    same_kind,
    step_index,
)


class DPMSolverPP2M(Method):
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
            and (scheduler.lower_order_nums < 1 or same_kind(outputs[-1], like))
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
            alpha, sigma = compat.sigma_to_alpha_sigma_t(scheduler, sigmas[index])
        # dpm_solver_first_order_update and multistep_dpm_solver_second_order_update (their h and their
        # sample and D0 coefficients are the same values)
        sigma_t, sigma_s0, sigma_s1 = sigmas[index + 1], sigmas[index], sigmas[index - 1]
        alpha_t, sigma_t = compat.sigma_to_alpha_sigma_t(scheduler, sigma_t)
        alpha_s0, sigma_s0 = compat.sigma_to_alpha_sigma_t(scheduler, sigma_s0)
        alpha_s1, sigma_s1 = compat.sigma_to_alpha_sigma_t(scheduler, sigma_s1)
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
        indices = [step_index(s, t) for s, t in zip(schedulers, timesteps, strict=True)]
        second = [not self._first_order(s, i) for s, i in zip(schedulers, indices, strict=True)]
        rows = [coefficients(s, self, i) for s, i in zip(schedulers, indices, strict=True)]
        table = torch.cat([torch.stack(rows, 1), torch.tensor([second], dtype=torch.float32)])
        alpha, inv_alpha, sigma, a, b, c, inv_r0, is_second = columns(table, samples)
        r = Rounding(samples.device, host_scalars=True)
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
                compat.advance_step_index(s)

        return prev, commit
