"""What the engines work on (a :class:`Job`), what an adapter returns for each job (:class:`JobStart`,
:class:`JobStep`, :class:`ForwardResult`) and what an engine step hands the host (a :class:`StepReport`).

Data flows one way: the scheduler decides (scheduler.py), the adapter computes and returns a result per
job, the engine applies it to the job and reports what happened, and the serving host answers on its
response thread. Nothing below the engine changes a job's engine state (its counters, its group, its
place in a queue); the adapter owns only ``job.state``.

Words (the glossary): an *image* (or video, or LM request) is one job; a *row* is one row of the
denoiser's batch (a job with classifier-free guidance has two); a *forward* is one model call over the
rows of the jobs stepping together; an *engine step* is one turn of the engine loop (at most one
forward); a job's *denoising steps* are its ``total_steps``, of which it has done ``steps_done``; a job's
*tokens* are what it adds to a forward (its spec's ``tokens``): its denoiser rows times the latent tokens
of one row (frames included), what a forward's cost and memory grow with when jobs of any size share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from triton_diffusion.engine.degradation import CacheGiven, StepsAllowed, StepsCut
from triton_diffusion.engine.failures import Failure
from triton_diffusion.engine.request_status import Request, RequestStatus
from triton_diffusion.errors import RequestError

if TYPE_CHECKING:
    from triton_diffusion.engine.executor import CallReport

# A forward's denoiser rows and the tokens it computes (padding included), from its jobs: the adapter's
# (step_engine.py ``CountsComputed``: a family that pads rows of several sizes says what that costs), else
# :func:`rows_and_tokens`. What the token budget bounds and the cost fit prices.
Computed = Callable[[Sequence["Job"]], tuple[int, int]]


def rows_and_tokens(jobs: Sequence[Job]) -> tuple[int, int]:
    """A forward's size where the adapter says nothing of padding: a row per job, the jobs' own tokens."""
    return len(jobs), sum(job.spec.tokens for job in jobs)


def forward_group(jobs: Sequence[Job]) -> Hashable:
    """The group a forward of these jobs ran as: that of a job that keeps to its group, where one does
    (a job that also joins another group's forwards steps in them: ``also_joins``, engine/scheduler.py),
    else the first's. Its caps are the ones an out-of-memory lowers and a full forward re-proves."""
    return next((job.run.group for job in jobs if job.run.also_joins is None), jobs[0].run.group)


@dataclass(frozen=True)
class JobSpec:
    """What a model kind decides about one job when it parses a request: data the host hands to an engine
    as it is (:meth:`Job.of`)."""

    # What the adapter needs to start it (or the request-level engine's pipeline call): the model kind's,
    # opaque here (the adapter reads it as its own type).
    params: object
    index: int = 0  # which image of its request
    group: Hashable = None  # the request-level engine's compatibility key (the step engine sets its own)
    tier: int = 0
    deadline: float | None = None
    planned_steps: int = 1  # the denoising steps it will run (for estimates before it starts)
    shape: Hashable = None  # its latent (height, width[, frames]): the group it is expected to join
    tokens: int = 1  # denoiser tokens it adds to a forward (rows x latent tokens per row)
    cache_method: str = "none"
    preview_every: int = 0
    previews: int = 0
    # Where the host keeps this job's checkpoints (recovery/resumes.py), None: none are taken. The
    # engine takes one every ``checkpoint_every`` denoising steps (step_engine.py) and reports it.
    checkpoint_key: str | None = None
    # The checkpoint it starts from (the host's lookup under that key: serving/intake.py), None: from the
    # beginning. Opaque here: the adapter restores it (a checkpoint of another shape starts it over).
    resume: object = field(default=None, compare=False, repr=False)
    resumed_steps: int = 0  # the denoising steps that checkpoint did: what it leaves is what it costs
    # The num_inference_steps it may run under overload, what it asked first (engine/degradation.py);
    # empty: never fewer than it asked.
    steps_allowed: StepsAllowed = ()
    # The step cache it may be given for its steps left where its deadline needs it (its canonical text:
    # the adapter's to run; engine/degradation.py); None: never.
    degrade_cache: str | None = None


@dataclass
class Queue:
    """The scheduler's bookkeeping of a job's place and waits (scheduler.py, ordering.py)."""

    arrived: int = 0  # order of arrival at the engine
    queued_at: int = 0  # the engine step at which it joined the waiting queue
    admitted: int = 0  # order of admission to the running set (the policies' "oldest")
    waited_since: int = 0  # the engine step at which it last stepped (or was admitted)
    waited_s: float = 0.0  # seconds spent waiting or paused so far (aging), up to ``ready_at``
    # Since when it waits or is paused (None while it runs).
    ready_at: float | None = field(default_factory=time.perf_counter)
    paused_s: float = 0.0  # seconds spent paused
    pauses: int = 0  # times it was paused to make room for a higher tier
    cut: StepsCut | None = None  # fewer steps than asked (engine/degradation.py), decided before it starts
    # A step cache for its steps left (engine/degradation.py), once running; and whether the adapter
    # refused it one (then it is not decided again: the reason would not change).
    cache_given: CacheGiven | None = None
    cache_refused: bool = False


@dataclass
class Run:
    """Where a job is: the group it shares forwards with (and another it ``also_joins``: None, only its
    own), and its denoising steps once started (the adapter's count) and done."""

    group: Hashable = None
    also_joins: Hashable = None
    total_steps: int = 0
    steps_done: int = 0


@dataclass
class JobStats:
    """What happened to a job, for its request's BATCH output and the metrics."""

    first_forward: int | None = None  # the engine forward it first took part in
    forwards: int = 0  # forwards (or fused calls) it took part in
    packed_forwards: int = 0  # of them, forwards packed with jobs of other sizes
    most_shared: int = 0  # the most images it shared one forward with
    rows_computed: int = 0  # denoiser row-steps computed in full for this job
    rows_reused: int = 0  # denoiser row-steps served from its step cache
    calls: list[dict[str, int]] = field(default_factory=list)  # request-level: the fused calls it was in
    resumed_from_step: int | None = None  # the step a checkpoint let it start after (None: from the start)
    start_warning: str | None = None  # why a checkpoint it was given could not be used (it started over)


class Job:
    """One image (or video, or LM request) in an engine, in a few parts: ``request``, the host's request,
    which the engine reads as data (its id, when it entered); ``record``, the serving host's per-request
    bookkeeping, opaque to the engine; ``spec``, what the model kind decided when it parsed the request
    (:class:`JobSpec`: ``spec.params`` is what the adapter needs to start it); ``status``, the engine's
    record of its request (shared by the request's jobs once the engine holds them); ``queue``, the
    scheduler's bookkeeping; ``stats``, what happened to it; ``state``, the adapter's own (latents,
    scheduler, cache); and ``run``, where it is: its group (and the one it also joins) and its denoising
    steps (total and done). The scheduler's cut of its steps is ``queue.cut``. ``Job(request, params,
    record, **spec)`` takes the spec's other fields by name."""

    def __init__(self, request: Request, params: object, record: object = None, **spec: Any) -> None:
        self.request = request
        self.record = record
        self.spec = JobSpec(params, **spec)
        self.status = RequestStatus(request)  # its own until an engine's RequestTable attaches it
        self.queue = Queue()
        self.stats = JobStats()
        self.state: object = None  # the adapter's, opaque here (None: not started)
        self.run = Run(self.spec.group)  # its group is the spec's until it starts (the adapter's then)

    def __repr__(self) -> str:
        run = self.run
        return f"Job({self.request!r}, image {self.spec.index}, {run.steps_done}/{run.total_steps} steps)"

    @classmethod
    def of(cls, request: Request, spec: JobSpec, record: object = None) -> Job:
        """The job a spec describes, for ``request`` (the host's ``record`` kept opaque)."""
        job = cls(request, spec.params, record)
        job.spec, job.run.group = spec, spec.group
        return job

    @property
    def planned(self) -> int:
        """The denoising steps it will run: its adapter's count once started, else what it asked for (or
        the scheduler's cut of it)."""
        cut = self.queue.cut
        return self.run.total_steps or (cut.denoising if cut is not None else self.spec.planned_steps)

    @property
    def degraded(self) -> bool:
        """Run with less than its request asked: fewer steps, or a step cache (engine/degradation.py)."""
        return self.queue.cut is not None or self.queue.cache_given is not None

    @property
    def remaining(self) -> int:
        """Its denoising steps left: before it starts, those its checkpoint leaves (a cut starts it over)."""
        done = self.run.steps_done if self.run.total_steps or self.queue.cut else self.spec.resumed_steps
        return max(self.planned - done, 0)

    @property
    def steps_allowed(self) -> StepsAllowed:
        """The steps it may run (engine/degradation.py): its spec's, except where it resumes from a
        checkpoint: what it asked costs the steps left, and only fewer steps than those may cut it (a cut
        starts it over); none where no fewer are allowed."""
        allowed, resumed = self.spec.steps_allowed, self.spec.resumed_steps
        if not allowed or not resumed:
            return allowed
        (asked, denoising), fewer = allowed[0], allowed[1:]
        left = max(denoising - resumed, 0)
        fewer = tuple(option for option in fewer if option[1] < left)
        return ((asked, left), *fewer) if fewer else ()

    def preview_due(self, step: int) -> bool:
        """Whether the job's host wants a snapshot for a preview after denoising step ``step``."""
        every, previews = self.spec.preview_every, self.spec.previews
        if every and step % every == 0:
            return True
        total = self.run.total_steps
        if not previews or step >= total:
            return False
        # The k-th preview at the first step past (k + 1) / (previews + 1) of the steps.
        return any(step == -(-(k + 1) * total // (previews + 1)) for k in range(previews))

    def begin(self, start: JobStart) -> None:
        """Take what the adapter made of this job when it started it: a job resumed from a checkpoint has
        done its ``steps_done`` already."""
        self.state = start.state
        self.run = Run(start.group, start.also_joins, start.total_steps, start.steps_done)
        self.stats.resumed_from_step = start.steps_done or None
        self.stats.start_warning = start.warning

    # The writers of its counters, for either engine (the step engine's scheduler, the request-level
    # engine's calls): each counted in one place, so both engines' BATCH reads the same.
    def took_part(self, shared: int, forward: int | None = None, packed: bool = False) -> None:
        """A forward (a fused call, on the request-level engine) it took part in, with ``shared`` images:
        ``forward``, the engine's count of forwards (its first is kept); ``packed``, with other sizes."""
        stats = self.stats
        if forward is not None and stats.first_forward is None:
            stats.first_forward = forward
        stats.forwards += 1
        stats.most_shared = max(stats.most_shared, shared)
        stats.packed_forwards += int(packed)

    def ran_in(self, calls: list[dict[str, int]]) -> None:
        """The fused calls that made its image (the request-level engine's; its BATCH names them)."""
        self.stats.calls = calls

    def reached(self, step: int, total: int | None = None, computed: int = 0, reused: int = 0) -> None:
        """Its denoising steps done (``total``: a fused call's count, which the request-level engine
        learns from the pipeline); ``computed`` and ``reused``: the step's denoiser rows run in full and
        served from its step cache."""
        self.run.steps_done = step
        self.stats.rows_computed += computed
        self.stats.rows_reused += reused
        if total is not None:
            self.run.total_steps = total


def timeout_of(job: Job) -> str:
    """``timeout of 300 ms``: the job's deadline as its request's timeout."""
    assert job.spec.deadline is not None  # only jobs with a deadline expire or are refused
    return f"timeout of {(job.spec.deadline - job.request.entered) * 1000:.0f} ms"


@dataclass(frozen=True)
class JobStart:
    """What the adapter made of a job it started: its state, the group it can share forwards with and
    its denoising steps; ``steps_done``: those a checkpoint restored (it goes on from there), and
    ``warning``: why the checkpoint it was given was not used (it starts from the beginning).
    ``also_joins``: another group whose forwards it may step in too (a job whose group spans every size
    also joins its own size's, where jobs that keep to that size run: adapters/packed_rows.py); the jobs of
    one group all have one, or none do."""

    state: object  # the adapter's own (Job.state)
    group: Hashable
    total_steps: int
    steps_done: int = 0
    warning: str | None = None
    also_joins: Hashable = None


@dataclass(frozen=True)
class JobStep:
    """What one forward did for one job: the denoising step it completed (``step``, counted from 1) and
    whether that was its last; or ``error``, its own failure (it did not advance). ``rows_computed`` and
    ``rows_reused`` count its denoiser rows run in full and served from its step cache; ``snapshot`` is
    what the host needs of it now (a preview latent, a finished block) or None."""

    step: int
    done: bool = False
    error: Failure | None = None
    rows_computed: int = 1
    rows_reused: int = 0
    snapshot: object = None


@dataclass(frozen=True)
class ForwardResult:
    """One forward's outcome: a JobStep per job, in the order the jobs were given."""

    steps: list[JobStep]
    rows: int  # denoiser rows of the forward (images plus their unconditional rows)
    adapters: int = 0  # distinct LoRA adapters among its rows
    padded_tokens: int = 0  # tokens computed for no row: the padding of a packed forward (sizes mixed)


@dataclass(frozen=True)
class Stepped:
    """A job after one of its denoising steps, with the adapter's ``snapshot`` (or None) and its rows
    computed in full and served from its step cache in that forward."""

    job: Job
    step: int
    total: int
    snapshot: object = None  # the adapter's (a preview latent, a finished block), for the host
    rows_computed: int = 0
    rows_reused: int = 0


@dataclass(frozen=True)
class Finished:
    job: Job
    output: object  # the adapter's (or the pipeline call's) result for the job, for the host


@dataclass(frozen=True)
class Left:
    """A job left its engine: ``finished``, ``cancelled``, ``failed`` (``error`` says why; the engine
    decided it and the host delivers it), ``expired`` (its deadline passed), ``refused`` (its deadline
    could not be met) or ``ended`` (its request was answered elsewhere, e.g. a sibling image failed)."""

    job: Job
    reason: str
    error: RequestError | None = None


@dataclass(frozen=True)
class Packing:
    """The packing gate's decision for a forward whose jobs are of several sizes: packed or by size, with
    the fit's prices of both (None before it has one: then it packs)."""

    packed: bool
    packed_s: float | None = None
    by_size_s: float | None = None


@dataclass(frozen=True)
class Forward:
    """One forward of the step engine (or one fused pipeline call of the request-level engine)."""

    images: int
    rows: int  # images plus their unconditional rows
    seconds: float  # what the host waited for it (on a GPU at least its launch); device seconds: ``span``
    adapters: int = 0  # distinct LoRA adapters among its rows
    rows_reused: int = 0  # rows served from step caches
    tokens: int = 0  # its jobs' tokens (the sum of their ``tokens``)
    padded_tokens: int = 0  # padding the adapter added to pack rows of different lengths (ForwardResult)
    packing: Packing | None = None  # the packing gate's decision where its jobs were of several sizes
    narrowed: int = 0  # jobs of its group left out for a deadline (config narrow_forwards)
    span: int = 0  # its number in the stopwatch's spans: its device seconds come as StepReport.timed


@dataclass
class StepReport:
    """What one engine step did, in the order it happened within each list."""

    admitted: list[Job] = field(default_factory=list)
    stepped: list[Stepped] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    paused: list[Job] = field(default_factory=list)
    forwards: list[Forward] = field(default_factory=list)
    # Forwards' device seconds by span (Forward.span), as the stopwatch recorded them in this step: on a
    # CPU this step's own forwards; on a GPU those the device has passed (a step or more late: an idle
    # engine does not step, so the last forwards' come with the next step).
    timed: list[tuple[int, float]] = field(default_factory=list)
    calls: list[CallReport] = field(default_factory=list)  # request-level: each fused call as run
    cuts: list[str] = field(default_factory=list)  # request-level: why planned calls were cut short
    # Jobs' checkpoints taken after this step's forward (the adapter's, CPU copies), for the host to store.
    checkpoints: list[tuple[Job, object]] = field(default_factory=list)
    running: int = 0  # jobs in the running set after the step
    paused_now: int = 0  # jobs paused after the step


@dataclass
class SchedulerOutput:
    """One engine step's decisions before its forward."""

    admit: list[Job] = field(default_factory=list)  # start these (the adapter), then they run
    resume: list[Job] = field(default_factory=list)  # paused jobs back in the running set
    pause: list[Job] = field(default_factory=list)  # running jobs paused for a higher tier
    leave: list[Left] = field(default_factory=list)  # ended, refused or expired: out of every queue
    cache: list[Job] = field(default_factory=list)  # running jobs given their step cache (the adapter's)


@dataclass
class ForwardOutcome:
    """One forward's results as applied (:meth:`Scheduler.update`): what to report and what follows."""

    stepped: list[Stepped] = field(default_factory=list)
    done: list[Job] = field(default_factory=list)  # took their last step: decode them
    failed: list[tuple[Job, RequestError]] = field(default_factory=list)  # their own step failed
    rows_reused: int = 0
