"""A step cache given to a running job where its deadline needs it (``degrade_step_cache``;
engine/degradation.py ``cache_for_deadline``, the scheduler's ``_cache_late``): the rule; the scheduler's
decision on a fake clock and a fake adapter (the estimate's times set by the test, so each expected
decision is worked out here by hand); on tiny FLUX.1 the job's image against diffusers' own cache enabled
between the same two steps of ``pipeline(...)``, amid a row that is not degraded; and the field and
config, parsed and refused by name."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.unit.recording import RecordingChannel
from tests.unit.step_harness import Host, job_of, reference, served
from tests.unit.test_degradation import CutAdapter
from tests.unit.test_scheduler import DEFAULT, FLEX, PRIORITY, Harness
from tests.unit.test_step_caches import MORE_THAN, ComputedRows, Family, enable_diffusers_cache
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.engine.degradation import CacheGiven, StepsCut, cache_for_deadline, degraded_report
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.triton_model import Urgency
from triton_diffusion.step_cache_spec import NO_CACHE, parse_step_cache


# ---- the rule -----------------------------------------------------------------------------------------
def test_a_cache_is_given_only_to_a_job_late_at_full_compute_with_steps_left_to_skip():
    assert cache_for_deadline("fbc:0.2", 3, 5, finish_s=2.0, time_left_s=2.5) is None  # in time
    assert cache_for_deadline("fbc:0.2", 3, 5, finish_s=2.5, time_left_s=2.5) is None  # just in time
    # One step left: a fresh cache computes its first step, so it would skip nothing.
    assert cache_for_deadline("fbc:0.2", 7, 1, finish_s=9.0, time_left_s=0.5) is None
    cut = cache_for_deadline("fbc:0.2", 3, 5, finish_s=3.0, time_left_s=2.5)
    assert cut == CacheGiven("fbc:0.2", 3, "deadline: 5 steps left estimated 3000 ms, 2500 ms left")
    # TaylorSeer computes its warm-up (3 steps here) before it predicts: with 3 left it skips nothing.
    assert cache_for_deadline("taylorseer:2:3", 3, 3, finish_s=9.0, time_left_s=0.5) is None
    assert cache_for_deadline("taylorseer:2:3", 3, 4, finish_s=9.0, time_left_s=0.5) is not None
    assert cache_for_deadline("taylorseer:2:1", 3, 2, finish_s=9.0, time_left_s=0.5) is not None
    assert cache_for_deadline("taylorseer:2:1", 3, 1, finish_s=9.0, time_left_s=0.5) is None
    # Every step computed (interval 1): it never skips, so it is never given.
    assert cache_for_deadline("taylorseer:1:0", 3, 9, finish_s=9.0, time_left_s=0.5) is None


def test_the_report_names_the_fewest_steps_and_the_earliest_cache_with_both_reasons():
    jobs = [Job(TrackedRequest(str(i), RecordingChannel()), None) for i in range(3)]
    jobs[0].queue.cut = StepsCut(6, 6, 10, "deadline: a")
    jobs[1].queue.cache_given = CacheGiven("fbc:0.2", 4, "deadline: b")
    jobs[2].queue.cache_given = CacheGiven("fbc:0.2", 2, "deadline: c")
    assert degraded_report(jobs) == {
        "steps_run": 6,
        "steps_asked": 10,
        "step_cache": "fbc:0.2",
        "cached_from_step": 2,
        "reason": "deadline: a; deadline: c",
        "rules": ["deadline"],
        "images": 3,
    }
    assert degraded_report(jobs[1:2]) == {
        "step_cache": "fbc:0.2",
        "cached_from_step": 4,
        "reason": "deadline: b",
        "rules": ["deadline"],
        "images": 1,
    }
    only = Job(TrackedRequest("o", RecordingChannel()), None)
    only.queue.cut = StepsCut(6, 6, 10, "overload: x", rule="overload")
    assert degraded_report([only])["rules"] == ["overload"]  # no deadline rule where none cut it
    jobs[0].queue.cut = StepsCut(6, 6, 10, "overload: x", rule="overload")
    jobs[1].queue.cut = StepsCut(8, 8, 10, "deadline of another image after it: y", rule="room")
    assert degraded_report(jobs[:2])["rules"] == ["deadline", "overload", "room"]


# ---- the scheduler, on a fake clock ---------------------------------------------------------------------
class CacheAdapter(CutAdapter):
    """The fake adapter, writing down the jobs it is told to give their cache, at which of their steps."""

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[tuple[str, int]] = []
        self.refuse: str | None = None  # why it gives no cache (None: it gives each one)
        self.fail = False  # it raises
        self.asked = 0  # calls of start_caches

    def start_caches(self, jobs):
        self.asked += 1
        if self.fail:
            raise RuntimeError("a bug")
        self.caches += [(job.request.request_id, job.run.steps_done) for job in jobs]
        return [self.refuse] * len(jobs)


def harness(**kwargs) -> Harness:
    """A harness whose every forward the estimate takes as 0.5 s, frozen there."""
    h = Harness(**kwargs)
    h.adapter = CacheAdapter()
    h.engine.adapter = h.adapter
    h.measure(0.5)
    times = h.engine.times  # frozen: the engine's own timings of the fake forwards are not taken
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    return h


def cacheable(h: Harness, name: str, tier: int, steps: int, deadline_s: float | None) -> Job:
    job = h.job(name, tier, steps, deadline_s=deadline_s)
    job.spec = replace(job.spec, degrade_cache="fbc:0.2")
    return job


def test_a_running_job_late_at_full_compute_is_given_its_cache_once_and_keeps_it():
    h = harness(max_running=2, max_per_forward=2)
    late = cacheable(h, "late", DEFAULT, 8, deadline_s=4.5)
    h.add(late)
    h.step(0.1)  # 8 steps x 0.5 s = 4.0 s of 4.4 s left: admitted (not refused), started, steps once
    assert late.queue.cache_given is None and h.adapter.caches == []
    h.step(1.0)  # a slow second: 7 steps left, 3.5 s, of 3.4 s left: late
    assert h.adapter.caches == [("late", 1)]
    assert late.queue.cache_given == CacheGiven("fbc:0.2", 1, late.queue.cache_given.reason)
    assert late.queue.cache_given.reason == "deadline: 7 steps left estimated 3500 ms, 3400 ms left"
    h.drain()
    assert h.adapter.caches == [("late", 1)]  # given once, kept to the end
    assert not isinstance(late.request.channel.finals[0], Exception)


def test_a_newcomer_late_at_full_compute_is_refused_not_admitted_on_a_caches_promise():
    h = harness(max_running=2, max_per_forward=2)
    hopeless = cacheable(h, "hopeless", DEFAULT, 8, deadline_s=3.0)  # 4.0 s of 2.9 s left
    h.add(hopeless)
    h.step(0.1)
    assert hopeless.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    assert hopeless.queue.cache_given is None and h.adapter.caches == []


def test_the_work_ahead_makes_a_lower_tier_late_and_the_higher_one_is_not_cached():
    h = harness(max_running=2, max_per_forward=1, max_paused=0)
    urgent = cacheable(h, "urgent", DEFAULT, 4, deadline_s=4.0)
    flex = cacheable(h, "flex", FLEX, 4, deadline_s=5.0)
    h.add(urgent, flex)
    h.step(0.1)  # both admitted (flex after urgent's 4: 8 forwards of one job, 4.0 s of 4.9 s); urgent steps
    h.step(0.1)  # urgent steps again: flex after its 3 left, 3.5 s of 4.8 s: nobody cached
    assert h.adapter.caches == []
    h.step(2.0)  # at 2.2 s: urgent's 2 left, 1.0 s of 1.8 s; flex after them, 3.0 s of 2.8 s: late
    assert h.adapter.caches == [("flex", 0)]
    assert urgent.queue.cache_given is None


def test_a_paused_job_made_late_by_the_higher_tier_that_paused_it_is_given_its_cache():
    h = harness(max_running=1, max_per_forward=1, max_paused=1)
    flex = cacheable(h, "flex", FLEX, 8, deadline_s=6.0)
    h.add(flex)
    h.step(0.1)  # 8 steps, 4.0 s of 5.9 s: admitted; steps once
    urgent = h.job("urgent", PRIORITY, 4, deadline_s=30.0)
    h.add(urgent)
    h.step(0.1)  # urgent pauses flex: flex after urgent's 4 and its own 7, 5.5 s of 5.8 s: in time
    assert flex in h.engine.scheduler.paused and h.adapter.caches == []
    h.step(0.5)  # at 0.7 s: urgent's 3 left and flex's 7, 5.0 s of 5.3 s: in time
    assert h.adapter.caches == []
    h.step(1.0)  # at 1.7 s: urgent's 2 left and flex's 7, 4.5 s of 4.3 s: late, while paused
    assert flex in h.engine.scheduler.paused and h.adapter.caches == [("flex", 1)]
    h.drain()
    assert not isinstance(flex.request.channel.finals[0], Exception)


@pytest.mark.parametrize("how", ["refused", "raised"])
def test_a_cache_the_adapter_cannot_give_is_not_reported_and_the_job_runs_on(how):
    h = harness(max_running=2, max_per_forward=2)
    h.adapter.refuse, h.adapter.fail = ("not served", False) if how == "refused" else (None, True)
    late = cacheable(h, "late", DEFAULT, 8, deadline_s=4.5)
    other = h.job("other", DEFAULT, 8)
    h.add(late, other)
    h.step(0.1)
    h.step(1.0)  # late now: the scheduler gives its cache, the adapter cannot
    assert late.queue.cache_given is None and not late.degraded
    h.step(1.0)  # later still: not decided again (the adapter's reason would not change)
    assert h.adapter.asked == 1
    h.drain()
    assert [len(job.request.channel.finals) for job in (late, other)] == [1, 1]
    assert not isinstance(other.request.channel.finals[0], Exception)


@pytest.mark.parametrize("case", ["room", "no deadline", "best effort", "nothing allowed"])
def test_a_running_job_is_never_cached_with_room_without_a_deadline_or_an_allowance_or_refusals(case):
    h = harness(max_running=2, max_per_forward=2, refuse_late=case != "best effort")
    job = cacheable(h, "job", DEFAULT, 8, deadline_s=None if case == "no deadline" else 4.5)
    if case == "room":
        job.spec = replace(job.spec, deadline=h.clock.now + 60.0)
    if case == "nothing allowed":
        job.spec = replace(job.spec, degrade_cache=None)
    h.add(job)
    h.step(0.1)
    h.step(1.0)  # where it may be cached, late now (the first test)
    h.drain()
    assert job.queue.cache_given is None and h.adapter.caches == []


# ---- exactness: tiny FLUX.1 -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux() -> Family:
    return Family("tiny-flux", deeper=True)


def diffusers_cached_from(
    flux: Family, request: ImageParams, cache: str, from_step: int
) -> tuple[np.ndarray, int]:
    """``pipeline(...)`` for the request alone with diffusers' own cache enabled after its ``from_step``-th
    step (in ``callback_on_step_end``), fresh, and off again after the call: its image and the rows its
    transformer's blocks computed."""
    pipe, spec, off = flux.reference_pipe, parse_step_cache(cache), []

    def on_step_end(pipeline, i, t, tensors):
        if i == from_step - 1:
            off.append(enable_diffusers_cache(pipeline.transformer, spec))
        return {}

    try:
        with ComputedRows(pipe.transformer) as rows:
            image = reference(
                pipe, flux.facts, flux.reference_schedulers, request, callback_on_step_end=on_step_end
            )
    finally:
        for disable in off:
            disable()
    return np.asarray(image, dtype=int), rows.rows


@pytest.mark.parametrize("cache", ["fbc:0.9", "taylorseer:2:1"])
@pytest.mark.parametrize("guided", [False, True], ids=["one branch", "true cfg"])
def test_a_job_given_its_cache_mid_run_equals_diffusers_cache_enabled_at_that_step_amid_a_plain_row(
    flux, cache, guided
):
    """Two jobs in one engine whose estimate says a forward takes 0.5 s (set here, frozen; the clock moves
    1 s after the first step): one with a deadline it then misses at full compute is given its cache after
    its first step, one allowed the same cache without a deadline is never given it; they share their
    forwards. With true CFG each job's two branches keep a cache state each. Each image equals diffusers'
    own (the first with diffusers' cache enabled after the same step), and the engine computed the rows
    diffusers computed for the two."""
    adapter = flux.adapter
    times, now = WorkTimes(), [0.0]
    engine = StepEngine(adapter, EngineLimits(8, 8), clock=lambda: now[0], times=times)
    allowed = parse_step_cache(cache)
    cfg = {"negative_prompt": "blurry", "true_cfg_scale": 4.0} if guided else {}
    requests = [flux.request(i, "none", degrade_cache=allowed, **cfg) for i in range(2)]
    jobs = [job_of(adapter, str(i), RecordingChannel(), r) for i, r in enumerate(requests)]
    for job in jobs:
        job.spec = replace(job.spec, degrade_cache=allowed.text)
    times.forward_ran(1, jobs[0].spec.tokens, 0.5)
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    jobs[0].spec = replace(jobs[0].spec, deadline=4.4)  # 8 steps, 4.0 s: admitted
    engine.add(*jobs)
    host = Host()
    with ComputedRows(adapter.pipe.transformer) as rows:
        host.render(engine.step())
        now[0] = 1.0  # a slow first step: its 7 left take 3.5 s, 3.4 s left
        while engine.active:
            host.render(engine.step())
    given = jobs[0].queue.cache_given
    assert given is not None and (given.step_cache, given.from_step) == (allowed.text, 1)
    assert jobs[1].queue.cache_given is None and jobs[1].stats.rows_reused == 0
    assert jobs[0].stats.rows_reused >= 2, jobs[0].stats  # the cache skipped work for it
    # A state per CFG branch, as a job started with the cache has (FLUX.1 calls the denoiser per branch).
    assert len(jobs[0].state.cache.branches) == (2 if guided else 1)
    assert min(job.stats.most_shared for job in jobs) == 2  # they shared forwards
    cached, cached_rows = diffusers_cached_from(flux, requests[0], allowed.text, 1)
    assert np.abs(served(jobs[0]) - cached).max() <= 1
    pipe, facts, schedulers = flux.reference_pipe, flux.facts, flux.reference_schedulers
    with ComputedRows(pipe.transformer) as plain_rows:
        full, plain = (np.asarray(reference(pipe, facts, schedulers, r), dtype=int) for r in requests)
    assert np.abs(served(jobs[1]) - plain).max() <= 1
    assert rows.rows == cached_rows + plain_rows.rows // 2  # what diffusers computed for the two
    # The cache visibly changes the image: it is not the uncached one.
    assert np.abs(cached - full).max() > MORE_THAN


def test_a_job_that_may_be_given_a_cache_keeps_to_forwards_of_its_own_size(flux):
    # FLUX.1 packs sizes; a job a cache may be given on the way does not (a packed forward's mask does not
    # follow the rows a cache gathers), as one with a cache of its own does not.
    request = flux.request(0, "none")
    assert flux.adapter.sizes.packing.on and flux.adapter.sizes.group_of(request) != request.shape
    assert (
        flux.adapter.sizes.group_of(replace(request, degrade_cache=parse_step_cache("fbc:0.2")))
        == request.shape
    )


# ---- the field and the config ---------------------------------------------------------------------------
def load_flux_model(**config):
    from triton_diffusion.models.text_to_image import TextToImageModel
    from triton_diffusion.serving.server_process import WEIGHTS
    from triton_diffusion.settings import ModelConfig, ModelSettings
    from triton_diffusion.tiny_models import build_missing

    build_missing(WEIGHTS, only=["tiny-flux"])
    texts = {"model": str(WEIGHTS / "tiny-flux"), **config}
    settings = ModelSettings(
        "m", WEIGHTS, ModelConfig.parse(texts, ("image", "image_source"), [], "m"), {}, 4, "CPU", 0
    )
    model = TextToImageModel()
    model.fields, model.adapter = model.load(settings)
    model.settings = settings
    return model


def test_the_cache_allowed_comes_from_the_field_else_the_tier_and_none_refuses_it():
    model = load_flux_model(degrade_step_cache='{"flex": "fbc:0.2"}')
    assert model.describe_more()["degrade_step_cache"] == {"flex": "fbc:0.2"}

    def values(**fields):
        return model.resolve(model.fields.parse({"prompt": "a boat", **fields}))

    due = 5.0  # a deadline: without one nothing would give a cache
    assert model.degrade_cache(values(), due, FLEX) == "fbc:0.2"
    assert model.degrade_cache(values(), due, DEFAULT) is None
    assert model.degrade_cache(values(degrade_step_cache="taylorseer:2"), due, DEFAULT) == "taylorseer:2:3"
    assert model.degrade_cache(values(degrade_step_cache="none"), due, FLEX) is None  # refused by the client
    # A request with a cache of its own runs that one; one without a deadline is never given one (so it
    # keeps packing with other sizes).
    assert model.degrade_cache(values(step_cache="fbc:0.1"), due, FLEX) is None
    assert model.degrade_cache(values(), None, FLEX) is None
    best_effort = load_flux_model(degrade_step_cache='{"flex": "fbc:0.2"}', deadline_policy="best_effort")
    assert best_effort.degrade_cache(values(), due, FLEX) is None  # nothing refuses: nothing is late
    # The spec the engine and the adapter get.
    spec = model.job_spec(values(), 0, None, model_urgency(FLEX))
    assert spec.degrade_cache == "fbc:0.2" and spec.params.degrade_cache == parse_step_cache("fbc:0.2")
    assert model.job_spec(values(), 0, None, model_urgency(DEFAULT)).params.degrade_cache == NO_CACHE
    assert model.job_spec(values(), 0, None, Urgency(FLEX, None)).degrade_cache is None


def model_urgency(tier: int) -> Urgency:
    return Urgency(tier, 5.0)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"degrade_step_cache": "fbc:2"}, "degrade_step_cache: "),
        ({"degrade_step_cache": "fbc:0.2", "step_cache": "fbc:0.1"}, "runs step_cache fbc:0.1 already"),
    ],
)
def test_a_bad_degrade_step_cache_is_refused_naming_it(fields, said):
    model = load_flux_model()
    with pytest.raises(RequestError) as raised:
        model.resolve(model.fields.parse({"prompt": "a boat", **fields}))
    assert raised.value.code is ErrorCode.INVALID_ARG
    assert raised.value.message.startswith("degrade_step_cache") and said in raised.value.message


def test_a_model_default_step_cache_is_named_when_a_request_sends_only_degrade_step_cache():
    model = load_flux_model(step_cache="fbc:0.1")
    with pytest.raises(RequestError) as raised:
        model.resolve(model.fields.parse({"prompt": "a boat", "degrade_step_cache": "fbc:0.2"}))
    assert raised.value.message == (
        "degrade_step_cache: this model runs step_cache fbc:0.1 by default (config step_cache; a job runs "
        "one step cache): send step_cache none with it"
    )
    both = {"prompt": "a boat", "degrade_step_cache": "fbc:0.2", "step_cache": "none"}
    assert model.resolve(model.fields.parse(both))["degrade_step_cache"] == "fbc:0.2"


def test_a_family_without_step_caches_refuses_it_and_a_bad_config_is_a_load_error():
    from tests.unit.test_captured_forwards import load_model

    sd = load_model()
    with pytest.raises(RequestError, match="degrade_step_cache: fbc is not served by this model"):
        sd.resolve(sd.fields.parse({"prompt": "a boat", "degrade_step_cache": "fbc:0.2"}))
    with pytest.raises(ValueError, match="'degrade_step_cache': tier flex: fbc:0.2 is not served"):
        load_model(degrade_step_cache='{"flex": "fbc:0.2"}')
    with pytest.raises(ValueError, match="names gold, not among service_tiers"):
        load_flux_model(degrade_step_cache='{"gold": "fbc:0.2"}')
    with pytest.raises(ValueError, match="expected a step cache"):
        load_flux_model(degrade_step_cache='{"flex": "none"}')
