"""A crash loses no work, without a server: the resume_key field, the fields hash a checkpoint is bound to,
the lookup as a request is read (each branch, with a fake store), the seed a resend draws, BATCH, the
host storing and removing checkpoints, and the test-only exit fault (recovery/resumes.py).

The checkpoint store is faked here (a dict); tests/unit/test_checkpoint_store.py tests the real one."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.faults import FaultInjection, exiting_resumes
from tests.unit.recording import tracked
from triton_diffusion.adapters.image_params import ImageParams, as_run
from triton_diffusion.engine.degradation import StepsCut
from triton_diffusion.engine.jobs import Job, JobSpec, JobStart, Stepped, StepReport
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.models.diffusion_model import DiffusionModel, batch_output
from triton_diffusion.models.image_fields import TEXT_TO_IMAGE_FIELDS
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint
from triton_diffusion.recovery.checkpoint_store import CorruptCheckpoint
from triton_diffusion.recovery.resumes import Resume, Resumes, fields_hash, model_identity, seed_from_key
from triton_diffusion.serving.engine_host import EngineHost, RequestRecord
from triton_diffusion.serving.intake import Intake
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.result_cache import ResultCache
from triton_diffusion.serving.triton_model import TritonModel
from triton_diffusion.settings import ModelConfig, ModelSettings


def checkpoint(name: str, step: int = 1) -> JobCheckpoint:
    """A stored checkpoint as the store gives it back (tensors aside): ``name`` tells them apart."""
    return JobCheckpoint(step, {}, {"name": name})


KEY = "client-key_0123456789"


# ---- stand-ins for branch ckpt's store --------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    fields_hash: str
    checkpoint: Any


class FakeStore:
    """CheckpointStore's API over a dict: ``corrupt`` keys raise CorruptCheckpoint once (and are gone)."""

    def __init__(self) -> None:
        self.files: dict[str, Stored] = {}
        self.corrupt: set[str] = set()
        self.removed: list[str] = []
        self.flushes = 0
        self.lost: str | None = None  # what not_kept says
        self.forgotten: list[str] = []  # forget_not_kept's calls

    def put(self, key: str, hashed: str, checkpoint: Any) -> None:
        self.files[key] = Stored(hashed, checkpoint)

    def get(self, key: str) -> Stored | None:
        if key in self.corrupt:
            self.corrupt.discard(key)
            self.files.pop(key, None)
            raise CorruptCheckpoint("truncated")
        return self.files.get(key)

    def remove_request(self, resume_key: str) -> None:
        self.removed.append(resume_key)
        self.files = {k: v for k, v in self.files.items() if not k.startswith(resume_key + ".")}

    def flush(self, timeout_s: float) -> bool:
        self.flushes += 1
        return True

    def not_kept(self, resume_key: str) -> str | None:
        return self.lost

    def forget_not_kept(self, resume_key: str) -> None:
        self.forgotten.append(resume_key)

    def close(self) -> None:
        pass


# ---- the field ----------------------------------------------------------------------------------------
def parse_key(key: Any) -> dict[str, Any]:
    return TEXT_TO_IMAGE_FIELDS.parse({"prompt": "a cat", "resume_key": key})


def test_a_well_formed_resume_key_is_accepted_and_absent_is_none():
    assert parse_key("A" * 16)["resume_key"] == "A" * 16
    assert parse_key("uuid-4f1e_" + "9" * 118)["resume_key"].startswith("uuid")
    assert TEXT_TO_IMAGE_FIELDS.parse({"prompt": "a cat"})["resume_key"] is None


@pytest.mark.parametrize(
    "key, says",
    [
        ("short-key", "is 9 characters long"),
        ("k" * 129, "is 129 characters long"),
        ("has.a.dot.in.it.x.y", "got 'has.a.dot.in.it.x.y'"),
        ("slash/../../etc/passwd", "got"),
        ("spaces are not ok here", "got"),
        (12345678901234567, "must be a string"),
    ],
)
def test_a_malformed_or_oversized_resume_key_is_refused_naming_the_field_and_what_is_allowed(key, says):
    with pytest.raises(RequestError) as refused:
        parse_key(key)
    assert refused.value.code is ErrorCode.INVALID_ARG
    message = refused.value.message
    assert message.startswith("resume_key: ") and says in message, message
    assert "letters, digits, _ and -, at least 16 characters, at most 128 characters" in message, message


def test_the_resume_key_is_in_neither_the_compatibility_key_nor_the_result_cache_key():
    from triton_diffusion.compatibility import compatibility_key
    from triton_diffusion.serving.result_cache import result_key

    with_key, without = parse_key(KEY), parse_key(None)
    assert compatibility_key(TEXT_TO_IMAGE_FIELDS, with_key) == compatibility_key(
        TEXT_TO_IMAGE_FIELDS, without
    )
    assert result_key(with_key, True) == result_key(without, True)


# ---- the fields hash and the seed -------------------------------------------------------------------
def test_the_fields_hash_changes_with_what_decides_the_image_and_not_with_how_it_is_served():
    values = parse_key(KEY) | {"seed": 7, "guidance_scale": 7.5}
    hashed = fields_hash("m", values)
    assert fields_hash("m", dict(values)) == hashed  # deterministic
    for name, value in [("guidance_scale", 3.0), ("seed", 8), ("prompt", "a dog"), ("output_format", "jpeg")]:
        assert fields_hash("m", values | {name: value}) != hashed, name
    assert fields_hash("other_model", values) != hashed
    served_otherwise = {
        "progress": True,
        "preview_every": 2,
        "previews": 3,
        "service_tier": "flex",
        "timeout": 1000,
        "resume_key": "another-key-0123456789",
        "describe": True,
    }
    for name, value in served_otherwise.items():
        assert fields_hash("m", values | {name: value}) == hashed, name


def test_a_seed_derived_from_the_key_is_the_same_on_a_resend_and_differs_by_key():
    assert seed_from_key(KEY) == seed_from_key(KEY)
    assert seed_from_key(KEY) != seed_from_key(KEY + "x")
    assert 0 <= seed_from_key(KEY) < 2**32


# ---- resume at parse --------------------------------------------------------------------------------
class Bare(DiffusionModel):
    """An image model with nothing loaded: the step engine's parse over a fake adapter."""

    def images_for(self, values: dict[str, Any]) -> int:
        return values["num_images_per_prompt"]

    def step_request(self, values: dict[str, Any], image_index: int) -> ImageParams:
        return ImageParams(
            values["prompt"],
            None,
            values["seed"],
            image_index,
            64,
            64,
            4,
            values["guidance_scale"],
            None,
            "DDIM",
        )


def bare_model(checkpoints: bool = True) -> Bare:
    model = Bare()
    taken = {"checkpoint_every_steps": "2", "checkpoint_dir": "ckpt"} if checkpoints else {}
    model.settings = SimpleNamespace(name="m", config=ModelConfig.parse(taken, ["image"], [], "m"))
    defaults = {
        "default_height": "64",
        "default_width": "64",
        "default_num_inference_steps": "4",
        "default_guidance_scale": "7.5",
        "default_scheduler": "DDIM",
    }
    model.fields = TEXT_TO_IMAGE_FIELDS.configured(defaults)
    model.adapter = SimpleNamespace(tokens_of=lambda params: 1, grid_of=lambda params: None)
    return model


def intake_of(store: FakeStore | None) -> Intake:
    """The host's intake (serving/intake.py) over a fake store (None: the model takes no checkpoints)."""
    resumes = Resumes(store, 2) if store is not None else None
    return Intake("m", ("priority", "default", "flex"), None, ResultCache(0), resumes)


def request(**fields: Any) -> dict[str, Any]:
    return {"prompt": "a cat", "seed": 1234, "num_images_per_prompt": 2, "resume_key": KEY, **fields}


def read(intake: Intake, fields: dict[str, Any], request_: TrackedRequest) -> tuple[Any, Any, list[JobSpec]]:
    """What the host does with a request (engine_host.py ``read`` and ``submit``): the kind parses it, the
    intake looks its checkpoints up (watching it) and gives each job spec the one it starts from."""
    parsed = bare_model().parse(0, fields, request_)
    resume = intake.resume(request_, parsed)
    return parsed, resume, Intake.specs(parsed, resume)


def test_a_request_whose_checkpoints_exist_starts_its_images_from_them_with_their_keys():
    store = FakeStore()
    intake = intake_of(store)
    first, _, specs = read(intake, request(), tracked("first"))
    assert [job.checkpoint_key for job in first.jobs] == [f"{KEY}.0", f"{KEY}.1"]
    assert all(spec.resume is None for spec in specs)  # nothing stored yet: a normal start
    hashed = fields_hash("m", first.values)
    store.put(
        f"{KEY}.0", hashed, checkpoint("checkpoint of image 0", 3)
    )  # image 1 has none (it had not reached one)
    _, resume, specs = read(intake, request(progress=True, service_tier="flex"), tracked("resend"))
    assert [spec.resume for spec in specs] == [checkpoint("checkpoint of image 0", 3), None]
    assert [spec.resumed_steps for spec in specs] == [3, 0]  # the scheduler prices the steps left
    assert resume is not None and resume.warnings == ()
    # The adapter runs an image from the checkpoint its spec carries; a job cut for its deadline, from
    # its start (the checkpoint is of the longer schedule).
    job = Job.of(tracked("resend"), specs[0])
    assert as_run(job).resume == checkpoint("checkpoint of image 0", 3)
    job.queue.cut = StepsCut(2, 2, 4, "deadline")
    assert as_run(job).resume is None and as_run(job).steps == 2


def test_a_resume_key_whose_checkpoint_has_other_fields_is_refused_naming_resume_key():
    store = FakeStore()
    intake = intake_of(store)
    parsed, _, _ = read(intake, request(), tracked("first"))
    store.put(f"{KEY}.0", fields_hash("m", parsed.values), checkpoint("checkpoint"))
    with pytest.raises(RequestError) as refused:
        read(intake, request(guidance_scale=3.0), tracked("changed"))
    assert refused.value.code is ErrorCode.INVALID_ARG
    assert refused.value.message.startswith("resume_key: belongs to a request with other fields")
    assert f"{KEY}.0" in store.files  # another's checkpoint is neither used nor removed


def test_parse_reads_and_watches_nothing_the_host_does(monkeypatch):
    store = FakeStore()
    intake = intake_of(store)
    first = tracked("first")

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("parse read or changed what the model kept")

    with monkeypatch.context() as patched:  # any lookup, watch or cache read from parse fails the test
        for owner, name in ((Resumes, "lookup"), (Resumes, "watch"), (ResultCache, "get")):
            patched.setattr(owner, name, touched)
        parsed = bare_model().parse(0, request(), first)
    assert intake.resumes.resume_key(first) is None  # parse decided; it changed nothing
    assert parsed.resume_key == KEY and parsed.result_key is None  # no result cache on this model
    resume = intake.resume(first, parsed)
    assert (resume.key, resume.hashed) == (KEY, fields_hash("m", parsed.values))
    assert intake.resumes.resume_key(first) == KEY


def test_the_triton_model_has_the_host_read_a_parsed_request_and_not_one_that_failed_to_parse(monkeypatch):
    # serving/triton_model.py's _read, without Triton: the raw fields are the request itself.
    io = SimpleNamespace(read_raw_fields=lambda request, fields: request)
    monkeypatch.setitem(sys.modules, "triton_diffusion.serving.triton_io", io)
    intake = intake_of(FakeStore())
    served = TritonModel(bare_model())
    host = SimpleNamespace(intake=intake)
    host.read = partial(EngineHost.read, host)
    served.host = host
    served._track = lambda request, entered: tracked(request["prompt"])
    first, admitted = served._read(0, request(prompt="first"), 0.0)
    assert admitted is not None and admitted.parsed.resume_key == KEY
    assert admitted.resume is not None and intake.resumes.resume_key(first) == KEY
    failed, nothing = served._read(1, request(prompt="bad", num_images_per_prompt=99), 0.0)
    assert nothing is None and failed.channel.finals and intake.resumes.resume_key(failed) is None
    # The host's lookup refuses a request whose key holds another request's checkpoint: that request alone
    # is answered (INVALID_ARG naming resume_key), unwatched; the next one is read as usual.
    intake.resumes.store.put("other-key_0123456789.0", "another request's hash", checkpoint("checkpoint"))
    refused, nothing = served._read(2, request(prompt="theirs", resume_key="other-key_0123456789"), 0.0)
    (error,) = refused.channel.finals
    assert nothing is None and error.code is ErrorCode.INVALID_ARG and error.message.startswith("resume_key:")
    assert intake.resumes.resume_key(refused) is None
    after, admitted = served._read(3, request(prompt="after", resume_key="after-key_0123456789"), 0.0)
    assert admitted is not None and not after.channel.finals


def test_a_key_in_flight_is_refused_to_a_request_with_other_fields_until_it_is_answered():
    store = FakeStore()
    intake = intake_of(store)
    first = tracked("first")
    read(intake, request(), first)
    with pytest.raises(RequestError) as refused:
        read(intake, request(guidance_scale=3.0), tracked("other fields"))
    assert refused.value.message.startswith("resume_key: is held by a request in flight with other fields")
    same = tracked("same fields")
    read(intake, request(progress=True), same)  # the same request (a resend): its key
    intake.answered(first, None)
    intake.answered(same, None)
    read(intake, request(guidance_scale=3.0), tracked("after"))  # the key is free again
    # Each attempt and each answer forgets what earlier checkpoints of the key could not keep.
    assert store.forgotten == [KEY] * 5


def test_an_unreadable_checkpoint_starts_its_image_over_with_a_warning():
    store = FakeStore()
    intake = intake_of(store)
    parsed, _, _ = read(intake, request(), tracked("first"))
    store.put(f"{KEY}.0", fields_hash("m", parsed.values), checkpoint("checkpoint"))
    store.put(f"{KEY}.1", fields_hash("m", parsed.values), checkpoint("checkpoint 1"))
    store.corrupt.add(f"{KEY}.0")
    _, resume, specs = read(intake, request(), tracked("resend"))
    assert [spec.resume for spec in specs] == [None, checkpoint("checkpoint 1")]
    assert resume is not None
    (warning,) = resume.warnings
    assert warning.startswith("image 0: its checkpoint could not be read (truncated)"), warning


def test_without_a_seed_the_resend_draws_the_seed_the_key_gives():
    model = bare_model()
    first = model.parse(0, request(seed=None), tracked("first"))
    again = model.parse(0, request(seed=None), tracked("again"))
    assert first.values["seed"] == again.values["seed"] == seed_from_key(KEY)
    assert first.jobs[0].params.seed == seed_from_key(KEY)


def test_a_model_without_checkpoints_accepts_the_key_and_ignores_it():
    intake = intake_of(None)
    request_ = tracked("plain")
    parsed = bare_model(checkpoints=False).parse(0, request(), request_)
    assert intake.resume(request_, parsed) is None
    assert all(job.checkpoint_key is None for job in parsed.jobs)
    assert intake.report(parsed, None, []) == {"checkpoints": "off"}
    unkeyed = bare_model(checkpoints=False).parse(0, request(resume_key=None), tracked("none"))
    assert intake.report(unkeyed, None, []) == {}


def test_batch_reports_the_smallest_step_resumed_from_and_every_warning():
    store = FakeStore()
    intake = intake_of(store)
    parsed, resume, specs = read(intake, request(), tracked("r"))
    jobs = [Job.of(tracked("r"), spec) for spec in specs]
    assert intake.report(parsed, resume, jobs) == {"checkpoints": "on"}  # none resumed: no step
    jobs[0].begin(JobStart(None, "g", 12, steps_done=6))
    jobs[1].begin(JobStart(None, "g", 12, steps_done=4))
    assert intake.report(parsed, resume, jobs) == {"checkpoints": "on", "resumed_from_step": 4}
    jobs[1].begin(JobStart(None, "g", 12, warning="its checkpoint did not fit (shape): started over"))
    report = intake.report(parsed, resume, jobs)
    assert report["resumed_from_step"] == 0  # image 1 started over: the request resumed from 0
    assert report["warnings"] == ["image 1: its checkpoint did not fit (shape): started over"]
    json.dumps(report)
    store.lost = "one checkpoint takes 70592 bytes, above checkpoint_max_mb"
    assert intake.report(parsed, resume, jobs)["checkpoints"] == f"not kept: {store.lost}"


# ---- the host: storing, removing, the exit fault ----------------------------------------------------
def watched_job(resumes: Resumes, name: str, key: str = KEY, seed: int = 1) -> Job:
    request_ = tracked(name)
    params = SimpleNamespace(seed=seed)
    job = Job.of(request_, JobSpec(params, checkpoint_key=f"{key}.0"), RequestRecord(request_, None))
    resumes.watch(request_, Resume((), (), key, "hash-" + name))
    return job


def test_the_host_stores_the_checkpoints_of_unanswered_requests_and_removes_them_once_answered():
    store = FakeStore()
    resumes = Resumes(store, 2)
    running = watched_job(resumes, "running")
    answered = watched_job(resumes, "answered", key="answered-key-0123456789")
    answered.request.finish({})
    resumes.answered(answered.request, None)
    # Ended by the engine, its error not out yet (its answered hook not run): nothing to resume either.
    ending = watched_job(resumes, "ending", key="ending-key-0123456789")
    ending.request.end(RequestError(ErrorCode.INTERNAL, "its forward failed"))
    checkpoints = [(running, "at 2"), (answered, "late"), (ending, "too late")]
    resumes.persist(StepReport(checkpoints=checkpoints))
    assert store.files == {f"{KEY}.0": Stored("hash-running", "at 2")}
    assert store.removed == ["answered-key-0123456789"]
    resumes.answered(running.request, ErrorCode.INTERNAL)
    assert store.files == {} and store.removed[-1] == KEY
    resumes.answered(running.request, None)  # once only
    assert store.removed.count(KEY) == 1


def test_an_unavailable_answer_keeps_the_checkpoints_for_the_retry():
    store = FakeStore()
    resumes = Resumes(store, 2)
    job = watched_job(resumes, "held when the device failed")
    resumes.persist(StepReport(checkpoints=[(job, "at 4")]))
    resumes.answered(job.request, ErrorCode.UNAVAILABLE)
    assert f"{KEY}.0" in store.files and store.removed == []


def test_the_exit_fault_fires_after_its_step_once_per_checkpoint_dir(tmp_path, monkeypatch):
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)

    monkeypatch.setattr("tests.faults.os._exit", fake_exit)
    faults = FaultInjection.from_config('{"exit_on_seed": 1234, "exit_after_step": 7}')
    store = FakeStore()
    store.directory = tmp_path / "checkpoints"
    marker = tmp_path / "checkpoints.exited"
    resumes = exiting_resumes(Resumes(store, 2), faults, seed_of=lambda job: job.spec.params.seed)
    other = watched_job(resumes, "other", key="another-key-0123456789", seed=99)
    victim = watched_job(resumes, "victim", seed=1234)
    resumes.persist(StepReport(stepped=[Stepped(victim, 6, 12), Stepped(other, 7, 12)]))
    assert exits == [] and not marker.exists()
    resumes.persist(StepReport(stepped=[Stepped(victim, 7, 12)]))
    assert exits == [1] and marker.exists() and store.flushes == 1  # written first, then the exit
    resumes.persist(StepReport(stepped=[Stepped(victim, 7, 12)]))  # the restarted server: not again
    assert exits == [1]


def test_checkpoints_without_a_folder_are_a_load_error_naming_both():
    with pytest.raises(ValueError, match="'checkpoint_every_steps' needs 'checkpoint_dir'"):
        ModelConfig.parse({"checkpoint_every_steps": "2"}, ["image"], [], "m")
    config = ModelConfig.parse(
        {"checkpoint_every_steps": "2", "checkpoint_dir": "ckpt", "checkpoint_max_mb": "8"},
        ["image"],
        [],
        "m",
    )
    assert (config.checkpoint_every_steps, config.checkpoint_dir, config.checkpoint_max_mb) == (
        2,
        "ckpt",
        8.0,
    )
    assert ModelConfig.parse({}, ["image"], [], "m").checkpoint_every_steps == 0  # off by default
    with pytest.raises(ValueError, match="not read by this kind of model"):
        ModelConfig.parse({"checkpoint_every_steps": "2"}, ["lm"], [], "m")


def test_a_checkpoint_is_bound_to_the_weights_it_was_taken_under(tmp_path):
    # A rollout onto a shared checkpoint folder: the same model name, other weights. Their files differ
    # (size or time), so the model's identity, and every fields hash with it, differs: nothing resumes.
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"a" * 10)
    config = ModelConfig.parse({"model": str(weights)}, ("image", "image_source"), [], "m")
    settings = ModelSettings("m", tmp_path, config, {}, 4, "CPU", 0)
    before = model_identity(settings)
    assert model_identity(settings) == before
    (weights / "model.safetensors").write_bytes(b"b" * 11)
    after = model_identity(settings)
    assert after != before
    values = {"prompt": "a cat", "seed": 1}
    assert Resumes(None, 2, identity=before).hash_of("m", values) != Resumes(None, 2, identity=after).hash_of(
        "m", values
    )


def test_the_host_reads_keeps_and_answers_from_the_cache_through_its_intake():
    # engine_host.py end to end on a fake step adapter: read (lookup, watch), submit (the checkpoint on the
    # spec), the answer (BATCH's checkpoints part, kept in the cache), then an identical request answered
    # from the cache at once, and the first's checkpoints removed once it was answered.
    from pathlib import Path

    from tests.unit.test_step_engine import FakeAdapter, Spec
    from triton_diffusion.serving.engines import StepEngineKind
    from triton_diffusion.serving.metrics import IMAGE_METRICS

    class Metrics:
        def observe(self, *args: Any, **kwargs: Any) -> None: ...

        increment = set = observe

    class Kind:
        def progress_outputs(self, record: Any, stepped: Any) -> None:
            return None

        def final_outputs(self, record: Any, outputs: list[Any], reported: dict[str, Any]) -> dict[str, Any]:
            return {"out": np.array([[outputs[0]]], dtype=object), "BATCH": batch_output(reported)}

    @dataclass(frozen=True)
    class Parsed:
        jobs: tuple[JobSpec, ...]
        values: dict[str, Any]
        result_key: str | None = "answer key"
        resume_key: str | None = KEY
        progress: bool = False
        summary: str = ""

    store = FakeStore()
    config = ModelConfig.parse({"result_cache_mb": "1"}, ["image"], [], "m")
    settings = ModelSettings("m", Path("."), config, {}, 8, "CPU", 0)
    host = EngineHost(Kind(), StepEngineKind(FakeAdapter()), settings, Metrics(), IMAGE_METRICS, print)
    host.intake = Intake("m", config.service_tiers, Metrics(), host.intake.results, Resumes(store, 2))
    parsed = Parsed((JobSpec(Spec(steps=2), checkpoint_key=f"{KEY}.0"),), {"prompt": "a cat"})
    store.put(f"{KEY}.0", fields_hash("m", parsed.values), checkpoint("checkpoint of image 0"))
    first = tracked("first")
    try:
        admitted = host.read(first, parsed)
        assert admitted is not None and host.intake.resumes.resume_key(first) == KEY
        host.submit([admitted])
        deadline = time.monotonic() + 10
        while not first.channel.finals and time.monotonic() < deadline:
            time.sleep(0.01)
        (answer,) = first.channel.finals
        assert json.loads(answer["BATCH"].reshape(-1)[0])["checkpoints"] == "on"
        host.answered(first, None)  # as the Triton model does once the answer went out
        assert f"{KEY}.0" not in store.files and host.intake.resumes.resume_key(first) is None
        again = tracked("again")
        assert host.read(again, replace(parsed, resume_key=None)) is None  # answered from the cache
        (hit,) = again.channel.finals
        assert json.loads(hit["BATCH"].reshape(-1)[0])["result_cache"] == "hit"
    finally:
        host.close()


@pytest.mark.parametrize("bad", [{"service_tier": "nope"}])
def test_a_bad_tier_is_refused_before_a_source_image_is_decoded(bad):
    model = bare_model()

    def resolve(values):  # what decodes and resizes a source image (image_to_image)
        raise AssertionError("decoded before the cheap checks")

    model.resolve = resolve
    with pytest.raises(RequestError) as refused:
        model.parse(0, request(**bad), tracked("bad"))
    assert refused.value.code is ErrorCode.INVALID_ARG and refused.value.message.startswith(next(iter(bad)))
