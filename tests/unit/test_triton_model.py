"""What the shared Triton model decides per request without a server (serving/triton_model.py): the
request's service (its tier, refused by name when it names none of the model's), the answer it gets
from the result cache (its own service, not the first request's), and the seam: each model file serves a
kind composed into the one TritonModel."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.recording import tracked
from triton_diffusion.engine.degradation import CacheGiven, StepsCut
from triton_diffusion.engine.jobs import Job, JobSpec
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.fields import SERVICE_FIELDS, FieldSet
from triton_diffusion.models.diffusion_model import DiffusionModel, ParsedRequest, batch_output
from triton_diffusion.models.interfaces import INTERFACES
from triton_diffusion.models.kinds import KINDS
from triton_diffusion.models.model_file import KIND_CLASSES, kind_class, serve
from triton_diffusion.serving.intake import Intake
from triton_diffusion.serving.result_cache import ResultCache
from triton_diffusion.serving.triton_model import TritonModel, Urgency, urgency_of
from triton_diffusion.settings import ModelConfig


def model() -> DiffusionModel:
    """A model with its config (tiers priority, default, flex; default ``default``), nothing loaded."""
    bare = DiffusionModel.__new__(DiffusionModel)
    bare.settings = SimpleNamespace(config=ModelConfig.parse({}, ["image"], [], "m"))
    bare.fields = FieldSet(SERVICE_FIELDS)
    bare.metrics = SimpleNamespace(increment=lambda *args, **labels: None)
    return bare


def test_a_request_without_a_tier_gets_the_default_and_a_named_tier_its_rank():
    served = model()
    config, fields = served.settings.config, served.fields
    assert urgency_of({}, tracked("none"), config, fields) == Urgency(1, None)
    assert urgency_of({"service_tier": None}, tracked("none"), config, fields) == Urgency(1, None)
    assert urgency_of({"service_tier": "flex"}, tracked("flex"), config, fields).tier == 2


@pytest.mark.parametrize("tier", ["", " ", "\t", "default ", "Priority"])
def test_an_empty_blank_or_unknown_tier_is_refused_naming_the_field_and_the_tiers(tier):
    with pytest.raises(RequestError) as refused:
        served = model()
        urgency_of({"service_tier": tier}, tracked("bad"), served.settings.config, served.fields)
    assert refused.value.code is ErrorCode.INVALID_ARG
    assert refused.value.message == (
        f"service_tier: got {tier!r} (allowed: one of priority, default, flex)"
    ), refused.value.message


def test_a_result_cache_hit_reports_its_own_service_not_the_first_requests():
    # The host's intake (serving/intake.py) answers from the cache; the tier is the hit's own job's.
    class Hits:
        def __init__(self) -> None:
            self.counted: list[str] = []

        def increment(self, name: str, *args: object, **labels: object) -> None:
            self.counted.append(name)

    hits = Hits()
    intake = Intake("m", ("priority", "default", "flex"), hits, ResultCache(1 << 20))
    first_service = {"tier": "flex", "paused_times": 2, "paused_s": 1.25, "deadline_ms": 300.0}
    image = np.array([[b"png bytes"]], dtype=object)
    first = {"IMAGE": image, "BATCH": batch_output({"engine": "step", "service": first_service})}
    intake.results.put("key", first)

    def parsed(tier: int) -> ParsedRequest:  # priority (0) or default (1), no deadline
        return ParsedRequest(0, {}, None, (JobSpec(None, tier=tier),), Urgency(tier=tier), result_key="key")

    answer = intake.cached(parsed(0))
    batch = json.loads(answer["BATCH"].reshape(-1)[0])
    assert batch["result_cache"] == "hit" and batch["engine"] == "step"
    assert batch["service"] == {"tier": "priority", "paused_times": 0, "paused_s": 0.0}
    assert answer["IMAGE"][0, 0] == b"png bytes"  # the same bytes
    # The cached answer itself is untouched: a later hit of another tier reports that tier.
    later = intake.cached(parsed(1))
    assert json.loads(later["BATCH"].reshape(-1)[0])["service"]["tier"] == "default"
    assert json.loads(intake.results.get("key")["BATCH"].reshape(-1)[0])["service"] == first_service
    assert hits.counted == ["triton_diffusion_result_cache_hits_total"] * 2
    assert intake.cached(ParsedRequest(0, {}, None, (JobSpec(None),), result_key="other")) is None


def test_a_result_cache_hit_reports_its_own_checkpoints_not_the_first_requests():
    # The first request gave a resume key and resumed from step 7 with a warning; an identical one (the
    # resume key is in neither cache key) resumed nothing: none of that is its own.
    counted = SimpleNamespace(increment=lambda *args, **labels: None)
    intake = Intake("m", ("default",), counted, ResultCache(1 << 20))
    first = {"engine": "step", "checkpoints": "on", "resumed_from_step": 7, "warnings": ["image 0: stale"]}
    intake.results.put("key", {"BATCH": batch_output(first)})

    def hit(values: dict) -> dict:
        parsed = ParsedRequest(0, values, None, (JobSpec(None),), result_key="key")
        return json.loads(intake.cached(parsed)["BATCH"].reshape(-1)[0])

    without_key = hit({})
    assert without_key["engine"] == "step" and without_key["result_cache"] == "hit"
    assert not {"checkpoints", "resumed_from_step", "warnings"} & without_key.keys(), without_key
    with_key = hit({"resume_key": "k2"})  # its own report: this model keeps no checkpoints
    assert with_key["checkpoints"] == "off" and "resumed_from_step" not in with_key, with_key


def test_an_answer_is_kept_for_the_identical_requests_after_it_unless_degraded():
    intake = Intake("m", ("default",), None, ResultCache(1 << 20))
    answer = {"IMAGE": np.array([[b"png bytes"]], dtype=object)}
    parsed = ParsedRequest(0, {}, None, (JobSpec(None),), result_key="key")
    degraded = Job.of(tracked("cut"), JobSpec(None))
    degraded.queue.cut = StepsCut(2, 2, 4, "deadline")
    intake.keep(parsed, [degraded], answer)  # fewer steps than its fields ask: not their answer
    assert intake.results.get("key") is None
    cached = Job.of(tracked("cached"), JobSpec(None))
    cached.queue.cache_given = CacheGiven("fbc:0.2", 3, "deadline")
    intake.keep(parsed, [cached], answer)  # a step cache its fields do not ask: not their answer either
    assert intake.results.get("key") is None
    intake.keep(ParsedRequest(0, {}, None, (JobSpec(None),)), [Job.of(tracked("a"), JobSpec(None))], answer)
    assert len(intake.results) == 0  # no key (no seed given, or the cache is off): nothing kept
    intake.keep(parsed, [Job.of(tracked("b"), JobSpec(None))], answer)
    assert intake.results.get("key")["IMAGE"][0, 0] == b"png bytes"


# ---- the model seam: a kind composed into the one Triton model -----------------------------------------
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
# What each shipped model serves, by MODEL_INFO's kind.
SERVES = {
    "text_to_image": "text_to_image",
    "text_to_image_flux": "text_to_image",
    "image_to_image": "image_to_image",
    "text_to_video": "text_to_video",
    "diffusion_lm": "text_generation",
}


@pytest.mark.parametrize("model_file", sorted(REPOSITORY.glob("*/1/model.py")), ids=lambda p: p.parts[-3])
def test_each_model_file_serves_a_listed_kind_through_the_one_triton_model(model_file):
    """A model.py is ``TritonPythonModel = serve("kind")``: Triton's class wraps a TritonModel over a kind
    the type checker holds to ModelKind (models/kinds.py), with Triton's entry points, and the kind is not
    a TritonModel (composed, not inherited)."""
    spec = importlib.util.spec_from_file_location(f"model_{model_file.parts[-3]}", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    served = module.TritonPythonModel
    assert callable(served.auto_complete_config)
    assert all(callable(getattr(served, name)) for name in ("initialize", "execute", "finalize"))
    instance = served()
    assert type(instance.model) is TritonModel
    assert type(instance.model.kind) is KINDS[SERVES[model_file.parts[-3]]]
    assert not isinstance(instance.model.kind, TritonModel)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_auto_complete_config_adds_the_kinds_inputs_and_outputs(kind):
    added: dict[str, list] = {"input": [], "output": []}

    class Config:
        def add_input(self, spec):
            added["input"].append((spec["name"], spec["optional"]))

        def add_output(self, spec):
            added["output"].append(spec["name"])

        def set_model_transaction_policy(self, policy):
            added["policy"] = policy

    serve(kind).auto_complete_config(Config())
    # The kind's own fields and outputs (declared once: models/interfaces.py), the prompt alone required.
    assert KINDS[kind].FIELDS is INTERFACES[kind].fields and KINDS[kind].OUTPUTS == INTERFACES[kind].outputs
    assert added["input"] == [(f.input_name, f.name != "prompt") for f in KINDS[kind].FIELDS]
    assert added["output"] == [name for name, _, _ in KINDS[kind].OUTPUTS]
    assert added["policy"] == {"decoupled": True}


def test_each_kind_is_imported_by_its_name_as_the_type_checker_lists_it():
    assert set(KIND_CLASSES) == set(KINDS) == set(INTERFACES)
    assert all(kind_class(kind) is KINDS[kind] and KINDS[kind].KIND == kind for kind in KINDS)


@pytest.mark.parametrize("model_file", sorted(REPOSITORY.glob("*/1/model.py")), ids=lambda p: p.parts[-3])
def test_a_model_files_config_is_read_without_torch_or_diffusers(model_file):
    """Triton's config stub imports the model.py and calls auto_complete_config, once per model at every
    start: in a fresh interpreter, neither imports torch, diffusers or transformers (seconds a model)."""
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(model_file)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "class Config:\n"
        "    def add_input(self, spec): pass\n"
        "    def add_output(self, spec): pass\n"
        "    def set_model_transaction_policy(self, policy): pass\n"
        "module.TritonPythonModel.auto_complete_config(Config())\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'numpy') if m in sys.modules))\n"
    )
    # This checkout's src first, as the stub's would be (not whatever an installed package points at).
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_no_class_in_src_subclasses_the_triton_model():
    sources = Path(__file__).resolve().parents[2] / "src"
    subclasses = [
        str(path)
        for path in sources.rglob("*.py")
        if re.search(r"class \w+\([^)]*\bTritonModel\b", path.read_text())
    ]
    assert not subclasses, subclasses
