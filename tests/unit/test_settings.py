"""The typed model config: every parameter declared once, parsed and checked at load; derived defaults
computed, documented and used from one declaration."""

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

import triton_diffusion
from triton_diffusion.settings import IMAGE, IMAGE_SOURCE, LM, ModelConfig, ModelSettings

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIG_REFERENCE = DOCS / "reference" / "config.md"

FIELDS = ["prompt", "height", "num_inference_steps", "image", "scheduler"]


def settings(params: dict[str, str], kinds=(IMAGE,), max_batch_size: int = 32) -> ModelSettings:
    parameters = {k: {"string_value": v} for k, v in params.items()}
    config = {"parameters": parameters, "max_batch_size": max_batch_size}
    args = {"model_config": json.dumps(config), "model_name": "m", "model_repository": "/tmp"}
    return ModelSettings.from_triton_args(args, kinds, FIELDS)


def test_parameters_are_typed_once_and_field_limits_pass_through():
    loaded = settings(
        {"max_rows_per_call": "4", "cancel_poll_s": "0.01", "trust_remote_code": "yes", "max_height": "256"}
    )
    assert loaded.config.max_rows_per_call == 4 and loaded.config.cancel_poll_s == 0.01
    assert loaded.config.trust_remote_code is True and loaded.config.engine == "auto"
    assert loaded.field_params == {"max_height": "256"} and loaded.max_rows_per_call() == 4
    assert settings({}).max_rows_per_call() == 32  # max_batch_size when not set
    assert settings({"engine": "STEP"}).config.engine == "step"
    # A parameter of its own although it has a field's form (the request field ``scheduler``).
    choices = settings({"scheduler_choices": "EulerDiscreteScheduler"}, kinds=(IMAGE,))
    assert choices.config.scheduler_choices == ("EulerDiscreteScheduler",)


def test_an_unknown_key_is_a_load_error_with_a_did_you_mean():
    with pytest.raises(ValueError, match=r"'max_rows_per_cal'.*did you mean 'max_rows_per_call'"):
        settings({"max_rows_per_cal": "4"})
    with pytest.raises(ValueError, match="not a known parameter"):
        settings({"colour": "blue"})


def test_the_python_backends_own_parameters_are_left_to_it():
    # EXECUTION_ENV_PATH (a conda-pack environment) is read by the Python backend before our code runs.
    loaded = settings({"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz", "max_rows_per_call": "4"})
    assert loaded.config.max_rows_per_call == 4
    assert settings({"FORCE_CPU_ONLY_INPUT_TENSORS": "yes"}).config == settings({}).config
    with pytest.raises(ValueError, match="FORCE_CPU_ONLY_INPUT_TENSORS: got 'no' \\(allowed: yes\\)"):
        settings({"FORCE_CPU_ONLY_INPUT_TENSORS": "no"})  # inputs on a GPU: every request would fail


@pytest.mark.parametrize("kind", ["GPU", "CPU", "MODEL"])
def test_a_gpu_instances_device_is_the_one_a_lost_device_check_asks_from_any_thread(
    kind, monkeypatch, caplog
):
    import dataclasses
    import threading

    import torch

    from triton_diffusion.adapters.devices import instance_device
    from triton_diffusion.engine import failures

    asked: list[object] = []
    monkeypatch.setattr(failures, "_PROBED", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: asked.append(device))
    monkeypatch.setattr(torch, "ones", lambda *args, device=None: asked.append(device) or torch.zeros(1))
    gpu = dataclasses.replace(settings({}), instance_kind=kind, device_id=1)
    assert instance_device(gpu) == ("cpu" if kind == "CPU" else "cuda:1")
    # The engine thread asks (torch's current device is per thread: a new thread's is cuda:0).
    thread = threading.Thread(target=failures._device_still_works)
    thread.start()
    thread.join()
    assert asked == (["cuda", "cuda"] if kind == "CPU" else ["cuda:1", "cuda:1"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build of torch
    assert instance_device(gpu) == "cpu"
    said = "instance kind GPU, but torch" in caplog.text
    assert said is (kind == "GPU")  # not quietly on the CPU


def test_a_key_another_kind_reads_is_refused_naming_why():
    with pytest.raises(ValueError, match="'max_prompt_tokens' is not read by this kind of model"):
        settings({"max_prompt_tokens": "10"}, kinds=(IMAGE,))
    with pytest.raises(ValueError, match="resize_buckets"):
        settings({"resize_buckets": "64x64"}, kinds=(IMAGE,))
    buckets = settings({"resize_buckets": "64x64, 96X64"}, kinds=(IMAGE, IMAGE_SOURCE)).config.resize_buckets
    assert buckets == ((64, 64), (96, 64))
    assert settings({"max_prompt_tokens": "10"}, kinds=(LM,)).config.max_prompt_tokens == 10


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_rows_per_call": "four"}, "max_rows_per_call"),
        ({"trust_remote_code": "maybe"}, "trust_remote_code"),
        ({"engine": "turbo"}, "engine' must be one of auto, step, request"),
        ({"waiting_room": "-1"}, "waiting_room' must be >= 0"),
        ({"deadline_room": "-1"}, "deadline_room' must be >= 0"),
        ({"engine_stall_s": "0"}, "engine_stall_s' must be > 0"),
        ({"max_rows_per_call": "0"}, "max_rows_per_call' must be >= 1"),
        ({"max_running": "0"}, "max_running' must be >= 1"),
        ({"max_running": "2", "max_running_rows": "4"}, "'max_running' is given twice"),
        ({"cancel_poll_s": "1", "cancel_poll_ms": "10"}, "'cancel_poll_s' is given twice"),
        # Values that are not a plain number, flag or word are parsed here too, once (item 6).
        ({"max_rows_by_resolution": '{"big": 2}'}, "'max_rows_by_resolution': row cap 'big'"),
        ({"max_rows_by_resolution": "{"}, "'max_rows_by_resolution': not JSON"),
        ({"loras": '["x"]'}, "'loras': expected a JSON object"),
        ({"loras": '{"a,b": "x"}'}, "'loras': LoRA name 'a,b'"),
        ({"resize_buckets": "64by64"}, "'resize_buckets': expected WIDTHxHEIGHT"),
        ({"cuda_graph_sizes": "64x"}, "'cuda_graph_sizes': expected WIDTHxHEIGHT"),
        ({"eos_token_ids": "1,two"}, "'eos_token_ids': expected comma-separated integers"),
        ({"service_tiers": "gold,gold"}, "'service_tiers': expected distinct tier names"),
        ({"default_service_tier": "gold"}, "'default_service_tier' must be one of priority, default, flex"),
        ({"deadline_policy": "maybe"}, "'deadline_policy' must be one of refuse, best_effort"),
        ({"step_cache": "fbc:2"}, "'step_cache': step_cache: threshold 2 is outside"),
        ({"step_cache": "teacache:1"}, "'step_cache': step_cache: unknown method 'teacache'"),
    ],
)
def test_a_bad_value_names_the_key_and_what_is_allowed(params, message):
    kinds = (IMAGE, IMAGE_SOURCE, LM)
    with pytest.raises(ValueError, match=message):
        settings(params, kinds=kinds)


def test_structured_values_are_typed_at_load():
    loaded = settings(
        {
            "max_rows_by_resolution": '{"1024X768": 2, "832x480x81": 1}',
            "loras": '{"ink": "a/b"}',
            "service_tiers": "gold,silver",
            "default_service_tier": "silver",
            "step_cache": "taylorseer:4",
            "image_formats": "png,webp",
        },
        kinds=(IMAGE, IMAGE_SOURCE),
    ).config
    assert loaded.max_rows_by_resolution == {"1024x768": 2, "832x480x81": 1}
    assert loaded.loras == {"ink": "a/b"}
    assert loaded.service_tiers == ("gold", "silver") and loaded.default_service_tier == "silver"
    assert loaded.step_cache.text == "taylorseer:4:3" and loaded.image_formats == ("PNG", "WEBP")


def test_old_names_still_load_in_their_own_units():
    assert settings({"max_running_rows": "16"}).config.max_running == 16
    assert settings({"max_running_requests": "2"}, kinds=(LM,)).config.max_running == 2
    # Durations are in seconds; the old millisecond name is converted.
    assert settings({"cancel_poll_ms": "10"}).config.cancel_poll_s == 0.01
    assert settings({}).config.cancel_poll_s == 0.05


def test_durations_are_in_seconds():
    """One unit for durations: no parameter is named in another (an old name may be, converted)."""
    other_units = re.compile(r"_(ns|us|ms|min|minutes|h|hours|seconds|secs?)$")
    assert not [f.name for f in fields(ModelConfig) if other_units.search(f.name)]
    assert {f.name for f in fields(ModelConfig) if f.name.endswith("_s")} >= {
        "cancel_poll_s",
        "engine_stall_s",
    }


def test_a_served_model_cannot_turn_on_the_tests_faults():
    """The faults are installed by the tests around a model kind (tests/faults.py): no config parameter
    names them, and the package holds no module of them."""
    with pytest.raises(ValueError, match="'fault_injection' is not a known parameter"):
        settings({"fault_injection": '{"fail_on_prompt": "x"}'})
    package = Path(triton_diffusion.__file__).parent
    assert not list(package.rglob("faults.py"))
    # The one exit in the package is a lost device's (the supervisor restarts the server).
    exits = [p.relative_to(package).as_posix() for p in package.rglob("*.py") if "os._exit(" in p.read_text()]
    assert exits == ["engine/failures.py"]


def test_the_config_is_frozen():
    with pytest.raises(AttributeError):
        ModelConfig().engine = "step"  # type: ignore[misc]


# ---- derived defaults: the docs document them, settings.py computes them, the engines use them ------
# Each is declared once (settings.Derived): the engines read it through ModelSettings.resolved and the config
# reference's text is written from it. This checks the whole chain from the outside: every default the
# reference documents as an expression is evaluated here from its own text and compared with what the
# engines built from the same settings actually hold, so a reference left stale, or an engine kind
# (serving/engines.py) computing a default of its own, fails. The engine kinds are built here as the models
# build them (DiffusionModel.row_caps, StepEngineKind over the adapter), not through the models' own load.

LABELS = {
    "step engine": ("step",),
    "request engine": ("request",),
    "diffusion_lm": ("lm",),
    "image and video models": ("step", "request"),
    "request engine and diffusion_lm": ("request", "lm"),
}
SAFE = {"__builtins__": {}, "max": max, "min": min}


def documented_defaults() -> dict[str, tuple[dict[str, str], str | None]]:
    """The config reference's table: each parameter whose derived default is written as expressions -> (the
    expression per engine: step, request, lm; its "at most" expression)."""
    section = CONFIG_REFERENCE.read_text().split("<!-- config -->")[1].split("<!-- /config -->")[0]
    known = {f.name for f in fields(ModelConfig)} | {"max_batch_size", "max", "min"}
    documented = {}
    for row in section.strip().splitlines()[2:]:
        name, _, default, _, meaning = (cell.strip() for cell in row.strip().strip("|").split(" | ", 4))
        found = re.search(r"; default: (.*?)(?:; at most (.*?))?(?:; also read as .*)?$", meaning)
        if default != "derived" or found is None:
            continue
        text, at_most = found.groups()
        labelled = re.findall(rf"(.+?) \(({'|'.join(LABELS)})\)(?:, |$)", text)
        by_case = {case: expr for expr, label in labelled for case in LABELS[label]} or dict.fromkeys(
            ("step", "request", "lm"), text
        )
        try:
            names = {
                n for e in [*by_case.values(), at_most or "0"] for n in compile(e, name, "eval").co_names
            }
        except SyntaxError:
            continue  # a default taken from the model itself ("the tokenizer's")
        if names <= known:
            documented[name.strip("`")] = (by_case, at_most)
    return documented


class Documented(dict):
    """Parameter values for one engine as the config reference documents them: config.pbtxt's, else the
    default's expression evaluated over the others, within its "at most"."""

    def __init__(self, documented, params: dict[str, str], max_batch_size: int, case: str) -> None:
        super().__init__(max_batch_size=max_batch_size)
        self.documented, self.params, self.case = documented, params, case

    def __missing__(self, name: str) -> int:
        by_case, at_most = self.documented[name]
        value = int(self.params[name]) if name in self.params else eval(by_case[self.case], SAFE, self)
        if at_most:
            value = min(value, eval(at_most, SAFE, self))
        self[name] = value
        return value


def engine_values(params: dict[str, str], max_batch_size: int, case: str) -> dict[str, int]:
    """What the engines the models build (their own code path) hold, for each derived parameter."""
    from triton_diffusion.models.diffusion_model import DiffusionModel
    from triton_diffusion.serving.engines import RequestEngineKind, StepEngineKind

    loaded = settings(params, kinds=(LM,) if case == "lm" else (IMAGE,), max_batch_size=max_batch_size)
    if case == "request":
        caps = DiffusionModel.row_caps(loaded)  # what DiffusionModel.setup builds its engine with
        kind = RequestEngineKind(lambda *args: [], caps)
        return {
            "max_rows_per_call": caps.max_rows,
            "waiting_room": kind.capacity(loaded) - caps.max_rows,
            "deadline_room": kind.deadline_room(loaded),
        }
    caps = None if case == "lm" else DiffusionModel.row_caps(loaded)
    step_kind = StepEngineKind(object(), caps)  # as the models build it
    engine = step_kind.build(loaded, lambda report: None)
    values = {
        "max_running": engine.limits.max_running,
        "waiting_room": step_kind.capacity(loaded) - engine.limits.max_running,
        "max_paused": engine.limits.max_paused,
        "admission_cohort": engine.scheduler.pacing.cohort,
        "deadline_room": step_kind.deadline_room(loaded),  # what the host gives its door
    }
    if case == "step":
        values["max_rows_per_call"] = engine.limits.max_per_forward
    return values


SCENARIOS = [
    ({}, 32),
    ({}, 1),
    ({}, 0),  # Triton does not batch: one image per call
    ({"max_rows_per_call": "8"}, 6),  # more per call than Triton batches: where waiting_room had drifted
    ({"max_rows_per_call": "4"}, 32),
    ({"max_running": "3"}, 8),
    ({"max_rows_per_call": "2", "max_running": "16", "waiting_room": "0", "max_paused": "1"}, 8),
    ({"admission_cohort": "9", "max_running": "6"}, 8),  # a configured cohort is capped too
    ({"admission_cohort": "2", "max_rows_per_call": "12"}, 4),
]


def test_every_derived_default_is_documented_as_expressions_and_declared_once():
    declared = {f.name for f in fields(ModelConfig) if f.metadata["derived"] is not None}
    covered = set().union(*(engine_values({}, 8, case) for case in ("step", "request", "lm")))
    assert set(documented_defaults()) == declared == covered


@pytest.mark.parametrize("case", ["step", "request", "lm"])
@pytest.mark.parametrize("params, max_batch_size", SCENARIOS)
def test_the_engines_hold_the_documented_defaults(params, max_batch_size, case):
    if case == "lm":  # the diffusion LM reads no max_rows_per_call
        params = {k: v for k, v in params.items() if k != "max_rows_per_call"}
    got = engine_values(params, max_batch_size, case)
    documented = Documented(documented_defaults(), params, max_batch_size, case)
    assert got == {name: documented[name] for name in got}
    # ... and they are what settings.py resolves (the one place that computes them).
    loaded = settings(params, kinds=(LM,) if case == "lm" else (IMAGE,), max_batch_size=max_batch_size)
    engine = "request" if case == "request" else "step"
    assert got == {name: loaded.resolved(name, engine) for name in got}


@pytest.mark.parametrize("written", ["", "tier", "deadline"])
def test_tier_pause_reaches_the_step_engines_service(written):
    """``tier_pause`` (default tier) is the scheduler's ``Service.pause_by``; a value outside its
    choices is refused by name."""
    from triton_diffusion.serving.engines import StepEngineKind

    loaded = settings({"tier_pause": written} if written else {})
    engine = StepEngineKind(object(), None).build(loaded, lambda report: None)
    assert engine.scheduler.service.pause_by == (written or "tier")
    with pytest.raises(ValueError, match="tier_pause"):
        settings({"tier_pause": "always"})
