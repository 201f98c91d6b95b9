"""PNDMScheduler's PLMS step (skip_prk_steps), vectorised."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from triton_diffusion.adapters.schedulers.core import (
    Commit,
    Method,
    Rounding,
    columns_at,
    integer_timestep,
    same_kind,
    take_rows,
)


class PLMS(Method):
    """``PNDMScheduler.step`` with ``skip_prk_steps`` (``step_plms``): each row's multistep combination of
    its own past noise predictions (rows at different counters grouped by formula), then one
    ``_get_prev_sample`` over every row."""

    def supports(self, scheduler: Any) -> bool:
        config = scheduler.config
        return bool(config.skip_prk_steps) and config.prediction_type in ("epsilon", "v_prediction")

    def row_ok(self, scheduler: Any, timestep: Any, kwargs: dict[str, Any], like: torch.Tensor) -> bool:
        if kwargs or scheduler.num_inference_steps is None or not integer_timestep(timestep):
            return False
        phase = self._phase(scheduler)
        if phase is None or (scheduler.counter == 1 and phase != "average"):
            return False  # a state step_plms would fail on (or not reach with skip_prk_steps)
        past = scheduler.ets if scheduler.counter == 1 else scheduler.ets[-3:]
        stored_ok = all(same_kind(e, like) for e in past)
        return stored_ok and (phase != "average" or same_kind(scheduler.cur_sample, like))

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
        phases: list[str] = []
        for s in schedulers:
            phase = self._phase(s)
            assert phase is not None  # row_ok let no other row in
            phases.append(phase)
        ets = [
            s.ets if s.counter == 1 else [*s.ets[-3:], model_outputs[k : k + 1]]
            for k, s in enumerate(schedulers)
        ]
        keys = []
        for s, t, phase in zip(schedulers, timesteps, phases, strict=True):
            ratio = s.config.num_train_timesteps // s.num_inference_steps
            t = int(t)
            keys.append((t + ratio, t) if phase == "average" else (t, t - ratio))
        columns = columns_at(self, schedulers, keys, samples)
        sqrt_alpha, sqrt_beta, sample_coeff, alpha_diff, denominator, inv_denominator = columns

        # The noise estimate, one formula per group of rows at one phase, on their stacked tensors.
        members: dict[str, list[int]] = {}
        for k, phase in enumerate(phases):
            members.setdefault(phase, []).append(k)
        estimates = {}
        for phase, rows_of_phase in members.items():
            current = take_rows(model_outputs, rows_of_phase)

            def past(back: int, rows_of_phase: list[int] = rows_of_phase) -> torch.Tensor:
                return torch.cat([ets[k][-back] for k in rows_of_phase])

            estimates[phase] = self._estimate(phase, current, past)
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

        r = Rounding(samples.device, host_scalars=True)
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
