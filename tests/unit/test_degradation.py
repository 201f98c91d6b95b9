"""Degrading a row instead of refusing its request (engine/degradation.py, the scheduler's ``_cut_steps``):
the rule on its own, the scheduler's decisions on a fake clock and a fake adapter, with the estimate's
times set by the test before the decisions read them (so each expected step count is worked out here by
hand), and on tiny SD a degraded job's image
against ``pipeline(num_inference_steps=k)`` for the k it ran, amid rows that are not degraded."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.unit.recording import RecordingChannel
from tests.unit.step_harness import Host, assert_each_image_equals_the_pipelines_own, job_of, load_family
from tests.unit.test_latent_loop import source_image
from tests.unit.test_scheduler import DEFAULT, FLEX, PRIORITY, Harness
from tests.unit.test_step_engine import FakeAdapter, Spec
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.degradation import (
    CUT_TARGET,
    StepsCut,
    cut_for_deadline,
    room_for,
    steps_allowed,
)
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.jobs import Job, JobStart
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import ErrorCode


def allowance(asked: int, least: int) -> tuple[tuple[int, int], ...]:
    return steps_allowed(asked, least, lambda k: k, lambda k: True)


# ---- the rule -----------------------------------------------------------------------------------------
def test_no_cut_where_what_was_asked_is_in_time_or_where_nothing_allowed_is():
    per_step = lambda steps: 0.5 * steps  # noqa: E731
    assert cut_for_deadline(allowance(8, 1), per_step, 4.0) is None  # 8 steps take 4 s: in time
    assert cut_for_deadline(allowance(8, 4), per_step, 1.9) is None  # even 4 steps take 2 s
    assert cut_for_deadline((), per_step, 0.1) is None  # nothing fewer allowed


def test_the_cut_is_the_most_steps_within_the_target_share_of_the_time_left():
    cut = cut_for_deadline(allowance(8, 1), lambda steps: 0.5 * steps, 2.0)
    # 2.0 s left, aiming at 90% of it (1.8 s): 3 steps (1.5 s); 4 steps (2.0 s) would leave no margin.
    assert CUT_TARGET == 0.9
    assert cut == StepsCut(3, 3, 8, cut.reason) and cut.reason.startswith(
        "deadline: 8 steps estimated 4000 ms"
    )
    # Where only the fewest allowed are in time, and not within the target, those.
    assert cut_for_deadline(allowance(8, 3), lambda steps: 0.5 * steps, 1.55).steps == 3


def test_a_job_cut_already_keeps_its_fewest_steps_when_even_those_are_late():
    per_step = lambda steps: 0.5 * steps  # noqa: E731
    earlier = cut_for_deadline(allowance(8, 4), per_step, 2.5)
    assert earlier is not None and earlier.steps == 4
    # Later, even 4 steps (2 s) are late: not given back its 8 (the most work), kept at 4.
    kept = cut_for_deadline(allowance(8, 4), per_step, 1.5, previous=earlier)
    assert kept is not None and kept.steps == 4 and kept.reason.endswith("even 4 steps late")
    assert cut_for_deadline(allowance(8, 4), per_step, 1.5) is None  # never cut: left as it asked


def test_the_allowance_leaves_out_counts_the_model_does_not_run_and_maps_each_to_its_denoising_steps():
    # An img2img request at strength 0.5: k steps denoise int(k / 2); 1 step would denoise none.
    allowed = steps_allowed(6, 1, lambda k: int(k * 0.5), lambda k: int(k * 0.5) >= 1)
    assert allowed == ((6, 3), (5, 2), (4, 2), (3, 1), (2, 1))
    assert steps_allowed(6, 6, lambda k: k, lambda k: True) == ()  # nothing fewer: never degraded


# ---- the scheduler, on a fake clock ---------------------------------------------------------------------
class CutAdapter(FakeAdapter):
    """The fake adapter, starting a job with the steps the scheduler cut it to."""

    def prepare(self, jobs):
        return [
            JobStart(
                [0],
                job.spec.params.group,
                job.queue.cut.denoising if job.queue.cut else job.spec.params.steps,
            )
            for job in jobs
        ]


def harness(**kwargs) -> Harness:
    h = Harness(**kwargs)
    h.adapter = CutAdapter()
    h.engine.adapter = h.adapter
    return h


def degradable(h: Harness, name: str, tier: int, steps: int, least: int, deadline_s: float | None):
    job = h.job(name, tier, steps, deadline_s=deadline_s)
    job.spec = replace(job.spec, steps_allowed=allowance(steps, least))
    return job


def forwards_of(h: Harness, name: str) -> int:
    return sum(name in forward for forward in h.adapter.forwards)


def test_a_job_is_not_degraded_while_the_queue_has_room():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    roomy = degradable(h, "roomy", DEFAULT, 10, 2, deadline_s=60.0)
    other = degradable(h, "other", FLEX, 10, 2, deadline_s=60.0)
    h.add(roomy, other)
    h.drain()
    assert roomy.queue.cut is None and other.queue.cut is None
    assert forwards_of(h, "roomy") == 10 and forwards_of(h, "other") == 10


def test_a_job_that_would_be_refused_runs_the_most_steps_that_meet_its_deadline():
    h = harness(max_running=4, max_per_forward=4)
    h.measure(0.5)  # every forward 0.5 s; no start or decode measured
    tight = degradable(h, "tight", DEFAULT, 8, 1, deadline_s=2.0)
    h.add(tight)
    h.step(0.1)  # scheduled 0.1 s after it arrived: 1.9 s left, aiming at 1.71 s: 3 steps (1.5 s)
    assert tight.queue.cut is not None and (tight.queue.cut.steps, tight.queue.cut.asked) == (3, 8)
    h.drain()
    assert forwards_of(h, "tight") == 3
    assert not isinstance(tight.request.channel.finals[0], Exception)
    # The same job without an allowance is refused, as before.
    h = harness(max_running=4, max_per_forward=4)
    h.measure(0.5)
    strict = h.job("strict", DEFAULT, 8, deadline_s=2.0)
    h.add(strict)
    h.step(0.1)
    assert strict.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def test_a_lower_tier_is_cut_for_the_work_of_a_higher_one_and_the_higher_one_is_not():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    urgent = degradable(h, "urgent", PRIORITY, 4, 1, deadline_s=3.0)
    flex = degradable(h, "flex", FLEX, 4, 1, deadline_s=3.0)
    h.add(flex, urgent)
    h.step(0.1)
    # urgent: 4 steps, 2.0 s of 2.9 s left: in time. flex after its 4 steps: 4 + k forwards of 0.5 s
    # within 2.61 s: k = 1. (Decided before either starts; the engine's own timings of the fake
    # forwards then shorten the estimate, so flex, not started yet, may be given more back.)
    assert urgent.queue.cut is None
    assert flex.queue.cut is not None and flex.queue.cut.steps == 1


def test_a_cut_is_given_back_when_the_queue_drains_before_the_job_starts():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    times = h.engine.times  # frozen: the engine's own timings of the fake forwards are not taken
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    urgent = degradable(h, "urgent", PRIORITY, 4, 1, deadline_s=30.0)
    flex = degradable(h, "flex", FLEX, 4, 1, deadline_s=3.0)
    h.add(flex, urgent)
    h.step(0.1)
    # flex after urgent's 4 steps: 4 + k forwards of 0.5 s within 2.61 s: cut to 1.
    assert flex.queue.cut is not None and flex.queue.cut.steps == 1
    h.step(0.1)
    assert flex.queue.cut is not None  # urgent still runs: the queue has not drained
    while forwards_of(h, "urgent") < 4:
        h.step(0.1)  # forwards take 0.1 s on this clock, not the 0.5 s estimated
    h.step(0.1)  # urgent done at 0.6 s: flex's 4 steps (2 s) are in time again
    assert flex.queue.cut is None
    h.drain()
    assert forwards_of(h, "flex") == 4


class ResumeAdapter(CutAdapter):
    """As the latent loop restores a checkpoint: a job not cut goes on from the steps its checkpoint did."""

    def prepare(self, jobs):
        done = [0 if job.queue.cut else job.spec.resumed_steps for job in jobs]
        starts = super().prepare(jobs)
        return [replace(s, state=[d], steps_done=d) for s, d in zip(starts, done, strict=True)]


@pytest.mark.parametrize("allowed", [True, False], ids=["may be cut", "may not"])
def test_a_job_resumed_from_a_checkpoint_is_priced_at_the_steps_it_leaves(allowed):
    # A request resent after a crash, its image checkpointed at step 6 of 8: 2 steps (1 s) meet its
    # deadline where 8 (4 s) would not. Priced at 8, it was cut (and so started over) or refused.
    h = harness(max_running=4, max_per_forward=4)
    h.adapter = h.engine.adapter = ResumeAdapter()
    h.measure(0.5)
    job = (
        degradable(h, "resumed", DEFAULT, 8, 1, deadline_s=2.0)
        if allowed
        else h.job("resumed", DEFAULT, 8, deadline_s=2.0)
    )
    job.spec = replace(job.spec, resumed_steps=6)
    assert job.remaining == 2
    h.add(job)
    h.step(0.1)
    assert job.queue.cut is None and not job.request.channel.finals, job.request.channel.finals
    h.drain()
    assert forwards_of(h, "resumed") == 2 and not isinstance(job.request.channel.finals[0], Exception)


def test_a_resumed_jobs_allowance_keeps_only_fewer_steps_than_it_leaves():
    h = harness()
    job = degradable(h, "resumed", DEFAULT, 8, 1, deadline_s=2.0)
    job.spec = replace(job.spec, resumed_steps=5)  # 3 steps left: a cut starts it over with fewer
    assert job.steps_allowed == ((8, 3), (2, 2), (1, 1)) and job.remaining == 3
    job.spec = replace(job.spec, resumed_steps=7)  # 1 step left: no cut could save anything
    assert job.steps_allowed == () and job.remaining == 1
    job.spec = replace(job.spec, resumed_steps=0)
    assert job.steps_allowed == allowance(8, 1) and job.remaining == 8


@pytest.mark.parametrize("case", ["no deadline", "best effort", "nothing allowed"])
def test_a_job_is_never_cut_without_a_deadline_an_allowance_or_refusals(case):
    h = harness(max_running=4, max_per_forward=4, refuse_late=case != "best effort")
    h.measure(0.5)
    job = degradable(h, "job", DEFAULT, 8, 8 if case == "nothing allowed" else 1, deadline_s=None)
    if case != "no deadline":
        job.spec = replace(job.spec, deadline=h.clock.now + 2.0)
    h.add(job)
    h.step(0.1)
    assert job.queue.cut is None


def test_a_job_whose_fewest_steps_cannot_meet_its_deadline_is_refused_uncut():
    h = harness(max_running=4, max_per_forward=4)
    h.measure(0.5)
    hopeless = degradable(h, "hopeless", DEFAULT, 8, 4, deadline_s=1.0)  # 4 steps take 2 s
    h.add(hopeless)
    h.step(0.1)
    assert hopeless.queue.cut is None
    assert hopeless.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def one_ahead(tier: int, ahead_s: float, later_s: float) -> tuple[Harness, Job, Job]:
    """A job of ``tier`` that may run 1 to 4 steps, ahead of a default job of 4 steps that may run no fewer
    (deadlines ``ahead_s`` and ``later_s``), every forward 0.5 s and one job a forward; one engine step
    0.1 s after they arrived."""
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    ahead = degradable(h, "ahead", tier, 4, 1, deadline_s=ahead_s)
    later = h.job("later", DEFAULT, 4, deadline_s=later_s)
    h.add(ahead, later)
    h.step(0.1)
    return h, ahead, later


def test_a_job_ahead_of_its_tier_is_cut_to_make_room_for_a_later_ones_deadline():
    h, ahead, later = one_ahead(DEFAULT, 2.5, 3.0)  # ahead has the least slack: it goes first
    # ahead: 4 steps (2 s) of its 2.4 s left: in time uncut. later after it: 8 forwards (4 s) of 2.9 s
    # left, late; ahead at k steps: (k + 4) x 0.5 s within 90% of 2.9 s (2.61 s): k = 1.
    assert ahead.queue.cut is not None and (ahead.queue.cut.steps, ahead.queue.cut.asked) == (1, 4)
    assert ahead.queue.cut.reason.startswith(
        "deadline of another image after it: estimated 4000 ms, 2900 ms left"
    )
    assert later.queue.cut is None and not later.request.channel.finals  # not refused
    h.drain()
    assert forwards_of(h, "ahead") == 1 and forwards_of(h, "later") == 4
    assert not isinstance(later.request.channel.finals[0], Exception)


def test_the_last_in_order_is_cut_first_and_as_little_as_brings_the_late_one_in_time():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    first = degradable(h, "first", DEFAULT, 4, 1, deadline_s=2.2)
    second = degradable(h, "second", DEFAULT, 4, 1, deadline_s=4.3)
    late = h.job("late", DEFAULT, 4, deadline_s=5.8)
    h.add(first, second, late)
    h.step(0.1)
    # late after 12 forwards (6 s) of 5.7 s left; within 90% of it (5.13 s): at most 10 forwards, so 2
    # steps freed, all from second (the last in order before it): second runs 2 steps, first all 4.
    assert first.queue.cut is None
    assert second.queue.cut is not None and second.queue.cut.steps == 2
    assert not late.request.channel.finals


def test_a_cut_that_saves_nobody_is_not_made_and_a_higher_tier_is_not_cut_for_a_lower_one():
    # Even with "ahead" at 1 step, "later" (4 steps) would take 2.5 s of 2.2 s left: nothing is cut. Read
    # from the walk alone: an engine step would refuse "later" and walk again, which undoes any cut.
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    ahead = degradable(h, "ahead", DEFAULT, 4, 1, deadline_s=2.1)
    later = h.job("later", DEFAULT, 4, deadline_s=2.3)
    scheduler = h.engine.scheduler
    scheduler.add(ahead, later)
    scheduler.waiting, scheduler._inbox = scheduler._inbox, []  # waiting, as an engine step finds them
    scheduler._cut_steps(h.clock.now + 0.1)
    assert ahead.queue.cut is None
    # The first test's numbers, with the job ahead one tier higher: it is not cut for the lower one.
    _, ahead, later = one_ahead(PRIORITY, 2.5, 3.0)
    assert ahead.queue.cut is None
    assert later.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def test_the_room_made_counts_for_the_jobs_after_the_late_one():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    ahead = degradable(h, "ahead", DEFAULT, 4, 1, deadline_s=2.5)
    later = h.job("later", DEFAULT, 4, deadline_s=3.0)
    last = degradable(h, "last", DEFAULT, 4, 1, deadline_s=5.0)
    h.add(ahead, later, last)
    h.step(0.1)
    # ahead cut to 1 for later (the first test); last after ahead's 1 and later's 4: 9 forwards (4.5 s)
    # of 4.9 s left, in time uncut. Priced as if ahead ran all 4, it would be late (6 s) and cut.
    assert ahead.queue.cut is not None and ahead.queue.cut.steps == 1
    assert last.queue.cut is None


def test_a_job_late_itself_is_refused_not_cut_for_a_later_one():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    hopeless = degradable(h, "hopeless", DEFAULT, 4, 1, deadline_s=0.3)  # even 1 step (0.5 s) is late
    later = h.job("later", DEFAULT, 2, deadline_s=2.0)
    h.add(hopeless, later)
    h.step(0.1)
    # later after hopeless's 4 steps would be late (3 s of 1.9 s left), and hopeless at 1 step would let
    # it in; but hopeless is late itself: it is refused, uncut, and later goes first, in time.
    assert hopeless.queue.cut is None
    assert hopeless.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    assert later.queue.cut is None and not later.request.channel.finals
    h.drain()
    assert forwards_of(h, "later") == 2 and not isinstance(later.request.channel.finals[0], Exception)


def two_images_behind(h: Harness, *after: Job) -> tuple[Job, Job]:
    """A job that may run 1 to 4 steps (deadline 2.5 s), then a request of two 4-step images (deadlines
    3.0 s and, a test's own so that it goes after the first, 3.2 s), then ``after``; one engine step
    0.1 s after they arrived. The job ahead and the request's first image."""
    ahead = degradable(h, "ahead", DEFAULT, 4, 1, deadline_s=2.5)
    first = h.job("two images", DEFAULT, 4, deadline_s=3.0)
    second = Job(first.request, Spec(steps=4), tier=DEFAULT, planned_steps=4, shape="64x64", index=1)
    second.spec = replace(second.spec, deadline=first.spec.deadline + 0.2, tokens=1)
    h.engine.add(ahead)
    h.engine.add(first, second)
    for job in after:
        h.engine.add(job)
    h.step(0.1)
    return ahead, first


def test_a_cut_made_for_a_request_refused_in_the_same_step_is_undone():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    ahead, first = two_images_behind(h)
    # The first image is in time once ahead is cut to 1 (the first test); the second, after ahead's 1 and
    # the first's 4 (4.5 s of 3.1 s left), is not, and nothing more can be cut: the request is refused.
    # The cut made for its first image is then undone: ahead runs the 4 steps it asked.
    assert first.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    assert ahead.queue.cut is None
    h.drain()
    assert forwards_of(h, "ahead") == 4


def test_room_a_refused_request_held_goes_to_a_newcomer_judged_after_it():
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    newcomer = h.job("newcomer", DEFAULT, 4, deadline_s=3.5)
    ahead, first = two_images_behind(h, newcomer)
    # As in the test above, the two-image request is refused (ahead cut to 1 for its first image). With it
    # gone, the newcomer after ahead's 4 steps (8 forwards, 4 s of 3.4 s left) is late; ahead at k steps:
    # (k + 4) x 0.5 s within 90% of 3.4 s (3.06 s): k = 2. Judged with the refused request's room (and
    # its first image's work) still counted, the newcomer would have been refused too.
    assert first.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    assert not newcomer.request.channel.finals
    assert ahead.queue.cut is not None and ahead.queue.cut.steps == 2


def test_room_for_takes_candidates_in_the_order_given_each_as_far_as_it_goes():
    allowed = allowance(4, 1)
    # Each freed token-step takes 1 s off a 10 s estimate; 6 s left, aiming at 5.4 s: 4.6 to free.
    cuts = room_for(lambda freed: 10.0 - freed, 6.0, [(allowed, 4, 1), (allowed, 4, 1), (allowed, 4, 1)], "w")
    assert [c and c.steps for c in cuts] == [1, 2, None]  # 3 from the first, 2 more from the second
    assert room_for(lambda freed: 10.0 - freed, 1.0, [(allowed, 4, 1)], "w") == [None]  # saves nobody
    assert room_for(lambda freed: 10.0 - freed, 6.0, [((), 4, 1), (allowed, 4, 2)], "w")[1].steps == 1


# ---- exactness: tiny SD ---------------------------------------------------------------------------------
def test_degraded_jobs_equal_their_pipeline_at_the_steps_they_ran_amid_rows_that_are_not():
    """Three jobs in one engine whose estimate says a forward takes 0.5 s (set here; the clock stands
    still): a text job and an img2img job with tight deadlines are cut, a job without a deadline runs
    what it asked; each image equals ``pipeline(...)`` alone with the steps it ran."""
    family = load_family("tiny-sd")
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    times = WorkTimes()
    engine = StepEngine(adapter, EngineLimits(8, 8), clock=lambda: 0.0, times=times)

    def request(i: int, steps: int, **more) -> ImageParams:
        return ImageParams(
            f"a lighthouse {i}", None, 30 + i, 0, 64, 64, steps, 7.5, None, schedulers.default, **more
        )

    text = request(0, 12)
    image = request(1, 12, image=source_image(), strength=0.75)
    plain = request(2, 6)
    jobs = [job_of(adapter, str(i), RecordingChannel(), r) for i, r in enumerate((text, image, plain))]
    times.forward_ran(1, jobs[0].spec.tokens, 0.5)  # a forward of one such job: 0.5 s (more jobs: more)
    # The text job goes first (least slack): 12 steps take 6 s; within 90% of 2.5 s, 4 steps (2 s). The
    # img2img job after it, sharing its forwards: about 0.5 s x (4 + its denoising steps) within 4.68 s: 5
    # denoising steps (4.51 s: the tokens per forward round up), i.e. 7 steps at strength 0.75 (12
    # would denoise 9: 6.5 s).
    jobs[0].spec = replace(jobs[0].spec, deadline=2.5, steps_allowed=allowance(12, 2))
    jobs[1].spec = replace(jobs[1].spec, deadline=5.2)
    allowed = steps_allowed(12, 2, lambda k: int(k * 0.75), lambda k: int(k * 0.75) >= 1)
    jobs[1].spec = replace(jobs[1].spec, steps_allowed=allowed)
    engine.add(*jobs)
    host = Host()
    stepped = {job.request.request_id: 0 for job in jobs}  # forwards counted at the adapter's call
    step = adapter.step

    def counted(batch, *args, **kwargs):
        for job in batch:
            stepped[job.request.request_id] += 1
        return step(batch, *args, **kwargs)

    adapter.step = counted
    while engine.active:
        host.render(engine.step())
    text_cut, image_cut = jobs[0].queue.cut, jobs[1].queue.cut
    assert text_cut is not None and image_cut is not None and jobs[2].queue.cut is None
    assert (text_cut.steps, image_cut.steps) == (4, 7)
    # Each ran the denoising steps it was given (SD's img2img: int(steps x strength)).
    assert stepped == {"0": 4, "1": int(7 * 0.75), "2": 6}
    ran = [replace(text, steps=text_cut.steps), replace(image, steps=image_cut.steps), plain]
    assert_each_image_equals_the_pipelines_own(family, ran, jobs)
    # The cut visibly changes the image: it is not the one of the steps asked.
    from tests.unit.step_harness import reference, served

    for job, asked in ((jobs[0], text), (jobs[1], image)):
        full = np.asarray(reference(pipe, facts, schedulers, asked), dtype=int)
        assert np.abs(served(job) - full).max() > 5


# ---- the request's allowance: the field and the config ----------------------------------------------------
def test_the_allowance_comes_from_min_inference_steps_else_the_tiers_share_and_a_bad_one_is_named():
    from tests.unit.test_captured_forwards import load_model
    from triton_diffusion.errors import RequestError

    model = load_model(degrade_tiers='{"flex": 0.5}')
    assert model.describe_more()["degrade_tiers"] == {"flex": 0.5}

    def values(**fields):
        return model.resolve(model.fields.parse({"prompt": "a boat", "num_inference_steps": 10, **fields}))

    # flex (rank 2) may drop to half of its 10 steps; default (rank 1) sends nothing and may not.
    assert [steps for steps, _ in model.steps_allowed(values(), FLEX)] == [10, 9, 8, 7, 6, 5]
    assert model.steps_allowed(values(), DEFAULT) == ()
    # The request's own floor wins over its tier's.
    assert [steps for steps, _ in model.steps_allowed(values(min_inference_steps=8), DEFAULT)] == [10, 9, 8]
    with pytest.raises(RequestError) as raised:
        model.steps_allowed(values(min_inference_steps=11), DEFAULT)
    assert raised.value.code is ErrorCode.INVALID_ARG
    assert raised.value.message == "min_inference_steps: got 11 (allowed: 1 to num_inference_steps, 10)"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"gold": 0.5}', "names gold, not among service_tiers"),
        ('{"flex": 0}', "expected a share of the steps in (0, 1]"),
        ('{"flex": 1.5}', "expected a share of the steps in (0, 1]"),
    ],
)
def test_a_bad_degrade_tiers_is_a_load_error_naming_it(text, said):
    from tests.unit.test_settings import settings

    with pytest.raises(ValueError, match="degrade") as raised:
        settings({"degrade_tiers": text})
    assert said in str(raised.value)


def test_a_resumed_jobs_slack_is_that_of_the_steps_it_leaves():
    # Its order among jobs of its tier (slack first) as for a job asking the steps its checkpoint leaves.
    h = harness(max_running=4, max_per_forward=4)
    h.measure(0.5)
    resumed = h.job("resumed", DEFAULT, 8, deadline_s=2.0)
    resumed.spec = replace(resumed.spec, resumed_steps=6)
    short, full = h.job("short", DEFAULT, 2, deadline_s=2.0), h.job("full", DEFAULT, 8, deadline_s=2.0)
    scheduler = h.engine.scheduler
    assert scheduler._finish_s(resumed) == scheduler._finish_s(short) < scheduler._finish_s(full)
