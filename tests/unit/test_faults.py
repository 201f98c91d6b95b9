"""The tests' faults (tests/faults.py) are installed around a shipped model kind by a test model file:
what it wraps, and the model.py it writes."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import tests.faults as faults_module
from tests.faults import (
    FaultInjection,
    FaultyCall,
    FaultyStepAdapter,
    HeldStepEngineKind,
    InjectedFault,
    SimulatedOutOfMemoryError,
    copy_model,
    with_faults,
)
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.models.diffusion_model import RowInput
from triton_diffusion.serving.engines import RequestEngineKind, StepEngineKind
from triton_diffusion.serving.triton_model import Hosting


def job(prompt: str, seed: int = 0) -> Any:
    return SimpleNamespace(spec=SimpleNamespace(params=SimpleNamespace(prompt=prompt, seed=seed)))


class Kind:
    """A model kind whose setup returns what it was given."""

    engine_kind: Any = None

    def setup(self, settings: Any, metrics: Any) -> Hosting:
        return Hosting(self.engine_kind, names=None)  # type: ignore[arg-type]


def test_the_step_engines_adapter_is_wrapped_and_raises_for_its_prompt():
    inner = SimpleNamespace(step=lambda jobs, previews=None: "stepped", computed=lambda jobs: (len(jobs), 0))
    Kind.engine_kind = StepEngineKind(inner, RowCaps(4, {}), max_tokens_per_forward=64)
    hosting = with_faults(Kind, '{"fail_on_prompt": "boom"}')().setup(None, None)
    engine_kind = hosting.engine_kind
    assert isinstance(engine_kind, HeldStepEngineKind) and isinstance(engine_kind.adapter, FaultyStepAdapter)
    assert engine_kind.adapter.adapter is inner and engine_kind.max_tokens_per_forward == 64  # the rest kept
    assert engine_kind.adapter.step([job("fine")]) == "stepped"
    with pytest.raises(InjectedFault):
        engine_kind.adapter.step([job("fine"), job("a boom")])


def test_the_fused_call_is_wrapped_before_the_call_and_after_each_step(monkeypatch):
    events: list[object] = []  # the call, each stalled step (its sleep) and each step report, in order
    monkeypatch.setattr(faults_module.time, "sleep", lambda seconds: events.append(("sleep", seconds)))

    def call(key: Any, jobs: list[Any], steps: Any) -> list[str]:
        events.append("call")
        for step in (1, 2):
            steps.on_step(step, 2)
        return [steps.name]

    steps = SimpleNamespace(on_step=lambda step, total: events.append(step), name="steps")
    Kind.engine_kind = RequestEngineKind(call, RowCaps(4, {}))
    hosting = with_faults(Kind, '{"oom_above_rows": 1, "step_delay_s": 0.25}')().setup(None, None)
    engine_kind = hosting.engine_kind
    assert isinstance(engine_kind, RequestEngineKind) and isinstance(engine_kind.call, FaultyCall)
    rows = [SimpleNamespace(spec=SimpleNamespace(params=RowInput({"prompt": p}, 0))) for p in "ab"]
    assert engine_kind.call(None, rows[:1], steps) == ["steps"]
    assert events == ["call", ("sleep", 0.25), 1, ("sleep", 0.25), 2]
    events.clear()
    with pytest.raises(SimulatedOutOfMemoryError):
        engine_kind.call(None, rows, steps)
    assert events == []  # refused before the call


def test_a_hold_waits_until_the_engine_holds_another_job():
    inner = SimpleNamespace(step=lambda jobs, previews=None: None, computed=lambda jobs: (len(jobs), 0))
    # Held far longer than the test waits: only the engine holding another job releases it in time.
    faults = FaultInjection.from_config('{"hold_on_prompt": "__hold__", "hold_s": 60}')
    faulty = FaultyStepAdapter(inner, faults, prompt)
    held = [1]
    faulty.held = lambda: held[0]
    first = SimpleNamespace(
        spec=SimpleNamespace(params=SimpleNamespace(prompt="x __hold__")),
        run=SimpleNamespace(steps_done=1),
        stats=SimpleNamespace(most_shared=1),
    )
    done = threading.Event()
    thread = threading.Thread(target=lambda: (faulty.step([first]), done.set()))
    thread.start()
    assert not done.wait(0.2)  # held: the engine holds one job
    held[0] = 2
    assert done.wait(5)
    thread.join()


def test_rows_that_shared_a_forward_are_held_until_the_jobs_their_marker_waits_for():
    inner = SimpleNamespace(step=lambda jobs, previews=None: None, computed=lambda jobs: (len(jobs), 0))
    faults = FaultInjection.from_config('{"hold_on_prompt": "__hold__", "hold_s": 60}')
    faulty = FaultyStepAdapter(inner, faults, prompt)
    held = [2]
    faulty.held = lambda: held[0]

    def job(marker: str, shared: int) -> SimpleNamespace:
        return SimpleNamespace(
            spec=SimpleNamespace(params=SimpleNamespace(prompt=f"x {marker}")),
            run=SimpleNamespace(steps_done=1),
            stats=SimpleNamespace(most_shared=shared),
        )

    # Two of five sent together shared their first forward: still held until the engine holds five.
    pair = [job("__hold__1of5", 2), job("__hold__1of5", 2)]
    done = threading.Event()
    thread = threading.Thread(target=lambda: (faulty.step(pair), done.set()))
    thread.start()
    assert not done.wait(0.2)
    held[0] = 5
    assert done.wait(5)
    thread.join()
    # Rows that shared a forward with the five, and rows without "of N" that shared one: never held (with
    # one job held, either would wait if it were).
    held[0] = 1
    for shared in (job("__hold__1of5", 5), job("__hold__", 2)):
        finished = threading.Event()
        threading.Thread(target=lambda j=shared, f=finished: (faulty.step([j]), f.set())).start()
        assert finished.wait(5)


def prompt(job: Any) -> str:
    return job.spec.params.prompt


def test_the_test_model_file_serves_the_shipped_kind_with_the_faults(tmp_path: Path):
    copy_model("text_to_image", tmp_path, "slow", {"model": "w", "fault_injection": '{"step_delay_s": 0.1}'})
    written = (tmp_path / "slow" / "1" / "model.py").read_text()
    assert "serve(with_faults(kind_class('text_to_image'), '{\"step_delay_s\": 0.1}'))" in written
    ast.parse(written)
    config = (tmp_path / "slow" / "config.pbtxt").read_text()
    assert "fault_injection" not in config and 'string_value: "w"' in config
    copy_model("text_to_image", tmp_path, "plain", {"model": "w"})  # without faults: the shipped file
    shipped = Path(__file__).resolve().parents[2] / "model_repository" / "text_to_image" / "1" / "model.py"
    assert (tmp_path / "plain" / "1" / "model.py").read_text() == shipped.read_text()
    with pytest.raises(ValueError, match="unknown keys"):
        copy_model("text_to_image", tmp_path, "bad", {"fault_injection": '{"explode": 1}'})
    with pytest.raises(ValueError, match="no faults given"):
        copy_model("text_to_image", tmp_path, "empty", {"fault_injection": ""})
    assert not (tmp_path / "bad").exists() and not (tmp_path / "empty").exists()  # checked before copying
    # A backslash in the faults reaches the model file as written (not read as a regex escape).
    copy_model("text_to_image", tmp_path, "marker", {"fault_injection": '{"fail_on_prompt": "a\\\\nb"}'})
    assert '\'{"fail_on_prompt": "a\\\\\\\\nb"}\'' in (tmp_path / "marker" / "1" / "model.py").read_text()
