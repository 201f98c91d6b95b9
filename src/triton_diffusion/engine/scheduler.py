"""The step engine's scheduler: it owns every queue (waiting, starting, running, paused, finishing) and
decides, each engine step, who is admitted, who is paused and who resumes (:meth:`Scheduler.schedule`),
and which jobs step together (:meth:`Scheduler.next_forward`). Its swappable parts are in ordering.py
(the policy, service tiers and deadlines, admission pacing); the engine (step_engine.py) applies what it
decides and tells it what happened.

- Admission: newcomers join the running set while it has room, in order (tier, least slack, arrival),
  paced into cohorts while the engine is busy (AdmissionPacing); a job that outranks a running one by
  tier is admitted at once, pausing the lowest running job if the set is full (at most ``max_paused``
  paused; ``Service.pause_by`` deadline: only where its deadline needs it). Paused jobs resume before
  newcomers of their tier, as they were.
- Deadlines: a newcomer whose deadline the estimate (estimates.py) says it cannot meet, given the work
  that goes before it, is refused at once (on an idle engine that refused many in a row, the estimate is
  dropped and the next runs: WorkTimes.probe); a job whose deadline passes leaves at the next step.
- Degradation: before that, a waiting job whose request allows fewer steps is given the most steps with
  which the same estimate meets its deadline, and one late even so has waiting jobs ahead of it (of its
  tier or lower, in time, allowing fewer steps) cut to make room for it (none cut where every deadline
  is met: degradation.py); none newly cut, and no step cache given, where the load offered leaves
  headroom (overload.py).
- Forwards: only jobs of one group share a forward (a latent shape, or any size where the adapter packs
  rows of different lengths); the group of the best job goes, filled in order within its caps, fewer
  where a deadline needs it (config ``narrow_forwards``), by size where the cost fit prices that cheaper
  than packed; no running job starves (forward_choice.py). The decisions go in the forward's report.
- Caps: at most ``max_per_forward`` jobs, ``max_tokens_per_forward`` tokens and, of each shape, its size's
  cap; lowered after an out-of-memory forward, raised after enough full ones (:class:`ForwardCaps`).

State: the scheduler is the one writer of a job's engine state and of its request's record
(engine/request_status.py): it takes what the adapter made of a started job (:meth:`started`), applies each
forward's per-job results (:meth:`update`, as vLLM's ``update_from_output``), and ends requests (a
failure, a deadline, an abort: :meth:`end`); the engine only carries those results to it and reports.

Thread-safety: the execute() thread adds jobs (:meth:`add`) and asks what is held (:attr:`active`,
:meth:`outranks_held`); everything else runs on the engine thread. One lock guards the queues.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from triton_diffusion.engine.degradation import (
    CUT_TARGET,
    cut_for_deadline,
    late_caches,
    make_room,
    may_cache,
    with_headroom,
)
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.forward_caps import EngineLimits, ForwardCaps
from triton_diffusion.engine.forward_choice import choose_group, fill, gate, narrow, narrow_pays
from triton_diffusion.engine.jobs import (
    Computed,
    ForwardOutcome,
    ForwardResult,
    Job,
    JobStart,
    Left,
    Packing,
    SchedulerOutput,
    Stepped,
    forward_group,
    rows_and_tokens,
    timeout_of,
)
from triton_diffusion.engine.ordering import AdmissionPacing, Policy, Service, make_policy
from triton_diffusion.engine.overload import OfferedLoad, Overload, arrival_of, overload_cut
from triton_diffusion.engine.request_status import Abort, Request, RequestTable, apply_aborts, held_requests
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class Scheduler:
    def __init__(
        self,
        limits: EngineLimits,
        policy: Policy | None = None,
        pacing: AdmissionPacing | None = None,
        service: Service | None = None,
        times: WorkTimes | None = None,
        clock: Callable[[], float] = time.perf_counter,
        computed: Computed = rows_and_tokens,
    ) -> None:
        self.limits = limits
        self.computed = computed  # a forward's rows and tokens, padding included (the adapter's)
        self.clock = clock  # perf_counter seconds: what deadlines and waits are measured on
        self.policy = policy or make_policy("oldest")
        self.pacing = pacing or AdmissionPacing()
        self.service = service or Service()
        self.times = times or WorkTimes()
        self.offered = OfferedLoad()  # the newest arrivals: what they ask of the engine (engine/overload.py)
        self.overloaded = False  # tier_pause deadline: whether the load was shown above capacity (this step)
        self.packing: Packing | None = None  # the packing gate's decision for the last forward chosen
        self.narrowed = 0  # the jobs it left out for a deadline (config narrow_forwards)
        self.caps = ForwardCaps(limits)
        self.waiting: list[Job] = []
        self.starting: list[Job] = []  # admitted, being started by the adapter
        self.running: list[Job] = []
        self.paused: list[Job] = []
        self.finishing: list[Job] = []  # done, being decoded
        self.requests = RequestTable()  # the engine's record of each request held
        self._inbox: list[Job] = []
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self.step = 0  # the engine step being scheduled

    # ---- any thread ---------------------------------------------------------------------------------
    def add(self, *jobs: Job) -> None:
        """Jobs arrive (a request's together: they share its record before any can be scheduled)."""
        self.requests.attach(*jobs)
        with self._lock:
            for job in jobs:
                job.queue.arrived = next(self._arrivals)
                job.queue.ready_at = self.clock()  # its wait in the engine (what ages it) starts now
                self._inbox.append(job)

    @property
    def active(self) -> int:
        """Jobs held: in the inbox, waiting, starting, running, paused or finishing."""
        with self._lock:
            return sum(map(len, self._queues())) + len(self._inbox)

    @property
    def with_deadline(self) -> int:
        """Of the jobs held, those with a deadline (the door's room for them: serving/engine_worker.py)."""
        with self._lock:
            held = (self._inbox, *self._queues())
            return sum(job.spec.deadline is not None for queue in held for job in queue)

    def outranks_held(self, tier: int) -> bool:
        """Whether a job of ``tier`` outranks a job held (it would pause it, or pass it in the queue)."""
        with self._lock:
            return any(job.spec.tier > tier for queue in (self._inbox, *self._queues()) for job in queue)

    def _queues(self) -> tuple[list[Job], ...]:
        return (self.waiting, self.starting, self.running, self.paused, self.finishing)

    # ---- the engine thread: decisions ---------------------------------------------------------------
    def schedule(self, step: int, now: float | None = None) -> SchedulerOutput:
        """Admit, pause and resume for this engine step; jobs whose request ended, and those refused or
        expired for their deadline, leave every queue."""
        now = self.clock() if now is None else now
        out = SchedulerOutput()
        with self._lock:
            self.step = step
            arrived, self._inbox = self._inbox, []
            for job in arrived:
                job.queue.queued_at = step - 1  # it arrived while the last engine step ran (or after it)
                self.offered.arrived(arrival_of(job))
            self.waiting.extend(arrived)
            by_need = self.service.pause_by == "deadline"
            self.overloaded = by_need and self._load_view(now)[0] is not None
            self._expire(out, now)
            self._cut_steps(now)
            self._refuse_late(arrived, now, out)
            self._drop_ended(out)
            self._admit(out, now)
            self._cache_late(now, out)
        return out

    def held_requests(self) -> list[Request]:
        """The requests of the jobs waiting, running or paused (a waiting client may leave too) and just
        added, not ended: those an abort may name."""
        return held_requests(self._abortable())

    def abort(self, aborts: list[Abort]) -> None:
        """End the requests the host aborts (cancelled, or answered elsewhere); their jobs leave at
        :meth:`schedule`."""
        if aborts:
            apply_aborts(self._abortable(), aborts)

    def _abortable(self) -> list[Job]:
        with self._lock:
            return self.running + self.paused + self.waiting + self._inbox

    def _drop_ended(self, out: SchedulerOutput) -> None:
        for queue in (self.waiting, self.running, self.paused):
            for job in [j for j in queue if j.status.ended]:
                queue.remove(job)
                status = job.status
                reason = "cancelled" if status.cancelled else "ended"
                # A cancelled request's jobs carry its error to the host (which ends it once).
                out.leave.append(Left(job, reason, status.error if status.cancelled else None))

    def _expire(self, out: SchedulerOutput, now: float) -> None:
        if not self.service.refuse_late:
            return  # best_effort: deadlines only order the work
        for queue in (self.waiting, self.running, self.paused):
            # A job whose request ended already (a sibling image, a cancel) is dropped as ended below.
            passed = [
                j
                for j in queue
                if j.spec.deadline is not None and j.spec.deadline <= now and not j.status.ended
            ]
            for job in passed:
                queue.remove(job)
                steps = f"{job.run.steps_done}/{job.planned}"
                self._leave(job, "expired", f"the request's {timeout_of(job)} passed after step {steps}", out)

    def _refuse_late(self, arrived: list[Job], now: float, out: SchedulerOutput) -> None:
        """Refuse the newcomers that cannot meet their deadlines. Each is judged without the work of a
        request refused before it (its other images are ended, not yet dropped); after any refusal the
        refused requests' images leave and the cuts made to make room for them are decided again
        (:meth:`_cut_steps`): room they held goes to the jobs still waiting."""
        refused = [job for job in arrived if job in self.waiting and self._refused(job, now, out)]
        if refused:
            self._drop_ended(out)
            self._cut_steps(now)

    def _refused(self, job: Job, now: float, out: SchedulerOutput) -> bool:
        """A newcomer that cannot meet its deadline, given the work that goes before it, leaves now (True)."""
        if job.spec.deadline is None or not self.service.refuse_late or not self.times.measured:
            return False
        cut = job.queue.cut
        if job.status.ended or (cut is not None and cut.rule != "overload"):
            return False  # dropped as ended below; or cut to steps the walk found in time (_cut_steps)
        mine = self.order_key(job, now)
        held = (self.waiting, self.running, self.paused)
        ahead = [j for q in held for j in q if j is not job and not j.status.ended]
        ahead_work = sum(j.remaining * j.spec.tokens for j in ahead if self.order_key(j, now) < mine)
        behind = tuple(j for j in self.running if not j.status.ended and self.order_key(j, now) >= mine)
        estimate = self._finish_in(
            job, ahead_work, behind, self._held_back_s(job, now, behind), job.remaining
        )
        idle = not self.starting and all(j.request is job.request for j in ahead)
        if now + estimate <= job.spec.deadline or idle and self.times.probe():
            return False  # in time; or on an idle engine, an estimate that refuses all there is dropped
        self.waiting.remove(job)
        estimated = (now - job.request.entered + estimate) * 1000
        why = f"estimated {estimated:.0f} ms with {ahead_work} token-steps ahead"
        self._leave(job, "refused", f"the request cannot finish within its {timeout_of(job)}: {why}", out)
        return True

    def _finish_in(
        self, job: Job, ahead_work: int, behind: tuple[Job, ...], held_back_s: float, steps: int
    ) -> float:
        """Seconds until a waiting ``job`` is done with ``steps`` denoising steps, after ``ahead_work``
        token-steps that go before it, beside the running jobs ``behind`` it in order (each sharing its
        forwards for its steps left; none where narrowed forwards, config narrow_forwards, bring it in
        sooner), and after ``held_back_s`` (:meth:`_held_back_s`)."""
        alongside = sum(j.spec.tokens * min(j.remaining, steps) // max(steps, 1) for j in behind)
        budget, tokens = self._budget(job), job.spec.tokens
        done_in = self.times.finish_in(tokens, steps, ahead_work, budget, False, alongside)
        if alongside and self.limits.narrow_forwards and narrow_pays(self.times, tokens, tokens + alongside):
            done_in = min(done_in, self.times.finish_in(tokens, steps, ahead_work, budget, False))  # narrowed
        return done_in + held_back_s

    def _held_back_s(self, job: Job, now: float, behind: tuple[Job, ...]) -> float:
        """A full running set that a waiting ``job`` may not pause anyone in holds it until a running job
        ``behind`` it in order is done: those seconds (else 0)."""
        full = len(self.running) + len(self.starting) >= self.limits.max_running
        if not (full and behind) or self._victim(job, now, by_need=False) is not None:
            return 0.0  # it pauses one (tier_pause deadline: where it waits, it is in time waiting)
        running_s = self.times.forward_s(sum(j.spec.tokens for j in self.running))
        return min(j.remaining for j in behind) * running_s

    def _cut_steps(self, now: float) -> None:
        """Each waiting job that may run fewer steps gets the most with which it meets its deadline; a
        waiting job late even so has waiting jobs ahead of it, of its tier or lower, cut to make room for
        it (engine/degradation.py): decided in the order jobs go, each after the work before it."""
        if not self.service.refuse_late or not self.times.measured:
            return
        if not any(j.steps_allowed and j.spec.deadline is not None for j in self.waiting):
            return
        # With headroom (engine/overload.py) no job is newly cut: one cut before keeps what it needs; with
        # none cut before, the walk below would change nothing (skipped: it prices every held job).
        overload, headroom = self._load_view(now)
        if headroom and all(j.queue.cut is None for j in self.waiting):
            return
        held = [j for q in (self.waiting, self.starting, self.running, self.paused) for j in q]
        keys = {id(j): self.order_key(j, now) for j in held if not j.status.ended}
        running = [(keys[id(j)], j) for j in self.running if id(j) in keys]  # keyed once per walk
        waiting = set(map(id, self.waiting))
        ahead = 0
        cuttable: list[Job] = []  # waiting jobs passed, in time, that may be cut for a later one
        freeable: dict[int, int] = {}  # by tier: the token-steps those could still give up
        for job in sorted((j for j in held if id(j) in keys), key=lambda j: keys[id(j)]):
            mine = keys[id(job)]
            if id(job) in waiting and job.spec.deadline is not None:
                behind = tuple(j for key, j in running if key >= mine)
                held_back = self._held_back_s(job, now, behind)
                allowed, left = job.steps_allowed, job.spec.deadline - now
                done_in = partial(self._finish_in, job, ahead, behind, held_back)
                if allowed and not headroom:
                    job.queue.cut = cut_for_deadline(allowed, done_in, left, job.queue.cut)
                elif allowed and job.queue.cut is not None:
                    job.queue.cut = with_headroom(allowed, done_in, left, job.queue.cut)
                after = partial(self._finish_after, job, ahead, behind, held_back)
                if not headroom and after(0, job.remaining) > left:
                    # Late: room ahead of it, where what its tier or lower could give up would bring it in
                    # time (one estimate decides whether to look).
                    least = allowed[-1][1] if allowed else job.remaining
                    room = sum(v for tier, v in freeable.items() if tier >= job.spec.tier)
                    if room and after(room, least) <= left * CUT_TARGET:
                        for other, cut in make_room(job, cuttable, after, left, least):
                            freed = (other.remaining - cut.denoising) * other.spec.tokens
                            freeable[other.spec.tier] -= freed
                            ahead -= freed
                            other.queue.cut = cut
                        if allowed:
                            done_in = partial(self._finish_in, job, ahead, behind, held_back)
                            job.queue.cut = cut_for_deadline(allowed, done_in, left, job.queue.cut)
                if allowed and overload is not None:  # the load's cut where it is deeper (engine/overload.py)
                    load_cut = overload_cut(allowed, overload.shares.get(job.spec.tier, 0.0), overload)
                    if load_cut is not None and load_cut.denoising < job.planned:
                        job.queue.cut = load_cut
                # A job late itself is not cut for another: it is refused or expires (a cut would let it in).
                if allowed and self._finish_in(job, ahead, behind, held_back, job.remaining) <= left:
                    cuttable.append(job)
                    spare = max(job.remaining - allowed[-1][1], 0) * job.spec.tokens
                    freeable[job.spec.tier] = freeable.get(job.spec.tier, 0) + spare
            ahead += job.remaining * job.spec.tokens

    def _load_view(self, now: float) -> tuple[Overload | None, bool]:
        """The load offered at ``now``: its overload shown, and whether it leaves headroom (overload.py)."""
        return self.offered.view(now, self.times.fixed_s)

    def _cache_late(self, now: float, out: SchedulerOutput) -> None:
        """Each running or paused job that may be given a step cache and that the estimate says misses its
        deadline at full compute, after the work that goes before it, is given it for its steps left
        (engine/degradation.py); the adapter turns it on before the next forward."""
        if not self.service.refuse_late or not self.times.measured:
            return
        started = {id(j) for j in self.running + self.paused if may_cache(j)}
        if not started or self._load_view(now)[1]:
            return
        queues = (self.waiting, self.starting, self.running, self.paused)
        held = [j for q in queues for j in q if not j.status.ended]
        held.sort(key=lambda j: self.order_key(j, now))

        def finish_s(job: Job, ahead: int) -> float:
            return self.times.finish_in(job.spec.tokens, job.remaining, ahead, self._budget(job), True)

        for job, given in late_caches(held, started, now, finish_s):
            job.queue.cache_given = given
            out.cache.append(job)

    def caches_refused(self, refused: list[tuple[Job, str]]) -> None:
        """The adapter could not give these jobs the cache decided for them (``refused``: each with why):
        they run on without one, are not reported degraded by it, and are not given one again."""
        for job, why in refused:
            log.warning("%r: no step cache given (%s): it runs on without one", job, why)
            job.queue.cache_given, job.queue.cache_refused = None, True

    def _finish_after(
        self, job: Job, ahead_work: int, behind: tuple[Job, ...], held_back_s: float, freed: int, steps: int
    ) -> float:
        """:meth:`_finish_in` for ``steps`` with ``freed`` token-steps fewer ahead of ``job``."""
        return self._finish_in(job, ahead_work - freed, behind, held_back_s, steps)

    @staticmethod
    def _leave(job: Job, reason: str, message: str, out: SchedulerOutput) -> None:
        """End a job for its deadline: decided here, the host delivers it."""
        error = RequestError(ErrorCode.UNAVAILABLE, f"deadline: {message}")
        job.status.end(error)
        out.leave.append(Left(job, reason, error))

    def _admit(self, out: SchedulerOutput, now: float) -> None:
        candidates = sorted(self.waiting + self.paused, key=lambda j: self.admission_key(j, now))
        if not candidates:
            return
        room = self.limits.max_running - len(self.running)
        oldest = min((j.queue.queued_at for j in self.waiting), default=self.step)
        due = self.pacing.due(len(self.running), room, self.step - 1 - oldest)
        cohort_wait = self.pacing.max_wait_steps
        for job in candidates:
            # Only a strictly higher tier (by its own, not by aging) pauses a running job or skips the
            # cohort: with one tier nobody is ever paused and pacing is the only gate.
            outranks = any(j.spec.tier > job.spec.tier for j in self.running)
            victim = None
            if room <= 0:
                victim = self._victim(job, now) if outranks else None
                if victim is None:
                    continue  # a higher tier behind it in order may still pause someone
                self._pause(victim, now, out)
                room += 1
            if job in self.paused:
                self._resume(job, now, out)
            # A job paused for it has made its place: it goes in, whatever the cohort.
            elif due or victim is not None or outranks and not self._waits_in_time(job, now, cohort_wait):
                self.waiting.remove(job)
                self._ready(job, now)
                self.starting.append(job)
                out.admit.append(job)
            # else: held for a cohort; its place is kept, so no lower job resumes into it
            room -= 1

    def _victim(self, job: Job, now: float, by_need: bool = True) -> Job | None:
        """The running job to pause for ``job``: of a strictly lower tier and not aged up to ``job``'s
        effective tier (an aged job is never paused again), the lowest, most slack, most work left. None
        where ``job`` may wait in time (:meth:`_waits_in_time`; ``by_need`` False: whether one would be
        paused if its deadline needed it)."""
        if len(self.paused) >= self.limits.max_paused or by_need and self._waits_in_time(job, now):
            return None
        tier = self.service.effective_tier(job, now)
        lower = [
            j
            for j in self.running
            if j.spec.tier > job.spec.tier and self.service.effective_tier(j, now) > tier
        ]
        return max(lower, key=lambda j: self.service.victim_key(j, now, self._finish_s), default=None)

    def _waits_in_time(self, job: Job, now: float, forwards: int | None = None) -> bool:
        """tier_pause ``deadline``: whether ``job`` (with a deadline, the load not shown above capacity) is
        done within ``CUT_TARGET`` of its time left waiting ``forwards`` of the running set (None: until one
        is done), then the waiting and paused jobs before it in order, sharing the running set's forwards.
        Then it neither pauses a running job nor skips the admission cohort: a paused job loses its place
        and may miss its own deadline (the margin, as a cut's: the estimate is an average)."""
        if self.service.pause_by != "deadline" or self.overloaded or job.spec.deadline is None:
            return False
        running = tuple(j for j in self.running if not j.status.ended)
        if not running or not self.times.measured:
            return False
        mine = self.order_key(job, now)
        held = (j for j in self.waiting + self.paused if j is not job and not j.status.ended)
        ahead = sum(j.remaining * j.spec.tokens for j in held if self.order_key(j, now) < mine)
        forwards = min(j.remaining for j in running) if forwards is None else forwards
        wait = forwards * self.times.forward_s(sum(j.spec.tokens for j in running))
        done_in = self._finish_in(job, ahead, running, wait, job.remaining)
        return done_in <= (job.spec.deadline - now) * CUT_TARGET

    def _pause(self, job: Job, now: float, out: SchedulerOutput) -> None:
        self.running.remove(job)
        self.paused.append(job)
        job.queue.pauses += 1
        job.queue.ready_at = now
        out.pause.append(job)

    def _resume(self, job: Job, now: float, out: SchedulerOutput) -> None:
        self.paused.remove(job)
        job.queue.paused_s += now - job.queue.ready_at if job.queue.ready_at is not None else 0.0
        self._ready(job, now)
        job.queue.waited_since = self.step
        self.running.append(job)
        out.resume.append(job)

    @staticmethod
    def _ready(job: Job, now: float) -> None:
        """The job stops waiting (admitted or resumed): its wait counts towards aging."""
        if job.queue.ready_at is not None:
            job.queue.waited_s += now - job.queue.ready_at
        job.queue.ready_at = None

    def next_forward(self, now: float | None = None) -> list[Job]:
        """The jobs of the next forward: one group, filled in order within its caps, by size where the
        packing gate prices that cheaper, narrowed where a deadline needs it (engine/forward_choice.py)."""
        now = self.clock() if now is None else now
        with self._lock:
            running = [j for j in self.running if not j.status.ended]  # ended while starting: not run
        if not running:
            return []
        keys: dict[int, tuple] = {}  # each job's forward key, computed once this step (it prices its slack)

        def order(j: Job) -> tuple:
            key = keys.get(id(j))
            if key is None:
                key = keys[id(j)] = self._forward_key(j, now)
            return key

        group = choose_group(running, self.step, self.limits.starvation_steps, self.policy, order)
        members = [
            j
            for j in running
            if j.run.group == group or (j.run.also_joins is not None and j.run.also_joins == group)
        ]
        # Starved jobs first, the longest starved first (the group's reason: it goes; one starving later never
        # passes it, so it goes within starvation_steps + max_running - 1 steps at most), then the order.
        members.sort(key=order)
        taken = fill(group, members, self.caps, self.computed)
        self.packing = gate(taken, self.times, self.computed, self.limits.packing_gate)
        if self.packing is not None and not self.packing.packed:
            same = [j for j in members if j.spec.shape == taken[0].spec.shape]
            taken = fill(group, same, self.caps, self.computed)
        self.narrowed, narrowed = 0, taken
        if self.limits.narrow_forwards:  # last, of the jobs that go; never past the starved (first)
            starved = sum(self.step - j.queue.waited_since >= self.limits.starvation_steps for j in taken)
            narrowed = narrow(taken, now, self.times, self.computed, starved)
        self.narrowed = len(taken) - len(narrowed)
        return narrowed

    def _forward_key(self, job: Job, now: float) -> tuple:
        if self.step - job.queue.waited_since >= self.limits.starvation_steps:
            return (False, job.queue.waited_since, job.queue.admitted)
        return (True, *self.order_key(job, now))

    def order_key(self, job: Job, now: float) -> tuple:
        return (*self.service.key(job, now, self._finish_s), *self.policy.job_key(job))

    def admission_key(self, job: Job, now: float) -> tuple:
        return (*self.service.key(job, now, self._finish_s), job.queue.arrived)

    def _finish_s(self, job: Job) -> float:
        """Seconds to finish this job alone in its forwards (its slack): one not started by the steps it asked
        less its checkpoint's (a cut would give it slack, and move it behind the jobs it was cut for)."""
        started = job.state is not None
        steps = job.remaining if started else max(job.spec.planned_steps - job.spec.resumed_steps, 0)
        return self.times.finish_in(job.spec.tokens, steps, 0, self._budget(job), started)

    def late_jobs(self, seconds: float, now: float | None = None) -> list[Job]:
        """The jobs held (not ended) that cannot be done within ``seconds`` (a drain): in the order they
        go, each one's estimate counts the work of those before it that will be done in time (a late job
        leaves, so its work goes before nobody). Before any forward was measured only ``seconds`` <= 0
        makes a job late (nothing is known: the next look decides)."""
        now = self.clock() if now is None else now
        late: list[Job] = []
        ahead = 0
        with self._lock:  # the engine thread's walk changes cuts (and so what remains) under it
            queues = (self._inbox, self.waiting, self.starting, self.running, self.paused)
            held = [job for queue in queues for job in queue if not job.status.ended]
            held.sort(key=lambda job: self.order_key(job, now))
            for job in held:
                started = job.state is not None
                budget = self._budget(job)
                estimate = self.times.finish_in(job.spec.tokens, job.remaining, ahead, budget, started)
                if estimate > seconds or seconds <= 0:
                    late.append(job)
                else:
                    ahead += job.remaining * job.spec.tokens
        return late

    def _budget(self, job: Job) -> int:
        group = job.run.group if job.run.group is not None else job.spec.shape
        return self.caps.budget_for(group, job.spec.shape, job.spec.tokens)

    # ---- the engine thread: what happened ------------------------------------------------------------
    def started(self, jobs: list[Job], starts: list[JobStart]) -> None:
        """The adapter started these admitted jobs (``starts``: what it made of each): they run from now."""
        with self._lock:
            for job, start in zip(jobs, starts, strict=True):
                job.begin(start)  # a job resumed from a checkpoint starts with its steps done
                self.starting.remove(job)
                job.queue.admitted = next(self._admissions)
                job.queue.waited_since = self.step
                self.running.append(job)

    def update(self, jobs: list[Job], result: ForwardResult, forward: int) -> ForwardOutcome:
        """Apply one forward's per-job results (the ``forward``-th): each job's counters and denoising
        step; a job whose own step failed is returned as failed (not advanced); those that took their
        last step move to finishing (decoded next)."""
        self.caps.ran(forward_group(jobs), len(jobs), self.computed(jobs)[1])
        mixed = len({job.spec.shape for job in jobs}) > 1  # a packed forward: sizes mixed
        outcome = ForwardOutcome()
        for job, out in zip(jobs, result.steps, strict=True):
            job.queue.waited_since = self.step
            job.took_part(len(jobs), forward, packed=mixed)
            if out.error is not None:
                error = out.error.request_error("denoising step")  # out of memory: UNAVAILABLE
                outcome.failed.append((job, error))
                continue
            job.reached(out.step, computed=out.rows_computed, reused=out.rows_reused)
            outcome.rows_reused += out.rows_reused
            outcome.stepped.append(
                Stepped(job, out.step, job.run.total_steps, out.snapshot, out.rows_computed, out.rows_reused)
            )
            if out.done:
                outcome.done.append(job)
        full = len(self.running) + len(self.starting) >= self.limits.max_running
        token_steps = sum(s.job.spec.tokens for s in outcome.stepped)
        self.offered.served(self.clock(), token_steps, self.times.spent_s, full)
        with self._lock:
            for job in outcome.done:
                if job in self.running:
                    self.running.remove(job)
                    self.finishing.append(job)
        return outcome

    def end(self, job: Job, error: RequestError) -> None:
        """Decide the error of the job's request (its other jobs leave at the next :meth:`schedule`)."""
        job.status.end(error)

    def remove(self, job: Job) -> None:
        """The job left the engine (finished, failed): out of whatever queue holds it."""
        with self._lock:
            for queue in (self._inbox, *self._queues()):
                if job in queue:
                    queue.remove(job)
                    break
        self.requests.detach(job)

    def take_all(self) -> list[Job]:
        """Every job held, removed from the queues (the engine answers them all: shutdown, a lost device)."""
        with self._lock:
            held = [job for queue in (self._inbox, *self._queues()) for job in queue]
            for queue in (self._inbox, *self._queues()):
                queue.clear()
        return held  # each leaves through remove()

    def put_back(self, jobs: list[Job]) -> None:
        """Admitted jobs that could not be started (a lost device): held as waiting again."""
        with self._lock:
            for job in jobs:
                if job in self.starting:
                    self.starting.remove(job)
                    self.waiting.append(job)
