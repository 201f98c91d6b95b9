"""Test-only faults, installed by the tests around a shipped model kind: nothing of it is in the
package (src/), and a served model has no way to turn it on.

:func:`copy_model` copies a shipped model as the server_process helper does; given ``fault_injection``
(JSON) among its parameters, it writes a model.py that serves the kind through :func:`with_faults`
instead of the shipped one. ``{"fail_on_prompt": "boom", "oom_above_rows": 4, "step_delay_s": 0.1}``
makes any pipeline call (or step-engine forward) raise when one of its prompts contains "boom", raise a
simulated out-of-memory when it holds more than 4 rows, and sleep 100 ms after every denoising step (a
stalled step, so a test can cancel mid-call). ``{"stall_on_prompt": "hang"}`` blocks a forward holding
such a prompt for good (a deadlock, a kernel that never returns), for the engine host's watchdog.
``{"device_lost_on_prompt": "xid"}`` raises what a failed GPU raises (a sticky CUDA error), so the
process exits and the supervisor restarts the server. ``{"hold_on_prompt": "__hold__"}`` (step engine):
a request whose prompt carries the marker and that has shared no forward yet waits before its second
forward (``__hold__10``: its eleventh) until the engine holds another job (``__hold__1of9``: until it
holds nine), at most ``hold_s`` (30 s): requests sent once the first one's progress says it runs
certainly share its forwards, whatever the machine's speed. ``{"exit_on_seed": 1234,
"exit_after_step": 7}`` (step engine, with checkpoints): the process dies (``os._exit(1)``: what the OOM
killer or a lost device does to it, no answer sent) right after the engine step in which a job of a
request with seed 1234 completed its 7th denoising step, once the checkpoints taken so far are on disk;
only the first time for a checkpoint_dir (a marker file ``<checkpoint_dir>.exited`` beside it says it
happened), so the restarted server serves the resend. Keyed on the seed, not the prompt, so the resend
and its reference are the same pipeline call. Each fault is a wrapper around what the kind's ``setup``
returned (serving/triton_model.py's Hosting): :class:`FaultyStepAdapter` around the step adapter,
:class:`FaultyCall` around the request-level engine's fused call, :func:`exiting_resumes` in place of
the model's checkpoints. Durations are in seconds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from triton_diffusion.engine.step_engine import StepEngine, computed_by
from triton_diffusion.recovery.resumes import FLUSH_S, Resumes
from triton_diffusion.serving import server_process
from triton_diffusion.serving.engines import RequestEngineKind, StepEngineKind
from triton_diffusion.serving.triton_model import Hosting

log = logging.getLogger("triton_diffusion")


class InjectedFault(RuntimeError):
    pass


class SimulatedOutOfMemoryError(MemoryError):
    pass


class AcceleratorError(RuntimeError):
    """Named like torch.AcceleratorError, which failures.py recognises by name."""


@dataclass(frozen=True)
class FaultInjection:
    fail_on_prompt: str | None = None
    oom_above_rows: int | None = None
    step_delay_s: float = 0.0
    device_lost_on_prompt: str | None = None
    stall_on_prompt: str | None = None
    hold_on_prompt: str | None = None
    hold_s: float = 30.0  # the longest hold (far below engine_stall_s: the watchdog never fires for it)
    exit_on_seed: int | None = None
    exit_after_step: int = 1

    @classmethod
    def from_config(cls, text: str | None) -> FaultInjection | None:
        if not text:
            return None
        raw = json.loads(text)
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"fault_injection: unknown keys {sorted(unknown)}")
        return cls(**raw)

    def before_call(self, prompts: Sequence[str]) -> None:
        if self.oom_above_rows is not None and len(prompts) > self.oom_above_rows:
            raise SimulatedOutOfMemoryError(
                f"simulated out of memory: {len(prompts)} rows > {self.oom_above_rows}"
            )
        if self.device_lost_on_prompt and any(self.device_lost_on_prompt in p for p in prompts):
            raise AcceleratorError("CUDA error: an illegal memory access was encountered (simulated)")
        if self.stall_on_prompt and any(self.stall_on_prompt in p for p in prompts):
            threading.Event().wait()  # never set: this thread is stuck, as with a deadlock
        if self.fail_on_prompt and any(self.fail_on_prompt in p for p in prompts):
            raise InjectedFault(f"injected failure for a prompt containing {self.fail_on_prompt!r}")

    def after_step(self) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def exit_due(self, seed: int, step: int) -> bool:
        """``exit_on_seed``: a job of a request with this seed just completed its ``exit_after_step``-th
        denoising step."""
        return self.exit_on_seed is not None and seed == self.exit_on_seed and step == self.exit_after_step

    def hold_from(self, prompt: str) -> int | None:
        """The steps a row with this prompt takes before it is held (None: never held): the number right
        after the marker, 1 without one."""
        found = self._hold_marker(prompt)
        return None if found is None else int(found.group(1) or 1)

    def hold_until(self, prompt: str) -> int:
        """The jobs the engine must hold before a held row goes on: ``of N`` after the marker, else 0 (one
        more than the forward's own jobs)."""
        found = self._hold_marker(prompt)
        return 0 if found is None or not found.group(2) else int(found.group(2))

    def _hold_marker(self, prompt: str) -> re.Match[str] | None:
        if not self.hold_on_prompt:
            return None
        return re.search(re.escape(self.hold_on_prompt) + r"(\d*)(?:of(\d+))?", prompt)


class FaultyStepAdapter:
    """A step adapter (engine/step_engine.py's StepAdapter) with the faults around its forward: the engine
    sees the failures a real model would give it. ``prompt_of`` names a job's prompt."""

    def __init__(self, adapter: Any, faults: FaultInjection, prompt_of: Callable[[Any], str]) -> None:
        self.adapter = adapter
        self.faults = faults
        self.prompt_of = prompt_of
        self.held: Callable[[], int] | None = None  # the jobs the engine holds (set where it is built)
        self.computed = computed_by(adapter)  # a forward's rows and tokens, as the wrapped adapter counts

    def prepare(self, jobs: list[Any]) -> list[Any]:
        return self.adapter.prepare(jobs)

    def step(self, jobs: list[Any], previews: Any = None) -> Any:
        self.faults.before_call([self.prompt_of(job) for job in jobs])
        self._hold(jobs)
        result = self.adapter.step(jobs, previews)
        self.faults.after_step()
        return result

    def finish(self, jobs: list[Any]) -> list[Any]:
        return self.adapter.finish(jobs)

    def checkpoint(self, jobs: list[Any]) -> list[Any]:
        return self.adapter.checkpoint(jobs)

    def _hold(self, jobs: list[Any]) -> None:
        """``hold_on_prompt``: a forward whose jobs all carry the marker, have taken exactly their steps
        before the hold (so each is held once) and never shared a forward with as many jobs as their marker
        waits for (``of N``; without it, any other) waits until the engine holds a job beside them (the
        newcomer joins at the next engine step), or ``N`` jobs, at most ``hold_s``. Between two forwards,
        so the progress of the last one goes out. (Two of five sent together may share their first
        forward: they are held all the same until the five are in.)"""
        if self.held is None:
            return
        for job in jobs:
            prompt = self.prompt_of(job)
            steps = self.faults.hold_from(prompt)
            shared_enough = job.stats.most_shared >= max(2, self.faults.hold_until(prompt))
            if steps is None or job.run.steps_done != steps or shared_enough:
                return
        needed = max([len(jobs) + 1, *(self.faults.hold_until(self.prompt_of(job)) for job in jobs)])
        deadline = time.monotonic() + self.faults.hold_s
        while self.held() < needed and time.monotonic() < deadline:
            time.sleep(0.005)


def exiting_resumes(resumes: Resumes, faults: FaultInjection, seed_of: Callable[[Any], int]) -> Resumes:
    """``exit_on_seed``: the model's checkpoints (recovery/resumes.py), with the process dying right
    after the step report in which a job of a request with that seed completed its ``exit_after_step``-th
    denoising step, once the checkpoints taken so far are written (``os._exit(1)``: what the OOM killer
    does, no answer sent); only the first time for a checkpoint folder (a marker ``<checkpoint_dir>.exited``
    beside it says it happened), so the restarted server serves the resend. Installed where the model
    is set up, in place of its Resumes: nothing of it runs in a model without the fault."""
    directory = Path(resumes.store.directory)
    marker = directory.with_name(directory.name + ".exited")

    class ExitingResumes(Resumes):
        def persist(self, report: Any) -> None:
            super().persist(report)
            for stepped in report.stepped:
                if faults.exit_due(seed_of(stepped.job), stepped.step) and not marker.exists():
                    self.store.flush(FLUSH_S)
                    marker.write_text(f"exited after step {stepped.step}\n")
                    log.critical("fault injection: exiting after step %d (exit_on_seed)", stepped.step)
                    os._exit(1)

    return ExitingResumes(resumes.store, resumes.every, resumes.identity)


def prompt_of(job: Any) -> str:
    """A job's prompt: a step-engine image's parameters hold it, a request-level image's hold its
    request's values, a diffusion LM's parsed request holds it (its parameters hold token ids)."""
    params = job.spec.params
    prompt = getattr(params, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    values = getattr(params, "values", None)
    return values["prompt"] if isinstance(values, dict) else job.record.parsed.prompt


@dataclass(frozen=True)
class HeldStepEngineKind(StepEngineKind):
    """The step engine over a FaultyStepAdapter, which learns how many jobs the engine holds (what
    ``hold_on_prompt`` waits on) once the engine is built."""

    def build(self, settings: Any, on_progress: Callable[[Any], None]) -> StepEngine:
        engine = super().build(settings, on_progress)
        self.adapter.held = lambda: engine.active  # type: ignore[attr-defined]
        return engine


@dataclass(frozen=True)
class FaultyCall:
    """The request-level engine's fused call with the faults around it: checked before the call, the
    stalled step after each of its denoising steps (as the pipeline's step callback reports it)."""

    call: Any
    faults: FaultInjection

    def __call__(self, key: Any, jobs: list[Any], steps: Any) -> list[Any]:
        self.faults.before_call([prompt_of(job) for job in jobs])
        return self.call(key, jobs, SlowSteps(steps, self.faults))


class SlowSteps:
    """A fused call's CallSteps whose every step report comes after the stalled step."""

    def __init__(self, steps: Any, faults: FaultInjection) -> None:
        self.steps, self.faults = steps, faults

    def on_step(self, *args: Any, **kwargs: Any) -> Any:
        self.faults.after_step()
        return self.steps.on_step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.steps, name)


def with_faults(kind: type, text: str) -> type:
    """``kind`` (a model kind of models/) with the faults ``text`` (JSON) describes around what its
    ``setup`` returns: what a test model's model.py serves."""
    faults = FaultInjection.from_config(text)
    assert faults is not None, "no faults given"

    class Faulty(kind):  # type: ignore[valid-type, misc]
        def setup(self, settings: Any, metrics: Any) -> Hosting:
            hosting: Hosting = super().setup(settings, metrics)
            engine_kind: Any = hosting.engine_kind
            if isinstance(engine_kind, StepEngineKind):
                adapter = FaultyStepAdapter(engine_kind.adapter, faults, prompt_of)
                values = {f.name: getattr(engine_kind, f.name) for f in fields(engine_kind)}
                engine_kind = HeldStepEngineKind(**{**values, "adapter": adapter})
            elif isinstance(engine_kind, RequestEngineKind):
                engine_kind = replace(engine_kind, call=FaultyCall(engine_kind.call, faults))
            resumes = hosting.resumes
            if resumes is not None and faults.exit_on_seed is not None:
                resumes = exiting_resumes(resumes, faults, seed_of=lambda job: job.spec.params.seed)
            return replace(hosting, engine_kind=engine_kind, resumes=resumes)

    Faulty.__name__ = Faulty.__qualname__ = kind.__name__
    return Faulty


def copy_model(source: str, target_repo: Path, name: str, edits: dict[str, str], extra: str = "") -> None:
    """server_process.copy_model, and with ``fault_injection`` (JSON) among ``edits`` a model.py that
    serves the shipped kind with those faults (:func:`with_faults`)."""
    edits = dict(edits)
    text = edits.pop("fault_injection", None)
    # A mistake in a test's faults fails here, not in the server's log.
    if text is not None and FaultInjection.from_config(text) is None:
        raise ValueError("fault_injection: no faults given")
    server_process.copy_model(source, target_repo, name, edits, extra)
    if text is None:
        return
    model_py = target_repo / name / "1" / "model.py"
    shipped = model_py.read_text()
    served, count = re.subn(
        r'serve\("(\w+)"\)', lambda m: f"serve(with_faults(kind_class({m[1]!r}), {text!r}))", shipped
    )
    assert count == 1, f"{source}'s model.py does not name one served kind"
    root = Path(__file__).resolve().parent.parent
    header = (
        f"import sys\n\nsys.path.insert(0, {str(root)!r})  # the tests' faults\n"
        "from tests.faults import with_faults\n"
        "from triton_diffusion.models.model_file import kind_class\n"
    )
    # Before its first import (after its docstring and any __future__ import).
    first = re.search(r"^(from|import) (?!__future__)", served, re.M)
    assert first is not None, f"{source}'s model.py imports nothing"
    model_py.write_text(served[: first.start()] + header + served[first.start() :])
