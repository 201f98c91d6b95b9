"""The step engine's scheduler without a model (engine/scheduler.py, ordering.py): service tiers, least
slack, admission refusal from the engine's own estimate, pausing and resuming, deadlines that pass, aging
and the starvation bound. A fake adapter counts each job's steps in its own state, and a fake clock moves
only when a test says so."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest

from tests.unit.recording import step_as_worker, tracked
from tests.unit.test_executor import KEY
from tests.unit.test_step_engine import Engine, FakeAdapter, Host, Spec
from triton_diffusion.adapters.packed_rows import ANY_SIZE
from triton_diffusion.engine.estimates import PROBE_AFTER
from triton_diffusion.engine.jobs import ForwardResult, Job, forward_group
from triton_diffusion.engine.ordering import AdmissionPacing, Service, make_policy
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import RequestEngine
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.serving.cancellations import ClientAborts

PRIORITY, DEFAULT, FLEX = 0, 1, 2


def computed_tokens(jobs: list[Job]) -> int:
    """The tokens a forward of these jobs computes, as a packing adapter counts them (padding included)."""
    return FakeAdapter().computed(jobs)[1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(
        self,
        max_running: int = 2,
        max_per_forward: int = 2,
        max_paused: int = 4,
        aging_s: float = 0.0,
        refuse_late: bool = True,
        policy: str = "oldest",
        max_tokens: int | None = None,
        pause_by: Literal["tier", "deadline"] = "tier",
    ) -> None:
        self.clock = Clock()
        self.adapter = FakeAdapter()
        self.host = Host()
        # Caps by shape, as the served engines have them (the fake adapter's groups are its shapes).
        cap_for = {"64x64": max_per_forward, "256x256": 1}.__getitem__
        limits = EngineLimits(
            max_running,
            max_per_forward,
            cap_for,
            max_paused=max_paused,
            starvation_steps=16,
            max_tokens_per_forward=max_tokens,
        )
        service = Service(("priority", "default", "flex"), aging_s, refuse_late, pause_by)
        pacing = AdmissionPacing(1)
        self.engine = StepEngine(self.adapter, limits, make_policy(policy), pacing, service, self.clock)

    def job(
        self, name: str, tier: int = DEFAULT, steps: int = 4, deadline_s: float | None = None, tokens: int = 1
    ) -> Job:
        spec = Spec(steps=steps)
        job = Job(tracked(name), spec, tier=tier, planned_steps=steps, shape="64x64", tokens=tokens)
        job.request.entered = self.clock.now
        job.queue.ready_at = self.clock.now
        if deadline_s is not None:
            job.spec = replace(job.spec, deadline=self.clock.now + deadline_s)
        return job

    def add(self, *jobs: Job) -> None:
        for job in jobs:
            self.engine.add(job)

    def step(self, seconds: float = 0.1) -> None:
        self.clock.now += seconds
        self.host.render(step_as_worker(self.engine))

    def drain(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.engine.active:
                return
            self.step()
        raise AssertionError("engine did not drain")

    def measure(self, seconds_per_forward: float = 0.1) -> None:
        """What the engine would have measured: a forward of any size takes this long."""
        for jobs in range(1, 9):
            self.engine.times.forward_ran(jobs, jobs, seconds_per_forward)  # a job is one token here

    def order(self) -> list[str]:
        """Jobs in the order they first stepped."""
        seen: list[str] = []
        for forward in self.adapter.forwards:
            for name in forward:
                if name not in seen:
                    seen.append(name)
        return seen


def finals(*jobs: Job) -> dict[str, object]:
    return {job.request.request_id: job.request.channel.finals for job in jobs}


def test_a_higher_tier_is_admitted_first():
    h = Harness(max_running=1, max_per_forward=1, max_paused=0)
    jobs = [h.job("flex", FLEX, 2), h.job("default", DEFAULT, 2), h.job("priority", PRIORITY, 2)]
    h.add(*jobs)
    h.drain()
    assert h.order() == ["priority", "default", "flex"]
    assert all(len(f) == 1 and not isinstance(f[0], Exception) for f in finals(*jobs).values())


def test_within_a_tier_jobs_with_a_deadline_go_by_least_slack():
    h = Harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.1)
    relaxed = h.job("relaxed", PRIORITY, 2, deadline_s=60.0)
    urgent = h.job("urgent", PRIORITY, 2, deadline_s=5.0)
    none = h.job("no-deadline", PRIORITY, 2)
    h.add(none, relaxed, urgent)
    h.drain()
    assert h.order() == ["urgent", "relaxed", "no-deadline"]  # no deadline: after those with one


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once_with_the_estimate():
    h = Harness(max_running=2, max_per_forward=2, max_paused=0)
    h.measure(0.5)  # half a second a forward
    ahead = [h.job(f"ahead{i}", DEFAULT, 10) for i in range(2)]
    h.add(*ahead)
    h.step()
    late = h.job("late", DEFAULT, 8, deadline_s=2.0)  # 8 steps x 0.5 s, behind 18 job-steps
    # The top tier: nobody ahead, but it may not pause anyone: 9 steps of the full running set, then 2.
    able = h.job("able", PRIORITY, 2, deadline_s=6.0)
    h.add(late, able)
    h.step()
    (refused,) = late.request.channel.finals
    assert refused.code is ErrorCode.UNAVAILABLE
    assert "deadline" in refused.message and "2000 ms" in refused.message and "estimated" in refused.message
    assert "late" not in h.order()  # never computed
    h.drain()
    assert not isinstance(able.request.channel.finals[0], Exception)


def test_an_estimate_that_refuses_all_on_an_idle_engine_is_probed_and_measured_again():
    """Lone forwards measured slow for a while (a disturbance: 1 s each, where they took 0.1 s) make a
    lone request late (4 steps for 0.6 s): it is refused at once, and an engine that refuses everything
    measures nothing again. So on an idle engine the PROBE_AFTER + 1-th such request runs instead
    (answered with its image: 4 steps of 0.01 s of the fake clock); its forwards (the fake adapter's:
    microseconds) are measured, and the next request, the same, is in time by the estimate."""
    h = Harness(max_running=2, max_per_forward=2, max_paused=0)
    h.measure(0.1)
    for _ in range(10):
        h.engine.times.forward_ran(1, 1, 1.0)
    for i in range(PROBE_AFTER):
        refused = h.job(f"refused{i}", DEFAULT, 4, deadline_s=0.6)
        h.add(refused)
        h.step(0.01)
        (final,) = refused.request.channel.finals
        assert final.code is ErrorCode.UNAVAILABLE and "cannot finish" in final.message, final
    assert not h.adapter.forwards
    for name in ("probe", "after"):
        job = h.job(name, DEFAULT, 4, deadline_s=0.6)
        h.add(job)
        while h.engine.active:
            h.step(0.01)
        assert job.request.channel.finals == [{"out": f"out:{name}"}]
    assert h.adapter.forwards


def test_the_probe_runs_every_image_of_its_request_and_never_runs_beside_other_work():
    """After PROBE_AFTER refusals on an idle engine, a two-image request runs as the probe, both images
    (judged one after the other, the second with the first's work ahead of it). A running job is other
    work: refusals beside it are never probes (its forwards measure)."""
    h = Harness(max_running=2, max_per_forward=2, max_paused=0)
    h.measure(0.1)
    for _ in range(10):
        h.engine.times.forward_ran(1, 1, 1.0)
    for i in range(PROBE_AFTER):
        refused = h.job(f"refused{i}", DEFAULT, 4, deadline_s=0.6)
        h.add(refused)
        h.step(0.01)
        assert refused.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    pair = [h.job("pair", DEFAULT, 4, deadline_s=0.6) for _ in range(2)]
    pair[1].request, pair[1].spec = pair[0].request, replace(pair[1].spec, index=1)
    h.add(*pair)
    h.step(0.01)
    assert h.adapter.forwards[-1] == ["pair", "pair"]  # both images started and stepped
    h = Harness(max_running=2, max_per_forward=2, max_paused=0)
    h.measure(0.1)
    busy = h.job("busy", DEFAULT, 50)
    h.add(busy)
    h.step(0.01)
    h.engine.times.forward_ran = lambda *args, **kwargs: None  # frozen: slow, as measured
    for i in range(2 * PROBE_AFTER):
        late = h.job(f"late{i}", DEFAULT, 8, deadline_s=0.5)
        h.add(late)
        h.step(0.01)
        assert late.request.channel.finals[0].code is ErrorCode.UNAVAILABLE, i


def test_best_effort_never_refuses_or_ends_for_a_deadline():
    h = Harness(max_running=1, max_per_forward=1, max_paused=0, refuse_late=False)
    h.measure(0.5)
    late = h.job("late", DEFAULT, 6, deadline_s=0.2)
    h.add(late)
    h.drain()
    assert not isinstance(late.request.channel.finals[0], Exception)


def test_a_running_job_whose_deadline_passes_ends_and_frees_its_row_at_the_next_step():
    h = Harness(max_running=1, max_per_forward=1, max_paused=0)
    slow = h.job("slow", DEFAULT, 50, deadline_s=1.0)
    waiting = h.job("waiting", DEFAULT, 2)
    h.add(slow, waiting)
    for _ in range(5):
        h.step(0.1)
    assert not slow.request.ended
    h.step(1.0)  # the deadline passed during this step's wait
    (ended,) = slow.request.channel.finals
    assert ended.code is ErrorCode.UNAVAILABLE and "timeout of 1000 ms passed after step" in ended.message
    h.drain()
    assert "waiting" in h.order() and not isinstance(waiting.request.channel.finals[0], Exception)


def test_a_request_that_ended_already_leaves_as_ended_not_for_its_deadline():
    # A cancelled (or otherwise ended) request leaves with its own outcome: its deadline passing or an
    # estimate refusing it afterwards is not a deadline outcome (no "expired" or "refused" departure, no
    # deadline error in place of the decided one).
    cancelled = RequestError(ErrorCode.CANCELLED, "cancelled by the client")
    h = Harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    running = h.job("running", DEFAULT, 4, deadline_s=3.0)  # 4 steps x 0.5 s: admitted
    h.add(running)
    h.step(0.1)
    assert running.run.steps_done == 1
    running.request.end(cancelled)  # ended while it ran; its deadline passes before the next step
    late = h.job("late", DEFAULT, 8, deadline_s=2.0)  # 8 steps x 0.5 s: the estimate would refuse it
    late.request.end(cancelled)  # ended while it waited to be scheduled
    h.add(late)
    h.step(5.0)
    assert ("running", "cancelled") in h.host.left and ("late", "cancelled") in h.host.left, h.host.left
    assert not [left for left in h.host.left if left[1] in ("expired", "refused")], h.host.left
    assert running.request.channel.finals == [cancelled] and late.request.channel.finals == [cancelled]


def test_a_higher_tier_pauses_the_lowest_running_job_which_resumes_where_it_was():
    h = Harness(max_running=2, max_per_forward=2, max_paused=2)
    low = h.job("low-flex", FLEX, 6)
    mid = h.job("default", DEFAULT, 6)
    h.add(low, mid)
    h.step()
    h.step()  # both ran two steps
    urgent = h.job("urgent", PRIORITY, 3)
    h.add(urgent)
    h.step()
    assert low in h.engine.scheduler.paused and low.run.steps_done == 2 and low.queue.pauses == 1
    assert h.adapter.forwards[-1] == ["urgent", "default"]  # the priority job first, in the freed row
    h.drain()
    for job in (low, mid, urgent):
        assert job.request.channel.finals == [{"out": f"out:{job.request.request_id}"}]
        assert (
            job.run.steps_done == job.run.total_steps
        )  # every step, none twice (FakeAdapter counts its own)
    assert low.state[0] == 6 and low.queue.paused_s > 0


@pytest.mark.parametrize(
    ("pause_by", "deadline_s", "overloaded", "paused"),
    [
        ("tier", 10.0, False, True),
        ("deadline", None, False, True),
        ("deadline", 10.0, False, False),
        ("deadline", 0.6, False, True),
        ("deadline", 0.85, False, True),
        ("deadline", 10.0, True, True),
    ],
)
def test_tier_pause_deadline_pauses_a_running_job_only_where_its_deadline_needs_it(
    pause_by, deadline_s, overloaded, paused
):
    """tier_pause tier: a higher tier pauses the lowest, whatever its deadline. deadline: without a
    deadline its tier decides; with one it meets waiting for room (4 steps of the running jobs, then its
    3: 0.7 s of 10 s) nobody is paused; with one it misses so (0.7 s of the 0.5 s left at its step, 0.1 s
    after it was sent), or meets only without the margin (0.7 s of 0.75 s left, past 90% of it), the
    lowest is paused for it; while the load is shown above capacity its tier decides."""
    h = Harness(max_running=2, max_per_forward=2, max_paused=2, pause_by=pause_by)
    h.measure(0.1)
    times = h.engine.times  # frozen: the fake forwards' own timings are not taken
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    if overloaded:
        h.engine.scheduler.offered.overload = lambda now, fixed_s: object()
    low, mid = h.job("low-flex", FLEX, 6), h.job("default", DEFAULT, 6)
    h.add(low, mid)
    h.step()
    h.step()  # both ran two steps: four left
    urgent = h.job("urgent", PRIORITY, 3, deadline_s=deadline_s)
    h.add(urgent)
    h.step()
    assert (low in h.engine.scheduler.paused, low.queue.pauses) == (paused, int(paused))
    assert ("urgent" in h.adapter.forwards[-1]) == paused
    h.drain()
    for job in (low, mid, urgent):  # every one answered with its image
        assert job.request.channel.finals == [{"out": f"out:{job.request.request_id}"}]


def test_tier_pause_deadline_admits_the_job_it_paused_for_whatever_the_cohort():
    """With a cohort above 1, a newcomer whose deadline needs the pause (3 steps after the running set's
    4: 0.7 s of 0.6 s) pauses the lowest job and goes into the place it made, though it would be in time
    after the cohort's shorter wait (1 forward: 0.4 s): no job is paused for nothing."""
    h = Harness(max_running=2, max_per_forward=2, max_paused=2, pause_by="deadline")
    h.measure(0.1)
    times = h.engine.times  # frozen: the fake forwards' own timings are not taken
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    h.engine.scheduler.pacing = AdmissionPacing(cohort=2, max_wait_steps=1)
    low, mid = h.job("low-flex", FLEX, 6), h.job("default", DEFAULT, 6)
    h.add(low, mid)
    h.step()
    h.step()  # both ran two steps: four left
    urgent = h.job("urgent", PRIORITY, 3, deadline_s=0.6)
    h.add(urgent)
    h.step()
    assert low in h.engine.scheduler.paused and "urgent" in h.adapter.forwards[-1]


@pytest.mark.parametrize("pause_by", ["tier", "deadline"])
def test_the_refusal_estimate_counts_no_wait_where_a_pause_is_there_for_it(pause_by):
    """A full running set that a newcomer of a higher tier could pause one of holds it back by nothing in
    the estimate that refuses it, in either tier_pause: under deadline it waits only where that is in
    time (10 s here), so the refusal need not price the wait."""
    h = Harness(max_running=2, max_per_forward=2, max_paused=2, pause_by=pause_by)
    h.measure(0.1)
    low, mid = h.job("low-flex", FLEX, 6), h.job("default", DEFAULT, 6)
    h.add(low, mid)
    h.step()
    urgent = h.job("urgent", PRIORITY, 3, deadline_s=10.0)
    scheduler = h.engine.scheduler
    assert scheduler._held_back_s(urgent, h.clock.now, (low, mid)) == 0.0


def test_nobody_is_paused_for_a_peer_or_beyond_max_paused():
    h = Harness(max_running=1, max_per_forward=1, max_paused=0)
    running = h.job("running", FLEX, 4)
    h.add(running)
    h.step()
    h.add(h.job("urgent", PRIORITY, 1))
    h.step()
    assert not h.engine.scheduler.paused  # no room to hold a paused job: the higher tier waits
    h = Harness(max_running=1, max_per_forward=1, max_paused=2)
    first = h.job("first", DEFAULT, 4)
    h.add(first)
    h.step()
    h.add(h.job("peer", DEFAULT, 1))
    h.step()
    assert not h.engine.scheduler.paused  # the same tier never pauses a running job


@pytest.mark.parametrize(
    ("pause_by", "deadline_s", "skips"),
    [
        ("tier", 10.0, True),
        ("deadline", None, True),
        ("deadline", 10.0, False),
        ("deadline", 1.0, False),
        ("deadline", 0.5, True),
    ],
)
def test_a_higher_tier_skips_admission_pacing_by_its_tier_pause(pause_by, deadline_s, skips):
    """tier_pause tier: a higher tier is admitted at once. deadline: without a deadline, too; with one it
    meets after the cohort's longest wait (5 forwards of 0.1 s, then its 2: 0.7 s of 10 s, or of 1 s,
    though waiting for the running job to be done would miss it) it waits for the cohort like its peers;
    with one it misses so (0.7 s of 0.5 s) it is admitted at once."""
    h = Harness(max_running=4, max_per_forward=4, max_paused=0, pause_by=pause_by)
    h.measure(0.1)
    times = h.engine.times  # frozen: the fake forwards' own timings are not taken
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    h.engine.scheduler.pacing = AdmissionPacing(cohort=4, max_wait_steps=5)
    h.add(h.job("a", DEFAULT, 20))
    h.step()
    h.add(h.job("default", DEFAULT, 2))
    h.step()  # 3 places free < a cohort of 4: the default job waits
    assert "default" not in h.order()
    h.add(h.job("urgent", PRIORITY, 2, deadline_s=deadline_s))
    h.step()  # outranks the running one
    assert ("urgent" in h.order()) == skips


def test_aging_lifts_a_waiting_job_above_fresh_higher_tiers_within_its_bound():
    aging_s = 1.0
    h = Harness(max_running=1, max_per_forward=1, max_paused=4, aging_s=aging_s)
    flex = h.job("flex", FLEX, 3)
    h.add(flex)
    started = h.clock.now
    # A stream of fresh priority jobs that alone would keep the engine busy for ever.
    for i in range(200):
        if flex.request.ended:
            break
        h.add(h.job(f"p{i}", PRIORITY, 2))
        h.step(0.1)
    assert flex.request.channel.finals == [{"out": "out:flex"}]
    # The bound: (rank + 1) x aging_s of waiting to outrank every fresh job, then its own steps (each
    # behind at most the one priority job already running) and the starvation bound of the forward pick.
    bound = (FLEX + 1) * aging_s + 2 * 3 * 0.1 + 1.0
    assert h.clock.now - started <= bound, (h.clock.now - started, bound)


def test_an_aged_job_is_never_paused_again_for_a_fresh_one():
    h = Harness(max_running=1, max_per_forward=1, max_paused=4, aging_s=1.0)
    old = h.job("old", FLEX, 30)
    old.queue.waited_s = 10.0  # waited long enough to outrank any tier
    h.add(old)
    h.step()
    for i in range(5):
        h.add(h.job(f"p{i}", PRIORITY, 1))
        h.step()
    assert old.queue.pauses == 0 and h.order()[0] == "old"


class PolicyAlone(Service):
    """No service order at all: admission by arrival, forwards by the policy's own key."""

    def key(self, job, now, finish_s) -> tuple:
        return ()

    def victim_key(self, job, now, finish_s) -> tuple:
        return ()


POLICIES = ["oldest", "fewest_remaining", "round_robin", "largest", "first_step_first"]


def forwards_of(policy: str, service: Service | None = None) -> list[list[str]]:
    """The forwards (job names, in their order) of one mixed workload: one tier, no deadlines, jobs of
    two sizes, arriving over the first steps, more than the running set holds."""
    h = Harness(max_running=4, max_per_forward=2, max_paused=0, policy=policy)
    if service is not None:
        h.engine.scheduler.service = service
    jobs = [h.job(f"j{i}", DEFAULT, 2 + i % 3) for i in range(8)]
    for i in (2, 5):
        params = Spec(group="256x256", steps=jobs[i].spec.params.steps)
        jobs[i].spec = replace(jobs[i].spec, params=params, shape="256x256")
    h.add(*jobs[:5])
    h.step()
    h.add(*jobs[5:])
    h.drain()
    assert all(job.request.channel.finals == [{"out": f"out:j{i}"}] for i, job in enumerate(jobs))
    return h.adapter.forwards


@pytest.mark.parametrize("policy", POLICIES)
def test_with_one_tier_and_no_deadlines_the_order_is_the_policy_alone(policy):
    # The service order adds nothing when every job has the default tier and no deadline: every forward,
    # and the order of the jobs in it, is what the policy gives with no service order at all.
    assert forwards_of(policy) == forwards_of(policy, PolicyAlone())


def test_the_policies_order_this_workload_differently():
    # What makes the test above able to fail: the order there is the policy's, not one any policy gives.
    assert len({str(forwards_of(policy, PolicyAlone())) for policy in POLICIES}) >= 3


def test_with_one_tier_aging_never_pauses_a_peer_nor_skips_the_cohort():
    # The shipped default ages jobs (tier_aging_s 30): under overload a long wait must not turn a job of
    # the same tier into one that pauses its peers or jumps admission pacing.
    h = Harness(max_running=2, max_per_forward=2, max_paused=2, aging_s=1.0)
    h.engine.scheduler.pacing = AdmissionPacing(cohort=2, max_wait_steps=1000)
    running = [h.job(f"r{i}", DEFAULT, 150) for i in range(2)]
    h.add(*running)
    h.step()
    late = h.job("late", DEFAULT, 2)
    h.add(late)
    for _ in range(100):  # 10 s of waiting: aged far past the top tier
        h.step(0.1)
    assert not any(job.queue.pauses for job in running) and "late" not in h.order()
    h.drain()
    assert late.request.channel.finals == [{"out": "out:late"}]


# ---- packed forwards: a token budget, scheduling and pricing by tokens -------------------------------


def packed_engine(
    budget: int | None = 10,
    max_per_forward: int = 8,
    cap_for=None,
    starvation_steps: int = 16,
    policy: str = "oldest",
    max_running: int = 64,
    packing_gate: bool = True,
) -> Engine:
    """An engine (with its host) whose jobs all share one group ("packed": the adapter pads rows of any
    size)."""
    limits = EngineLimits(
        max_running,
        max_per_forward,
        cap_for,
        starvation_steps=starvation_steps,
        max_tokens_per_forward=budget,
        packing_gate=packing_gate,
    )
    return Engine(StepEngine(FakeAdapter(), limits, make_policy(policy)), Host())


def packed(name: str, tokens: int, steps: int = 3, shape: str = "S") -> Job:
    return Job(tracked(name), Spec(group="packed", steps=steps), shape=shape, tokens=tokens)


def first_forward(engine: Engine, *jobs: Job) -> list[str]:
    for job in jobs:
        engine.add(job)
    engine.step()
    return engine.adapter.forwards[0]


def test_a_forward_fills_its_token_budget_in_order_skipping_what_does_not_fit():
    # 4, then 8 does not fit (12 > 10) but 2 and 4 after it do (10); 1 more would not.
    jobs = [packed("a4", 4), packed("b8", 8), packed("c2", 2), packed("d4", 4), packed("e1", 1)]
    assert first_forward(packed_engine(budget=10), *jobs) == ["a4", "c2", "d4"]
    # Without a budget (all of one size here) only the row caps bound it.
    jobs = [packed("a4", 4), packed("b8", 8), packed("c2", 2), packed("d4", 4), packed("e1", 1)]
    assert first_forward(packed_engine(budget=None, max_per_forward=4), *jobs) == ["a4", "b8", "c2", "d4"]


def test_without_a_budget_the_row_caps_alone_bound_a_forward_of_one_size_or_packed():
    """The default (no token budget): the jobs cap and each size's cap bound a forward, of one size or of
    mixed sizes packed (padding is not bounded by tokens: an out-of-memory forward learns a cap); a budget,
    where one is set, bounds either (the served default: test_step_engine.py, the shipped SD config)."""
    caps = {"small": 4, "large": 2}.__getitem__

    def job(name: str, shape: str) -> Job:
        side = 4 if shape == "small" else 8
        made = packed(name, 2 * side * side, shape=shape)
        made.spec.params.grid = (2, side, side)  # a guided image: two rows of side x side latent tokens
        return made

    smalls = [job(f"s{i}", "small") for i in range(5)]
    assert first_forward(packed_engine(budget=None, cap_for=caps), *smalls) == ["s0", "s1", "s2", "s3"]
    mixed = [
        job("l0", "large"),
        job("s0", "small"),
        job("s1", "small"),
        job("l1", "large"),
        job("l2", "large"),
    ]
    forward = first_forward(packed_engine(budget=None, cap_for=caps, max_per_forward=8), *mixed)
    assert forward == ["l0", "s0", "s1", "l1"] and computed_tokens(mixed[:4]) == 8 * 64
    smalls = [job(f"s{i}", "small") for i in range(5)]
    assert first_forward(packed_engine(budget=64, cap_for=caps), *smalls) == ["s0", "s1"]
    fresh = [job("l0", "large"), job("s0", "small"), job("s1", "small"), job("l1", "large")]
    assert first_forward(packed_engine(budget=256, cap_for=caps), *fresh) == ["l0", "s0"]


def test_a_packing_job_steps_with_the_cached_jobs_of_its_size_even_when_it_goes_first():
    """A job without a step cache packs with every size (ANY_SIZE); jobs with one keep to their size. The
    uncached job, oldest, goes first: its forward is its size's, so the cached ones share it rather than
    wait (it ran alone every step while they starved)."""
    engine = packed_engine(budget=None)
    uncached = Job(tracked("plain"), Spec(group=ANY_SIZE, steps=3, joins="S"), shape="S", tokens=1)
    cached = [Job(tracked(f"c{i}"), Spec(group="S", steps=3), shape="S", tokens=1) for i in range(3)]
    other = Job(tracked("other"), Spec(group=ANY_SIZE, steps=3, joins="T"), shape="T", tokens=1)
    assert first_forward(engine, uncached, *cached, other) == ["plain", "c0", "c1", "c2"]
    assert forward_group([uncached, *cached]) == "S"  # the caps an out-of-memory there lowers: its size's
    engine.step()
    engine.step()  # the size's jobs are done: the other size's packing job goes
    engine.step()
    assert engine.adapter.forwards[1:] == [["plain", "c0", "c1", "c2"]] * 2 + [["other"]]


def test_the_first_job_always_goes_even_alone_over_the_budget():
    engine = packed_engine(budget=10)
    huge, small = packed("huge", 15, steps=2), packed("small", 1, steps=2)
    assert first_forward(engine, huge, small) == ["huge"]  # alone: nothing fits beside it
    for _ in range(10):
        if not engine.active:
            break
        engine.step()
    assert huge.request.ended and huge.request.channel.finals == [{"out": "out:huge"}]
    assert engine.adapter.forwards == [["huge"], ["huge"], ["small"], ["small"]]


def test_per_shape_caps_bound_each_shape_within_one_mixed_forward():
    caps = {"L": 1, "S": 8}.__getitem__
    jobs = [packed("L0", 1, shape="L"), packed("L1", 1, shape="L"), packed("S0", 1), packed("S1", 1)]
    assert first_forward(packed_engine(budget=None, cap_for=caps), *jobs) == ["L0", "S0", "S1"]
    # ... and max_per_forward bounds the jobs in all.
    jobs = [packed("L0", 1, shape="L"), packed("S0", 1), packed("S1", 1), packed("S2", 1)]
    assert first_forward(packed_engine(budget=None, max_per_forward=3, cap_for=caps), *jobs) == [
        "L0",
        "S0",
        "S1",
    ]


def large_job_steps(
    starvation_steps: int, smalls_per_step: int, engine_steps: int = 40, max_running: int = 64
) -> list[int]:
    """The engine steps at which a large job (8 tokens of a budget of 10) stepped, amid small jobs (3 tokens,
    one step each) arriving every engine step, which the policy (fewest remaining) puts before it."""
    engine = packed_engine(
        budget=10, max_per_forward=64, starvation_steps=starvation_steps, max_running=max_running
    )
    engine.scheduler.policy = make_policy("fewest_remaining")
    large = packed("large", 8, steps=engine_steps)
    engine.add(large)
    stepped = []
    for step in range(1, engine_steps + 1):
        for i in range(smalls_per_step):
            engine.add(packed(f"s{step}.{i}", 3, steps=1))
        engine.step()
        assert engine.steps == step
        if "large" in engine.adapter.forwards[-1]:
            stepped.append(step)
    return stepped


def test_a_large_job_is_not_starved_by_a_stream_of_small_ones():
    bound = 4
    # Without the starvation rule (a bound never reached) the smalls always fill the forward first (3 + 8
    # > 10) and the large job never steps: the stream would starve it.
    assert large_job_steps(starvation_steps=1000, smalls_per_step=1) == []
    # With it: admitted at step 1, the large job steps at least once every `bound` engine steps (exactly:
    # not stepped for `bound` steps it goes first, and the first always goes), first by step 1 + bound.
    stepped = large_job_steps(starvation_steps=bound, smalls_per_step=1)
    gaps = [b - a for a, b in zip([1, *stepped], stepped, strict=False)]
    assert stepped and max(gaps) == bound and 40 - stepped[-1] < bound, stepped


def test_under_overload_a_large_job_still_steps_within_the_bound_plus_those_starved_before_it():
    # More small work arrives than the budget serves (4 x 3 tokens a step, 3 fit): small jobs starve
    # too. The longest starved goes first, so small jobs that starve later never pass the large one: it
    # steps within starvation_steps + the running jobs starved before it (max_running - 1 at most).
    bound, running = 4, 8
    stepped = large_job_steps(starvation_steps=bound, smalls_per_step=4, max_running=running)
    gaps = [b - a for a, b in zip([1, *stepped], stepped, strict=False)]
    # starvation_steps + max_running - 1 = 11, well inside the 40 steps run: a gap over it would show.
    assert (
        len(stepped) >= 3 and max(gaps) <= bound + running - 1 and 40 - stepped[-1] <= bound + running - 1
    ), stepped


@pytest.mark.parametrize(("ahead_tokens", "refused"), [(10, True), (2, False)])
def test_a_deadline_is_checked_against_the_tokens_ahead_not_the_jobs(ahead_tokens, refused):
    # The same four jobs ahead (a higher tier), 9 steps left each; the newcomer: 10 tokens, 4 steps, 2 s.
    # 10 tokens each: 360 token-steps ahead + its 40 = 10 forwards of the 40-token budget, 4 s: late.
    # 2 tokens each: 72 + 40 = its own 4 forwards of 28 tokens, 1.12 s: in time. (By jobs, the two are
    # the same: 36 job-steps ahead.)
    h = Harness(max_running=8, max_per_forward=8, max_paused=0, max_tokens=40)
    h.add(*[h.job(f"ahead{i}", PRIORITY, 10, tokens=ahead_tokens) for i in range(4)])
    h.step()
    for tokens in (10, 20, 40, 80):  # 10 ms a token, measured after the step (its own forward took ~0 s)
        h.engine.times.forward_ran(1, tokens, tokens / 100)
    newcomer = h.job("newcomer", DEFAULT, 4, deadline_s=2.0, tokens=10)
    h.add(newcomer)
    h.step()
    if refused:
        (final,) = newcomer.request.channel.finals
        assert final.code is ErrorCode.UNAVAILABLE and "360 token-steps ahead" in final.message, final
    else:
        h.drain()
        assert newcomer.request.channel.finals == [{"out": "out:newcomer"}]


def test_a_packed_forward_is_bounded_by_the_tokens_it_computes_padding_included():
    # Two jobs of 16 tokens each, a 4x4 and an 8x2 grid: 32 tokens of their own, but packed every row pads
    # to 8x4, 64 tokens computed: over a budget of 40, so they step apart; two 4x4 jobs fit together.
    engine = packed_engine(budget=40)
    tall, wide, square = packed("tall", 16, 1, "8x2"), packed("wide", 16, 1), packed("square", 16, 1)
    tall.spec.params.grid, wide.spec.params.grid, square.spec.params.grid = (1, 8, 2), (1, 4, 4), (1, 4, 4)
    assert computed_tokens([tall, wide]) == 64 and computed_tokens([wide, square]) == 32
    for job in (tall, wide, square):
        engine.add(job)
    engine.step()
    assert engine.adapter.forwards[-1] == ["tall"]  # the oldest first, alone: no other fits beside it
    engine.step()
    assert engine.adapter.forwards[-1] == ["wide", "square"]


# ---- the packing gate: sizes mixed run packed only where the cost fit does not price it dearer ----------
def gated(name: str, side: int, rows: int = 1) -> Job:
    made = Job(
        tracked(name),
        Spec(group=ANY_SIZE, steps=3, joins=f"{side}x{side}", grid=(rows, side, side)),
        shape=f"{side}x{side}",
        tokens=rows * side * side,
    )
    return made


def with_plane(engine: Engine, fixed: float, per_token: float, per_row: float) -> Engine:
    """The engine's cost fit as if these forwards had been measured, ``fixed + per_token x tokens + per_row
    x rows``, and kept so (the fake adapter's own timings are not what is tested)."""
    times = engine.engine.times
    for rows, tokens in ((1, 16), (2, 32), (2, 128), (4, 256), (1, 64)):
        times.by_rows_tokens[rows, tokens] = fixed + per_token * tokens + per_row * rows
    times.forward_ran = lambda *args, **kwargs: None
    return engine


# Two jobs, 8x8 and 2x2 latent tokens (64 and 4 a row); packed, the small row pads to the 8x8 canvas: 128
# tokens against 64 + 4 by size. Packing saves the forward's fixed part once and costs 60 padded tokens.
PACKED, BY_SIZE = 128, 68


@pytest.mark.parametrize(
    ("fixed", "per_token", "per_row", "rows", "packed"),
    [
        (0.0, 0.001, 0.0, 1, False),  # padding dear: 128 ms packed against 68 by size
        (0.05, 0.00001, 0.0, 1, True),  # the fixed part dear: packing saves a forward
        (0.0, 0.001, 0.01, 2, False),  # two rows a job (guided): the rows cost alike both ways
        (0.0575, 0.001, 0.0, 1, True),  # by size cheaper by 2.5 ms but 1.4%: within the margin, packed
        (0.0, 0.00001, 0.0, 1, True),  # by size cheaper by 47%, but by 0.6 ms: under the floor, packed
    ],
    ids=["padding dear", "forward dear", "rows", "within the margin", "under the floor"],
)
def test_sizes_mixed_run_by_size_only_where_the_fit_prices_that_cheaper_by_the_margins(
    fixed, per_token, per_row, rows, packed
):
    engine = with_plane(packed_engine(budget=None), fixed, per_token, per_row)
    large, small = gated("large", 8, rows), gated("small", 2, rows)
    assert computed_tokens([large, small]) == rows * PACKED
    expected = ["large", "small"] if packed else ["large"]
    assert first_forward(engine, large, small) == expected
    decision = engine.engine.scheduler.packing
    assert decision.packed == packed
    assert decision.packed_s == pytest.approx(fixed + per_token * rows * PACKED + per_row * 2 * rows)
    assert decision.by_size_s == pytest.approx(2 * fixed + per_token * rows * BY_SIZE + per_row * 2 * rows)
    if not packed:  # by size as without packing, under the oldest policy: the oldest job's size until done
        while engine.active:
            engine.step()
        assert engine.adapter.forwards == [["large"]] * 3 + [["small"]] * 3


def test_a_packed_forward_measured_dear_sends_the_next_mixed_forwards_by_size_but_for_a_probe():
    from triton_diffusion.engine.forward_choice import PACK_PROBE_AFTER, gate

    # The plane prices packing cheaper (the fixed part saved): the first mixed forward runs packed, and
    # the engine tells the fit it was (its rows padded); a forward of one size is not.
    engine, ran = padding(with_plane(packed_engine(budget=None), 0.05, 0.00001, 0.0))
    times = engine.engine.times
    assert first_forward(engine, gated("large", 8), gated("small", 2)) == ["large", "small"]
    assert ran[-1][4] is True  # (jobs, tokens, seconds, rows, packed)
    same, same_ran = padding(with_plane(packed_engine(budget=None), 0.05, 0.00001, 0.0))
    assert first_forward(same, gated("a", 8), gated("b", 8)) == ["a", "b"]
    assert same_ran[-1][4] is False
    # Packed forwards measured at three times the plane's price (a slower masked attention): by size.
    times.packed_by_rows_tokens[2, PACKED] = 3 * (0.05 + 0.00001 * PACKED + 0.0)
    decision = gate([gated("large2", 8), gated("small2", 2)], times, engine.engine.scheduler.computed, True)
    assert decision is not None and not decision.packed
    assert decision.packed_s == pytest.approx(3 * (0.05 + 0.00001 * PACKED))
    assert decision.by_size_s == pytest.approx(2 * 0.05 + 0.00001 * BY_SIZE)
    # After PACK_PROBE_AFTER forwards of one size, one runs packed again, to measure it.
    times.since_packed = PACK_PROBE_AFTER
    decision = gate([gated("large3", 8), gated("small3", 2)], times, engine.engine.scheduler.computed, True)
    assert decision is not None and decision.packed


def padding(engine: Engine) -> tuple[Engine, list]:
    """The engine's adapter reporting the padding its count says a forward computed (as a packing
    adapter's result does), and the forwards the fit is told of, recorded."""
    adapter, ran = engine.adapter, []
    plain = adapter.step

    def step(jobs, previews=None):
        result = plain(jobs, previews)
        padded = adapter.computed(jobs)[1] - sum(job.spec.tokens for job in jobs)
        return ForwardResult(result.steps, result.rows, padded_tokens=padded)

    adapter.step = step
    engine.engine.times.forward_ran = lambda *args: ran.append(args)
    return engine, ran


def test_before_the_fit_has_a_price_sizes_mixed_run_packed_and_the_jobs_count_it():
    engine = packed_engine(budget=None)
    large, small = gated("large", 8), gated("small", 2)
    assert first_forward(engine, large, small) == ["large", "small"]
    packing = engine.engine.scheduler.packing
    assert packing.packed and packing.packed_s is None and packing.by_size_s is None
    assert large.stats.packed_forwards == small.stats.packed_forwards == 1


def test_with_the_gate_off_sizes_mixed_run_packed_whatever_the_fit_prices():
    engine = with_plane(packed_engine(budget=None, packing_gate=False), 0.0, 0.001, 0.0)  # padding dear
    assert first_forward(engine, gated("large", 8), gated("small", 2)) == ["large", "small"]
    decision = engine.engine.scheduler.packing
    assert decision.packed and decision.packed_s is None


def test_both_engines_count_a_job_through_its_own_writers():
    """The step engine's scheduler and the request-level engine's fused calls write a job's counters
    through ``Job.took_part``, ``Job.reached`` and ``Job.ran_in``: a packed forward of two sizes counted as
    shared and packed, and a fused call's steps with the total the pipeline reports and the call it ran
    in. No module but engine/jobs.py assigns a job's counters or steps itself."""
    package = Path(__file__).resolve().parents[2] / "src" / "triton_diffusion"
    assigns = re.compile(r"\b(stats\.\w+|run\.(steps_done|total_steps))\s*([-+*/|])?=[^=]")
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() != "engine/jobs.py":
            assert not assigns.search(path.read_text()), f"{path.name} writes a job's counters itself"
    engine = packed_engine(budget=None)
    small, large = packed("small", 1, shape="S"), packed("large", 1, shape="L")
    engine.add(small)
    engine.add(large)
    engine.step()
    first = small.stats.first_forward
    engine.add(packed("late", 1, steps=1))
    engine.step()  # a second forward, shared by three: the first kept, the most shared its largest
    for job in (small, large):
        stats = job.stats
        assert (stats.forwards, stats.most_shared, stats.packed_forwards, job.run.steps_done) == (2, 3, 2, 2)
        assert first is not None and stats.first_forward == first

    def call(key, jobs, steps):
        for step in (1, 2, 3):
            steps.on_step(step, 3)
        return steps.scatter(["image"] * len(steps.alive))

    fused = RequestEngine(call, RowCaps(8), lambda report: None, ClientAborts())
    jobs = [Job(tracked(name), None, group=KEY) for name in "ab"]
    fused.add(*jobs)
    fused.step()
    for job in jobs:
        assert (job.stats.forwards, job.stats.most_shared, job.run.steps_done, job.run.total_steps) == (
            1,
            2,
            3,
            3,
        )
        assert [call["rows"] for call in job.stats.calls] == [2]
