"""diffusers through one door (adapters/diffusers_compat.py): each private name it lists exists on the
installed diffusers, none is used outside it, and the state it names for each scheduler is all that
scheduler changes while it steps. On a diffusers upgrade these fail by name."""

from __future__ import annotations

import copy
import importlib
import inspect
import re
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch

from triton_diffusion.adapters import diffusers_compat
from triton_diffusion.adapters.diffusers_compat import PRIVATE_NAMES, SCHEDULER_STEP_STATE

SRC = Path(diffusers_compat.__file__).resolve().parents[1]


def owner(name: str) -> object:
    if ":" in name:  # a class of a module: models.transformers.transformer_flux:FluxAttnProcessor
        module, cls = name.split(":")
        return getattr(importlib.import_module(f"diffusers.{module}"), cls)
    if "." in name:  # a private module: diffusers.hooks._helpers
        return importlib.import_module(f"diffusers.{name}")
    return getattr(diffusers, name)


@pytest.mark.parametrize(("cls", "name"), PRIVATE_NAMES, ids=[f"{c}.{n}" for c, n in PRIVATE_NAMES])
def test_each_private_name_is_where_diffusers_compat_reads_it(cls, name):
    has = owner(cls)
    # A class attribute or method, or an instance attribute its own code sets (self.<name> = ...).
    found = hasattr(has, name) or (inspect.isclass(has) and f"self.{name} =" in inspect.getsource(has))
    assert found, f"diffusers.{cls} no longer has {name}"


def test_no_private_diffusers_name_is_used_outside_the_door():
    names = "|".join(re.escape(n) for n in sorted({name for _, name in PRIVATE_NAMES}))
    # an attribute, a getattr/hasattr by name, or an import of a private diffusers module
    used = re.compile(rf"\.({names})\b|attr\([^)]*[\"']({names})[\"']|diffusers[\w.]*\._[A-Za-z]\w*")
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "diffusers_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r"\b(self|cls)\._\w+", "", line.split("#", 1)[0])  # our own privates
            if used.search(code):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "private diffusers names outside adapters/diffusers_compat.py:\n" + "\n".join(found)


def identity(value):
    """What tells whether a value changed (independent of job_checkpoints' own code)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().clone())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(identity(v) for v in value))
    return ("value", type(value).__name__, value if isinstance(value, (int, float, str, bool)) else id(value))


def same(a, b) -> bool:
    if a[0] != b[0] or len(a) != len(b):
        return False
    if a[0] == "tensor":  # NaN where it was NaN is unchanged (KDPM2's tables hold one)
        x, y = a[3], b[3]
        return (
            a[1:3] == b[1:3]
            and torch.equal(x.isnan(), y.isnan())
            and torch.equal(x.nan_to_num(), y.nan_to_num())
        )
    if a[0] in ("list", "tuple"):
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1], strict=True))
    return a == b


CONFIGS = [(name, {}) for name in SCHEDULER_STEP_STATE] + [
    ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    ("UniPCMultistepScheduler", {"solver_order": 3}),
    ("PNDMScheduler", {"skip_prk_steps": True}),
]


@pytest.mark.parametrize(("name", "config"), CONFIGS, ids=[n + ("+" if c else "") for n, c in CONFIGS])
def test_a_scheduler_changes_only_its_named_state_while_it_steps(name, config):
    cls = getattr(diffusers, name)
    try:
        scheduler = cls(**config)
    except ImportError as missing:  # LMS needs scipy
        pytest.skip(str(missing))
    scheduler.set_timesteps(8)
    start = {k: identity(v) for k, v in vars(scheduler).items()}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    takes_generator = "generator" in inspect.signature(scheduler.step).parameters
    kwargs = {"generator": generator} if takes_generator else {}
    changed = set()
    for t in scheduler.timesteps[:5]:
        if hasattr(scheduler, "scale_model_input"):  # flow matching has none
            x = scheduler.scale_model_input(x, t)
        x = scheduler.step(torch.tanh(x), t, x, **kwargs).prev_sample
        now = {k: identity(v) for k, v in vars(scheduler).items()}
        changed |= {k for k, v in now.items() if k not in start or not same(start[k], v)}
    named = set(SCHEDULER_STEP_STATE[name])
    assert named <= set(vars(scheduler)), f"{name} has none of {sorted(named - set(vars(scheduler)))}"
    assert changed <= named, f"{name} now also changes {sorted(changed - named)} while it steps"
    # The check can tell: every scheduler that keeps a step count or a history changed some of it (DDIM and
    # DDPM keep none: a step reads the timestep alone).
    assert bool(changed) == bool(named), f"{name}: named {sorted(named)}, changed {sorted(changed)}"


def value_of(value):
    """A value as it stands now, numpy arrays by their contents too (a template's write-through shows)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(value_of(v) for v in value))
    return identity(value)


@pytest.mark.parametrize(("name", "config"), CONFIGS, ids=[n + ("+" if c else "") for n, c in CONFIGS])
def test_a_jobs_scheduler_from_its_template_steps_as_a_deep_copy_and_leaves_the_template_alone(name, config):
    """diffusers_compat.job_scheduler: two jobs' schedulers from one template, each given its timesteps (8
    steps) and stepped in turn on inputs of its own, each step bit for bit as a deep copy of the template
    stepped alone on the same inputs; and the template (its tensors and arrays by their contents) is as it
    was."""
    try:
        template = getattr(diffusers, name)(**config)
    except ImportError as missing:  # LMS needs scipy
        pytest.skip(str(missing))
    before = {k: value_of(v) for k, v in vars(template).items()}
    jobs = {seed: (diffusers_compat.job_scheduler(template), copy.deepcopy(template)) for seed in (0, 1)}
    xs = {}
    for seed, pair in jobs.items():
        for which, scheduler in enumerate(pair):
            scheduler.set_timesteps(8)
            generator = torch.Generator().manual_seed(seed)
            xs[seed, which] = (torch.randn(1, 4, 8, 8, generator=generator), generator)
    takes_generator = "generator" in inspect.signature(template.step).parameters
    for t in jobs[0][1].timesteps[:5]:
        for seed, pair in jobs.items():  # the two jobs in turn, each beside its deep copy
            for which, scheduler in enumerate(pair):
                x, generator = xs[seed, which]
                if hasattr(scheduler, "scale_model_input"):  # flow matching has none
                    x = scheduler.scale_model_input(x, t)
                kwargs = {"generator": generator} if takes_generator else {}
                xs[seed, which] = (scheduler.step(torch.tanh(x), t, x, **kwargs).prev_sample, generator)
            assert torch.equal(xs[seed, 0][0], xs[seed, 1][0]), f"{name}, job {seed} at {t}"
    assert not torch.equal(xs[0, 0][0], xs[1, 0][0])  # the two jobs' inputs differed
    after = {k: value_of(v) for k, v in vars(template).items()}
    assert before.keys() == after.keys() and all(same(before[k], after[k]) for k in before), name


@pytest.mark.parametrize("name", ["DPMSolverMultistepScheduler", "DEISMultistepScheduler"])
def test_a_jobs_dynamic_shift_is_its_own_not_the_templates_or_another_jobs(name):
    """``set_timesteps(mu=...)`` writes the shift into the scheduler's config object: each job's scheduler
    has its own config, so two jobs with different shifts step as deep copies given the same shifts, and
    the template's config keeps its own."""
    config = {"use_dynamic_shifting": True, "use_flow_sigmas": True, "prediction_type": "flow_prediction"}
    template = getattr(diffusers, name)(**config, time_shift_type="exponential")
    shift = template.config.flow_shift
    jobs = {mu: (diffusers_compat.job_scheduler(template), copy.deepcopy(template)) for mu in (0.3, 1.2)}
    for mu, pair in jobs.items():
        for scheduler in pair:
            scheduler.set_timesteps(6, mu=mu)
    for mu, (job, alone) in jobs.items():
        assert job.config.flow_shift == pytest.approx(np.exp(mu)), (mu, job.config.flow_shift)
        assert torch.equal(job.sigmas, alone.sigmas) and torch.equal(job.timesteps, alone.timesteps)
    assert not torch.equal(jobs[0.3][0].sigmas, jobs[1.2][0].sigmas)
    assert template.config.flow_shift == shift
