"""Vectorised noise-scheduler steps (adapters/schedulers/) against each row's own scheduler, step by step.

A small engine is simulated: rows with their own step counts (1 to 25) join at different engine steps, so
one call holds rows at their first, middle and last steps; each row's model output is drawn per row and
step from a fixed seed. Every row also has an independent copy of its scheduler stepped alone with the
same inputs. At every call the vectorised rows must equal the copies' own ``step`` (``torch.equal``), and
at the end every scheduler's whole state (step index, past model outputs, ets, counters) must equal its
copy's, and so must the generators. CPU float32, tiny latents, no model weights.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from triton_diffusion.adapters.image_params import LatentJob
from triton_diffusion.adapters.job_caches import JobCaches
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.schedulers import (
    batched_step,
    can_batch,
    can_batch_step,
    guide,
    scale_model_inputs,
)
from triton_diffusion.engine.jobs import Job
from triton_diffusion.families import PipelineTraits
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import build_missing

SHAPE = (4, 8, 8)
# (steps, joins at engine step): rows at their first and last steps share calls with rows mid-way.
PLAN = [(4, 0), (8, 1), (16, 0), (25, 3), (1, 2), (2, 5), (8, 6), (15, 4)]


def weights_config(name: str) -> dict[str, Any]:
    """The tiny model's own scheduler config (built first on a fresh machine: the suite builds them all)."""
    build_missing(WEIGHTS, only=[name])
    config = json.loads((WEIGHTS / name / "scheduler" / "scheduler_config.json").read_text())
    return {k: v for k, v in config.items() if not k.startswith("_")}


SD = weights_config("tiny-sd")  # DDIM, leading spacing, steps_offset 1, set_alpha_to_one False
SDXL = weights_config("tiny-sdxl")  # Euler
FLUX = weights_config("tiny-flux")
SD3 = weights_config("tiny-sd3")
QWEN = weights_config("tiny-qwen-image")  # dynamic shifting, shift_terminal
PIXART = weights_config("tiny-pixart-sigma")  # DPM-Solver++ 2M
SANA = weights_config("tiny-sana")  # DPM-Solver++ 2M on flow sigmas, flow_prediction
SD15_PNDM = {**SD, "skip_prk_steps": True}  # Stable Diffusion 1.5's own scheduler config


def make(cls: type, config: dict[str, Any], steps: int, flow_sigmas: bool, device: str = "cpu") -> Any:
    """A job's scheduler as the step engine makes it: its own instance, timesteps and begin index (on the
    CPU for UNet schedulers, on the device for flow matching, as the adapters' schedule_device)."""
    scheduler = cls.from_config(config)
    if cls is diffusers.FlowMatchEulerDiscreteScheduler:
        mu = 0.9 if scheduler.config.use_dynamic_shifting else None
        sigmas = np.linspace(1.0, 1 / steps, steps) if flow_sigmas else None  # FLUX passes them, SD3 not
        scheduler.set_timesteps(steps, device, sigmas=sigmas, mu=mu)
    else:
        scheduler.set_timesteps(steps, device="cpu")
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    return scheduler


def assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def run(
    cls: type,
    config: dict[str, Any] | list[dict[str, Any]],
    *,
    plan: list[tuple[int, int]] = PLAN,
    flow_sigmas: bool = True,
    kwargs: Callable[[torch.Generator], dict[str, Any]] = lambda generator: {},
    own_steps: frozenset[tuple[int, int]] = frozenset(),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    vectorised: bool = True,
    corrupt: Callable[[int, list[Any]], None] | None = None,
) -> int:
    """Every row's whole denoising, vectorised and alone; returns the number of vectorised calls.
    ``own_steps``: (row, step) pairs where the vectorised side steps that row with its own ``step``."""
    configs = config if isinstance(config, list) else [config] * len(plan)
    rows = [make(cls, configs[r], steps, flow_sigmas, device) for r, (steps, _) in enumerate(plan)]
    alone = [copy.deepcopy(s) for s in rows]
    generators = [torch.Generator().manual_seed(100 + r) for r in range(len(plan))]
    generators_alone = [torch.Generator().manual_seed(100 + r) for r in range(len(plan))]
    latents = [
        torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(len(plan))
    ]
    latents_alone = [x.clone() for x in latents]
    done = [0] * len(plan)
    scales = hasattr(rows[0], "scale_model_input")
    calls, mixed_calls, engine_step = 0, 0, 0
    while any(d < len(s.timesteps) for d, s in zip(done, rows, strict=True)):
        active = [
            r for r, (_, join) in enumerate(plan) if join <= engine_step and done[r] < len(rows[r].timesteps)
        ]
        if corrupt is not None:
            corrupt(engine_step, rows)
        engine_step += 1
        if not active:
            continue
        timesteps = {r: rows[r].timesteps[done[r]] for r in active}
        noise = {
            r: torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(1000 * r + done[r])).to(
                device, dtype
            )
            for r in active
        }
        expected = {}
        for r in active:
            scaled = alone[r].scale_model_input(latents_alone[r], timesteps[r]) if scales else None
            step = alone[r].step(
                noise[r], timesteps[r], latents_alone[r], **kwargs(generators_alone[r]), return_dict=False
            )
            expected[r] = (scaled, step[0])
        got = {}
        together = [r for r in active if (r, done[r]) not in own_steps]
        for r in active:
            if r not in together:  # this row steps alone on the vectorised side this time
                scaled = rows[r].scale_model_input(latents[r], timesteps[r]) if scales else None
                got[r] = (
                    scaled,
                    rows[r].step(
                        noise[r], timesteps[r], latents[r], **kwargs(generators[r]), return_dict=False
                    )[0],
                )
        if together:
            schedulers = [rows[r] for r in together]
            samples = torch.cat([latents[r] for r in together])
            outputs = torch.cat([noise[r] for r in together])
            ts = [timesteps[r] for r in together]
            step_kwargs = [kwargs(generators[r]) for r in together]
            scaled = scale_model_inputs(schedulers, samples, ts) if scales else None
            assert can_batch_step(schedulers, outputs, ts, samples, step_kwargs) == vectorised
            stepped = batched_step(schedulers, outputs, ts, samples, step_kwargs)
            for k, r in enumerate(together):
                got[r] = (None if scaled is None else scaled[k : k + 1], stepped[k : k + 1])
            calls += 1
            positions = {done[r] for r in together}
            lasts = {done[r] == len(rows[r].timesteps) - 1 for r in together}
            mixed_calls += 0 in positions and True in lasts and len(positions) > 1
        for r in active:
            if scales:
                assert_same(got[r][0], expected[r][0], f"row {r} scale_model_input at step {done[r]}")
            assert_same(got[r][1], expected[r][1], f"row {r} step {done[r]}")
            latents[r], latents_alone[r] = got[r][1], expected[r][1]
            done[r] += 1
    for r, (s, t) in enumerate(zip(rows, alone, strict=True)):
        assert_same(vars(s), vars(t), f"row {r} state")
        assert torch.equal(generators[r].get_state(), generators_alone[r].get_state()), f"row {r} generator"
    if vectorised and len(set(plan)) > 2:
        assert mixed_calls > 0, "no call had one row at its first step beside another at its last"
    return calls


# ---- every vectorised class against its own step ----------------------------------------------------------
def ddim_kwargs(generator: torch.Generator) -> dict[str, Any]:
    return {"eta": 0.0, "generator": [generator]}  # what the pipeline's prepare_extra_step_kwargs passes


def generator_kwargs(generator: torch.Generator) -> dict[str, Any]:
    return {"generator": [generator]}


CASES = {
    "ddim-tiny-sd": (diffusers.DDIMScheduler, SD, ddim_kwargs),
    "ddim-v-trailing-zero-snr": (
        diffusers.DDIMScheduler,
        {
            **SD,
            "prediction_type": "v_prediction",
            "timestep_spacing": "trailing",
            "rescale_betas_zero_snr": True,
            "set_alpha_to_one": True,
        },
        ddim_kwargs,
    ),
    "ddim-sample-linspace": (
        diffusers.DDIMScheduler,
        {**SD, "prediction_type": "sample", "timestep_spacing": "linspace"},
        ddim_kwargs,
    ),
    "euler-tiny-sdxl": (diffusers.EulerDiscreteScheduler, SDXL, generator_kwargs),
    "euler-v-karras": (
        diffusers.EulerDiscreteScheduler,
        {**SDXL, "prediction_type": "v_prediction", "use_karras_sigmas": True},
        generator_kwargs,
    ),
    "euler-from-ddim-config": (diffusers.EulerDiscreteScheduler, SD, generator_kwargs),
    "euler-trailing-sigma-min": (
        diffusers.EulerDiscreteScheduler,
        {**SDXL, "timestep_spacing": "trailing", "final_sigmas_type": "sigma_min"},
        generator_kwargs,
    ),
    "flow-tiny-flux": (diffusers.FlowMatchEulerDiscreteScheduler, FLUX, lambda g: {}),
    "flow-tiny-sd3": (diffusers.FlowMatchEulerDiscreteScheduler, SD3, lambda g: {}),
    "flow-qwen-dynamic-terminal": (diffusers.FlowMatchEulerDiscreteScheduler, QWEN, lambda g: {}),
    "flow-shift-karras": (
        diffusers.FlowMatchEulerDiscreteScheduler,
        {**SD3, "shift": 7.0, "use_karras_sigmas": True},
        lambda g: {},
    ),
    "dpm-from-ddim-config": (diffusers.DPMSolverMultistepScheduler, SD, generator_kwargs),
    "dpm-tiny-pixart": (diffusers.DPMSolverMultistepScheduler, PIXART, generator_kwargs),
    "dpm-tiny-sana-flow": (diffusers.DPMSolverMultistepScheduler, SANA, generator_kwargs),
    "dpm-karras-v": (
        diffusers.DPMSolverMultistepScheduler,
        {**PIXART, "use_karras_sigmas": True, "prediction_type": "v_prediction"},
        generator_kwargs,
    ),
    "dpm-euler-at-final": (
        diffusers.DPMSolverMultistepScheduler,
        {**PIXART, "euler_at_final": True, "lower_order_final": False, "final_sigmas_type": "sigma_min"},
        generator_kwargs,
    ),
    "dpm-second-order-last": (  # sigma_min final sigma, no lower-order final: 2nd order to the end
        diffusers.DPMSolverMultistepScheduler,
        {**PIXART, "lower_order_final": False, "final_sigmas_type": "sigma_min", "prediction_type": "sample"},
        generator_kwargs,
    ),
    "pndm-sd15": (diffusers.PNDMScheduler, SD15_PNDM, lambda g: {}),
    "pndm-v-trailing": (
        diffusers.PNDMScheduler,
        {
            **SD15_PNDM,
            "prediction_type": "v_prediction",
            "timestep_spacing": "trailing",
            "set_alpha_to_one": True,
        },
        lambda g: {},
    ),
    "pndm-linspace": (diffusers.PNDMScheduler, {**SD15_PNDM, "timestep_spacing": "linspace"}, lambda g: {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vectorised_rows_equal_their_own_step_at_every_call_and_end_in_its_state(case):
    cls, config, kwargs = CASES[case]
    assert can_batch(cls.from_config(config))
    # A shift_terminal schedule needs 2 steps (1 gives NaN sigmas; the server's minimum is 2 there).
    plan = [(max(steps, 2), join) for steps, join in PLAN] if config.get("shift_terminal") else PLAN
    assert run(cls, config, plan=plan, kwargs=kwargs) > 10


@pytest.mark.parametrize("case", list(CASES))
def test_rows_at_one_step_of_one_schedule_equal_their_own_step(case):
    """Homogeneous traffic: rows at the same step of the same schedule share one coefficient row (not
    stacked), beside calls where two joined later and sit at other steps."""
    cls, config, kwargs = CASES[case]
    assert run(cls, config, plan=[(8, 0)] * 4 + [(8, 3)] * 2, kwargs=kwargs) > 8


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["ddim-tiny-sd", "euler-v-karras", "pndm-sd15"])
def test_on_cuda_rows_at_one_step_of_one_schedule_equal_their_own_step(case, dtype):
    """The shared coefficient row made dense and copied to the GPU."""
    cls, config, kwargs = CASES[case]
    run(cls, config, plan=[(8, 0)] * 4 + [(8, 3)] * 2, kwargs=kwargs, dtype=dtype, device="cuda")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "case", ["ddim-tiny-sd", "euler-v-karras", "flow-tiny-flux", "dpm-tiny-pixart", "pndm-sd15"]
)
def test_on_cuda_the_rounding_of_per_row_scalars_is_reproduced(case, dtype):
    """CPU scalars at float precision, division as a reciprocal multiplication, device scalars cast first:
    the rules read from PyTorch's CUDA kernels, checked where a GPU runs this."""
    cls, config, kwargs = CASES[case]
    run(cls, config, kwargs=kwargs, dtype=dtype, device="cuda")


def test_flow_matching_without_custom_sigmas_as_sd3_sets_them():
    assert run(diffusers.FlowMatchEulerDiscreteScheduler, SD3, flow_sigmas=False) > 10


@pytest.mark.parametrize(
    "case", ["ddim-tiny-sd", "euler-v-karras", "flow-tiny-flux", "dpm-from-ddim-config", "pndm-sd15"]
)
def test_a_row_moves_between_the_vectorised_path_and_its_own_step_at_any_step(case):
    cls, config, kwargs = CASES[case]
    rng = np.random.default_rng(7)
    own = frozenset(
        (r, step) for r, (steps, _) in enumerate(PLAN) for step in range(steps + 1) if rng.random() < 0.3
    )
    run(cls, config, kwargs=kwargs, own_steps=own)


@pytest.mark.parametrize(
    ("cls", "configs"),
    [
        (diffusers.DDIMScheduler, [SD, {**SD, "prediction_type": "v_prediction"}]),
        (diffusers.EulerDiscreteScheduler, [SDXL, {**SDXL, "prediction_type": "v_prediction"}, SD]),
        (diffusers.DPMSolverMultistepScheduler, [PIXART, SANA, SD]),
        (diffusers.PNDMScheduler, [SD15_PNDM, {**SD15_PNDM, "prediction_type": "v_prediction"}]),
    ],
)
def test_rows_of_one_class_with_different_configs_share_a_call(cls, configs):
    run(cls, [configs[r % len(configs)] for r in range(len(PLAN))])


# ---- the checks have teeth --------------------------------------------------------------------------------
def bump_step_index(engine_step: int, rows: list[Any]) -> None:
    if engine_step == 5:
        rows[2]._step_index += 1


def forget_past(engine_step: int, rows: list[Any]) -> None:
    if engine_step == 5:
        rows[2].lower_order_nums = 0  # DPM-Solver: a first-order step where the second was due


def drop_an_et(engine_step: int, rows: list[Any]) -> None:
    if engine_step == 6:
        rows[2].ets = rows[2].ets[-1:]  # PLMS: a lower-order formula


@pytest.mark.parametrize(
    ("case", "corrupt"),
    [
        ("euler-tiny-sdxl", bump_step_index),
        ("flow-tiny-flux", bump_step_index),
        ("dpm-from-ddim-config", forget_past),
        ("pndm-sd15", drop_an_et),
    ],
)
def test_a_wrong_row_state_is_caught(case, corrupt):
    cls, config, kwargs = CASES[case]
    with pytest.raises(AssertionError):
        run(cls, config, kwargs=kwargs, corrupt=corrupt)


def test_a_wrong_timestep_is_caught():
    """DDIM keeps no state: its step follows the timestep; give the vectorised side another row's."""
    cls, config, kwargs = CASES["ddim-tiny-sd"]
    rows = [make(cls, config, steps, True) for steps in (4, 8)]
    alone = [copy.deepcopy(s) for s in rows]
    samples, outputs = torch.randn(2, *SHAPE), torch.randn(2, *SHAPE)
    ts = [rows[0].timesteps[1], rows[1].timesteps[1]]
    stepped = batched_step(rows, outputs, [ts[1], ts[1]], samples, [{"eta": 0.0}] * 2)
    own = alone[0].step(outputs[:1], ts[0], samples[:1], eta=0.0, return_dict=False)[0]
    assert not torch.equal(stepped[:1], own)


# ---- what falls back steps row by row, with the same result -----------------------------------------------
FALLBACKS = {
    "ddim-clip-sample": (diffusers.DDIMScheduler, {**SD, "clip_sample": True}, ddim_kwargs),
    "ddim-thresholding": (diffusers.DDIMScheduler, {**SD, "thresholding": True}, ddim_kwargs),
    "euler-ancestral": (diffusers.EulerAncestralDiscreteScheduler, SD, generator_kwargs),
    "dpm-dpmsolver": (
        diffusers.DPMSolverMultistepScheduler,
        {**PIXART, "algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"},
        generator_kwargs,
    ),
    "dpm-third-order": (
        diffusers.DPMSolverMultistepScheduler,
        {**PIXART, "solver_order": 3},
        generator_kwargs,
    ),
    "dpm-sde": (
        diffusers.DPMSolverMultistepScheduler,
        {**PIXART, "algorithm_type": "sde-dpmsolver++"},
        generator_kwargs,
    ),
    "flow-stochastic": (
        diffusers.FlowMatchEulerDiscreteScheduler,
        {**FLUX, "stochastic_sampling": True},
        generator_kwargs,
    ),
    "pndm-with-prk-steps": (diffusers.PNDMScheduler, SD, lambda g: {}),
    "unipc": (diffusers.UniPCMultistepScheduler, SD, lambda g: {}),
    "heun": (diffusers.HeunDiscreteScheduler, SD, lambda g: {}),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_an_unsupported_config_steps_row_by_row_with_the_same_result(case):
    cls, config, kwargs = FALLBACKS[case]
    assert not can_batch(cls.from_config(config))
    # PNDM's Runge-Kutta warm-up needs 4 steps or more.
    plan = [(max(steps, 4), join) for steps, join in PLAN] if cls is diffusers.PNDMScheduler else PLAN
    run(cls, config, plan=plan, kwargs=kwargs, vectorised=False)


def test_an_unsupported_step_argument_steps_row_by_row():
    """Euler with s_churn draws noise from each row's generator: stepped row by row, generators equal."""
    run(
        diffusers.EulerDiscreteScheduler,
        SDXL,
        kwargs=lambda g: {"generator": g, "s_churn": 1.0},
        vectorised=False,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_precision_steps_row_by_row(dtype):
    # CPU half-precision kernels round a scalar by operand order: not reproduced, so not vectorised.
    run(diffusers.DPMSolverMultistepScheduler, PIXART, kwargs=generator_kwargs, dtype=dtype, vectorised=False)


def test_rows_of_different_classes_step_row_by_row():
    rows = [make(diffusers.DDIMScheduler, SD, 4, True), make(diffusers.EulerDiscreteScheduler, SD, 4, True)]
    alone = [copy.deepcopy(s) for s in rows]
    samples, outputs = torch.randn(2, *SHAPE), torch.randn(2, *SHAPE)
    ts = [s.timesteps[0] for s in rows]
    kwargs = [{"eta": 0.0}, {}]
    assert not can_batch_step(rows, outputs, ts, samples, kwargs)
    stepped = batched_step(rows, outputs, ts, samples, kwargs)
    for k, s in enumerate(alone):
        assert torch.equal(
            stepped[k : k + 1], s.step(outputs[k : k + 1], ts[k], samples[k : k + 1], **kwargs[k])[0]
        )


# ---- guidance and input scaling ---------------------------------------------------------------------------
SCALES = [7.5, 1.0, 3.3, 0.0, 12.25, 2.0001, 5.1]


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    + [pytest.param("cuda", dtype, marks=CUDA) for dtype in (torch.float16, torch.bfloat16, torch.float32)],
)
def test_guide_equals_the_per_row_formula(device, dtype):
    predictions = torch.randn(2 * len(SCALES), *SHAPE, generator=torch.Generator().manual_seed(3))
    predictions = predictions.to(device, dtype)
    uncond, cond = predictions[0::2], predictions[1::2]  # the engine's [uncond, cond] rows, as views
    one_scale = [SCALES[0]] * len(SCALES)  # homogeneous traffic: one scale for every row
    for scales in (SCALES, torch.tensor(SCALES, dtype=torch.float64), one_scale):
        guided = guide(uncond, cond, scales)
        assert guided.dtype == dtype
        for r, g in enumerate(scales.tolist() if isinstance(scales, torch.Tensor) else scales):
            row = uncond[r : r + 1] + g * (cond[r : r + 1] - uncond[r : r + 1])
            assert torch.equal(guided[r : r + 1], row), r


def test_guide_tells_a_negative_zero_scale_from_zero():
    """Scales equal by == but not in bits (0.0, -0.0) are not one scale: row by row, the sign of a zero
    result follows each row's own scale."""
    uncond, cond = torch.full((2, 4), -0.0), torch.ones(2, 4)
    guided = guide(uncond, cond, [0.0, -0.0])
    for r, g in enumerate([0.0, -0.0]):
        row = uncond[r : r + 1] + g * (cond[r : r + 1] - uncond[r : r + 1])
        assert torch.equal(guided[r : r + 1].view(torch.int32), row.view(torch.int32)), r


def test_guide_with_one_scale_for_all_rows_is_not_the_per_row_formula():
    """The check has teeth: one row's scale given to all differs."""
    uncond, cond = torch.randn(3, *SHAPE), torch.randn(3, *SHAPE)
    guided = guide(uncond, cond, [SCALES[0]] * 3)
    assert not torch.equal(guided[1:2], uncond[1:2] + SCALES[1] * (cond[1:2] - uncond[1:2]))


def test_scale_model_inputs_of_mixed_classes_equal_each_rows_own():
    def rows() -> list[Any]:
        return [
            make(diffusers.EulerDiscreteScheduler, SDXL, 8, True),
            make(diffusers.DDIMScheduler, SD, 4, True),
            make(diffusers.EulerDiscreteScheduler, {**SDXL, "use_karras_sigmas": True}, 25, True),
            make(diffusers.DPMSolverMultistepScheduler, SD, 6, True),
            make(diffusers.PNDMScheduler, SD15_PNDM, 6, True),
        ]

    for extra in ([], [make(diffusers.HeunDiscreteScheduler, SD, 5, True)]):  # Heun scales row by row
        schedulers, alone = rows() + extra, rows() + copy.deepcopy(extra)
        samples = torch.randn(len(schedulers), *SHAPE)
        ts = [s.timesteps[0] for s in schedulers]
        scaled = scale_model_inputs(schedulers, samples, ts)
        for k, (s, t) in enumerate(zip(alone, ts, strict=True)):
            assert torch.equal(scaled[k : k + 1], s.scale_model_input(samples[k : k + 1], t)), k
        for s, t in zip(schedulers, alone, strict=True):
            assert_same(vars(s), vars(t), type(s).__name__)
    only_unscaled, sample = [make(diffusers.DDIMScheduler, SD, 4, True)], torch.randn(1, *SHAPE)
    assert scale_model_inputs(only_unscaled, sample, [only_unscaled[0].timesteps[0]]) is sample


# ---- the step engine's adapter: guidance, grouping by class, the failure contract ------------------------
class ForwardOnly(LatentStepAdapter):
    """LatentStepAdapter.step around a fixed forward (no pipeline): predictions are given."""

    scales_model_input = True

    def __init__(self, predictions: torch.Tensor) -> None:
        self.device = "cpu"
        self.facts = SimpleNamespace(traits=PipelineTraits())  # a family without special traits
        self.predictions = predictions
        self.inputs: list[torch.Tensor] = []
        self.caches = JobCaches(torch.nn.Module(), (), per_branch=False)  # it serves no step cache

    def predict(self, latents, timesteps, inputs, size):
        self.inputs.append(latents)
        return self.predictions


def test_the_adapter_step_equals_each_jobs_own_and_a_failing_scheduler_fails_only_its_job(caplog):
    # (scheduler, config, steps, guidance or None, step kwargs); the last DDIM job's timestep is past the
    # end of its alphas table: its own step raises, which makes its class's vectorised call raise too.
    specs = [
        (diffusers.DDIMScheduler, SD, 4, 7.5, ddim_kwargs),
        (diffusers.EulerDiscreteScheduler, SDXL, 6, None, generator_kwargs),
        (diffusers.DPMSolverMultistepScheduler, SD, 5, 3.0, generator_kwargs),
        (diffusers.EulerDiscreteScheduler, {**SDXL, "use_karras_sigmas": True}, 8, 5.5, generator_kwargs),
        (diffusers.HeunDiscreteScheduler, SD, 3, 2.0, lambda g: {}),  # not vectorised: steps alone
        (diffusers.DDIMScheduler, SD, 4, None, ddim_kwargs),
        (diffusers.DDIMScheduler, SD, 4, 1.5, ddim_kwargs),  # the broken one
    ]
    jobs, alone, rows = [], [], 0
    for i, (cls, config, steps, guidance, kwargs) in enumerate(specs):
        scheduler = make(cls, config, steps, True)
        timesteps = scheduler.timesteps.clone()
        if i == len(specs) - 1:
            timesteps[:] = 5000
        state = LatentJob(
            latents=torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(i)),
            scheduler=scheduler,
            timesteps=timesteps,
            conditional={"text": torch.full((1, 2), float(i))},
            unconditional=None if guidance is None else {"text": torch.zeros(1, 2)},
            guidance=guidance or 0.0,
            step_kwargs=kwargs(torch.Generator().manual_seed(i)),
            extra={},
        )
        job = Job(request=None, params=SimpleNamespace(size=(8, 8), lora=()))
        job.state, job.run.total_steps = state, steps
        jobs.append(job)
        alone.append(
            (copy.deepcopy(scheduler), state.latents.clone(), kwargs(torch.Generator().manual_seed(i)))
        )
        rows += 1 if guidance is None else 2
    predictions = torch.randn(rows, *SHAPE, generator=torch.Generator().manual_seed(99))
    adapter = ForwardOnly(predictions)
    result = adapter.step(jobs)
    assert not any(step.done for step in result.steps)  # nobody's last step
    assert "vectorised DDIMScheduler step of 3 jobs failed" in caplog.text  # then redone job by job

    inputs, row = [], 0
    for i, (job, (scheduler, latents, kwargs)) in enumerate(zip(jobs, alone, strict=True)):
        t = job.state.timesteps[0]
        guidance = specs[i][3]
        if i == len(specs) - 1:
            with pytest.raises(IndexError):
                scheduler.step(predictions[row : row + 1], t, latents, **kwargs)
            assert result.steps[i].error is not None and result.steps[i].error.text.startswith("IndexError")
            break
        x = scheduler.scale_model_input(latents, t)
        inputs += [x] if guidance is None else [x, x]
        if guidance is None:
            noise = predictions[row : row + 1]
        else:
            uncond, cond = predictions[row : row + 1], predictions[row + 1 : row + 2]
            noise = uncond + guidance * (cond - uncond)
        row += 1 if guidance is None else 2
        expected = scheduler.step(noise, t, latents, **kwargs, return_dict=False)[0]
        assert result.steps[i].error is None, i
        assert torch.equal(job.state.latents, expected), i
        assert_same(vars(job.state.scheduler), vars(scheduler), f"job {i} state")
    assert torch.equal(adapter.inputs[0][: len(inputs)], torch.cat(inputs))
