"""How long work takes, from the engine's own measurements: what deadlines are checked against.

The step engine times every forward (by its tokens: jobs of any size may share one), every start and
every decode. A forward's cost is a line in its tokens, ``a + b x tokens`` (a fixed part, then about
linear growth), fitted by least squares to the running average seconds of each token count measured. A
job's time to finish is the forwards it still needs, each priced by the tokens it holds, plus a start and
a decode; the work queued ahead of it (jobs that go first) adds forwards where it does not fit beside it.
Before anything was measured there is no estimate, and nothing is refused for it.

What one forward costs against another (the packing gate: scheduler.py) is priced by a second fit in two
variables, ``a + b x tokens + c x rows``: the rows carry what the tokens do not (each row's text tokens,
its conditioning). It is fitted by least squares to the distinct (rows, tokens) pairs measured in
forwards of one size, each the running average of its forwards (the latest ``MAX_SIZES`` pairs, and a
calibration's at load: models/calibration.py), and gives no price until the pairs determine it (three,
not on one line). A packed forward (jobs of several sizes on a padded grid, each row's attention masked
to its own tokens) may cost more than its rows and tokens say (a masked attention can take another
path): it is priced by the same plane times the mean of what the packed forwards measured (the running
average of each (rows, tokens) pair, its first forward left out: a new grid's warm-up) over the plane's
price for them now (1 until one was measured), so packed forwards never bend the plane that prices the
forwards by size they are weighed against. Where that sends every forward of mixed sizes by size, no
packed forward would ever be measured again: the gate packs one after ``PACK_PROBE_AFTER`` forwards of
one size (forward_choice.py), so a factor measured slow once (a disturbance) is measured again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Weight of the newest measurement in the running averages.
SMOOTHING = 0.2
# Token counts kept for the fit (the least recently measured is dropped): a served model sees few sizes,
# and a bounded table keeps the fit cheap and following what runs now.
MAX_SIZES = 64
# Refusals on an idle engine with no forward measured in between, after which the next newcomer the
# estimate would refuse there runs instead (:meth:`WorkTimes.probe`).
PROBE_AFTER = 8


@dataclass
class WorkTimes:
    """Running averages: forward seconds by the tokens in it (over every group: a forward's cost is what
    its tokens are, whatever their shapes), start and decode seconds per job."""

    by_tokens: dict[int, float] = field(default_factory=dict)  # least recently measured first
    by_rows_tokens: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, tokens): seconds
    # A calibration's at load (rows, tokens): seconds, kept whatever the traffic (which overrides a pair
    # it measures itself): all-packed traffic alone never determines the plane.
    calibration: dict[tuple[int, int], float] = field(default_factory=dict)
    start_s: float | None = None  # per job started
    finish_s: float | None = None  # per job decoded
    spent_s: float = (
        0.0  # all the seconds spent starting and decoding jobs (engine/overload.py leaves them out)
    )
    # The line through ``by_tokens`` (fixed, per token), fitted once per change: the scheduler prices
    # every held job at every engine step, and a fit over up to MAX_SIZES points each time adds up.
    _line: tuple[float, float] | None = field(default=None, repr=False)
    # Packed forwards' running average seconds by (rows, tokens), the first of each pair left out (a new
    # grid's warm-up: ``_packed_seen``), and the forwards of one size measured since the last of them.
    packed_by_rows_tokens: dict[tuple[int, int], float] = field(default_factory=dict)
    _packed_seen: set[tuple[int, int]] = field(default_factory=set, repr=False)
    since_packed: int = 0
    _idle_refusals: int = field(default=0, repr=False)  # since the last forward measured (probe)

    def forward_ran(
        self, jobs: int, tokens: int, seconds: float, rows: int | None = None, packed: bool = False
    ) -> None:
        """A forward of ``jobs`` jobs, ``rows`` denoiser rows (None: unknown) and ``tokens`` tokens (padding
        included) took ``seconds``; ``packed``: its jobs were of several sizes, packed."""
        tokens = max(tokens, 1)
        _remember(self.by_tokens, tokens, seconds)
        self._line, self._idle_refusals = None, 0
        if rows is None:
            return
        if not packed:
            _remember(self.by_rows_tokens, (rows, tokens), seconds)
            self.since_packed += 1
            return
        self.since_packed = 0
        key = (rows, tokens)
        if key not in self._packed_seen and len(self._packed_seen) < 16 * MAX_SIZES:
            self._packed_seen.add(key)  # its first: a new grid's warm-up (bounded: past it, counted)
            return
        _remember(self.packed_by_rows_tokens, key, seconds)

    @property
    def packed_factor(self) -> float | None:
        """What packed forwards measured over the plane's price for them now, their mean (None until one
        was measured past its pair's first, or while the plane gives no price)."""
        fit = _plane({**self.calibration, **self.by_rows_tokens})
        if fit is None:
            return None
        ratios = []
        for (rows, tokens), seconds in list(self.packed_by_rows_tokens.items()):
            price = _priced(fit, rows, tokens)
            if price:
                ratios.append(seconds / price)
        return sum(ratios) / len(ratios) if ratios else None

    def probe(self) -> bool:
        """Asked where the estimate would refuse a newcomer on an idle engine: whether to drop it instead
        (the ``PROBE_AFTER`` + 1-th such refusal with no forward measured in between), so that newcomer
        runs and the estimate is learned again from its forwards on. A refusal there rests on the estimate
        alone, and an estimate that refuses everything is never measured again: times measured slow for a
        while (contention, a disturbance) and kept for sizes no longer run would refuse every request for
        ever, and a probe's own forwards refresh only its size. Dropped, nothing is refused until a forward
        is measured (as at load); where the estimate was right, the probe's deadline still ends it."""
        self._idle_refusals += 1
        if self._idle_refusals <= PROBE_AFTER:
            return False
        self.by_tokens.clear()
        self._line, self._idle_refusals, self.start_s, self.finish_s = None, 0, None, None
        return True

    def calibrated(self, rows: int, tokens: int, seconds: float) -> None:
        """A calibration's forward at load (models/calibration.py): it prices forwards against each other
        (``forward_cost``) and nothing else; deadlines wait for the traffic's own."""
        self.calibration[rows, max(tokens, 1)] = seconds

    def forward_cost(self, rows: int, tokens: int, packed: bool = False) -> float | None:
        """Seconds of a forward of ``rows`` rows and ``tokens`` tokens by the two-variable fit (``packed``:
        times what packed forwards measured over it), or None where the pairs measured do not determine it
        (fewer than three, or all on one line)."""
        fit = _plane({**self.calibration, **self.by_rows_tokens})
        if fit is None:
            return None
        seconds = _priced(fit, rows, tokens)
        return seconds * (self.packed_factor or 1.0) if packed else seconds

    def started(self, jobs: int, seconds: float) -> None:
        self.spent_s += seconds
        if jobs:
            self.start_s = _blend(self.start_s, seconds / jobs)

    def finished(self, jobs: int, seconds: float) -> None:
        self.spent_s += seconds
        if jobs:
            self.finish_s = _blend(self.finish_s, seconds / jobs)

    @property
    def fixed_s(self) -> float:
        """A job's start and decode, the work no cut of its steps saves (0 where not measured)."""
        return (self.start_s or 0.0) + (self.finish_s or 0.0)

    @property
    def measured(self) -> bool:
        return bool(self.by_tokens)

    def describe(self) -> dict[str, Any]:
        """The cost model as it stands, in milliseconds (MODEL_INFO ``cost_model``, and the metrics): the
        line by tokens that deadlines and the drain price a forward by (None until two token counts were
        measured; with one, forwards are priced in proportion to it), the plane by tokens and rows that
        the packing gate prices by (None until the pairs measured determine it) and what a packed forward
        measured over it (None until one was), a start and a decode per
        job, and how many points each rests on (token counts and (rows, tokens) pairs measured by the
        traffic, pairs from the calibration at load)."""
        by_tokens = dict(self.by_tokens)  # copies: the engine thread adds to these while this reads them
        plane = _plane({**self.calibration, **self.by_rows_tokens})
        line = None
        if len(by_tokens) >= 2:
            fixed, slope = _line(by_tokens)
            line = {"fixed_ms": fixed * 1e3, "per_1k_tokens_ms": slope * 1e6}
        return {
            "forward_by_tokens": line,
            "forward_by_tokens_and_rows": None
            if plane is None
            else {
                "fixed_ms": plane[0] * 1e3,
                "per_1k_tokens_ms": plane[1] * 1e6,
                "per_row_ms": plane[2] * 1e3,
            },
            "packed_over_plane": self.packed_factor,
            "start_ms": None if self.start_s is None else self.start_s * 1e3,
            "decode_ms": None if self.finish_s is None else self.finish_s * 1e3,
            "token_counts_measured": len(by_tokens),
            "pairs_measured": len(self.by_rows_tokens),
            "pairs_calibrated": len(self.calibration),
        }

    def forward_s(self, tokens: int) -> float:
        """Seconds of a forward of ``tokens`` tokens: the least-squares line over the token counts measured,
        never below 0. With one count measured, proportional above it and the same below (no slope is
        known); a falling fit (noise) is flat at the mean; a fit with a negative fixed part is taken
        through the origin (a small forward costs its share, never nothing). Before any measurement 0."""
        points = self.by_tokens
        tokens = max(tokens, 1)
        if not points:
            return 0.0
        if len(points) == 1:
            ((size, seconds),) = points.items()
            return seconds * max(tokens / size, 1.0)
        if self._line is None:
            self._line = _line(points)
        fixed, slope = self._line
        return max(fixed + slope * tokens, 0.0)

    def finish_in(
        self,
        job_tokens: int,
        steps: int,
        ahead_token_steps: int,
        token_budget: int,
        started: bool,
        alongside_tokens: int = 0,
    ) -> float:
        """Seconds until a job of ``job_tokens`` tokens with ``steps`` denoising steps to go is done, when
        ``ahead_token_steps`` token-steps of work go before it and a forward holds ``token_budget`` tokens:
        the forwards it needs (its own steps, or the whole work shared out a budget at a time, whichever is
        more), each holding the work shared out over them, and at least its own tokens and the
        ``alongside_tokens`` of jobs after it that share its forwards (within the budget: a job larger
        than the budget runs alone), plus its start (unless ``started``) and its decode."""
        job_tokens = max(job_tokens, 1)
        budget = max(token_budget, job_tokens)  # one larger than the budget runs alone: a forward its size
        work = ahead_token_steps + job_tokens * steps
        forwards = max(steps, math.ceil(work / budget))
        least = min(budget, job_tokens + max(alongside_tokens, 0))
        size = max(least, math.ceil(work / max(forwards, 1)))
        seconds = forwards * self.forward_s(size)
        if not started:
            seconds += self.start_s or 0.0
        return seconds + (self.finish_s or 0.0)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """The least-squares line ``(fixed, slope)`` through two or more ``tokens: seconds`` points: flat at
    the mean where it falls (noise), through the origin where its fixed part is negative."""
    n = len(points)
    mean_t = sum(points) / n
    mean_s = sum(points.values()) / n
    spread = sum((t - mean_t) ** 2 for t in points)
    slope = sum((t - mean_t) * (s - mean_s) for t, s in points.items()) / spread
    if slope <= 0:
        return mean_s, 0.0
    fixed = mean_s - slope * mean_t
    if fixed < 0:
        return 0.0, sum(t * s for t, s in points.items()) / sum(t * t for t in points)
    return fixed, slope


def _priced(fit: tuple[float, float, float], rows: int, tokens: int) -> float:
    """A forward's seconds by the plane ``fit`` (fixed, per token, per row), never below 0."""
    fixed, per_token, per_row = fit
    return max(fixed + per_token * tokens + per_row * rows, 0.0)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def _remember(table: dict, key: object, seconds: float) -> None:
    """Blend ``seconds`` into ``table[key]``, the key moved last (the most recently measured); the least
    recently measured key goes past ``MAX_SIZES``."""
    old = table.pop(key, None)
    table[key] = _blend(old, seconds)
    if len(table) > MAX_SIZES:
        del table[next(iter(table))]


def _plane(points: dict[tuple[int, int], float]) -> tuple[float, float, float] | None:
    """Least squares ``s = a + b t + c r`` over ``(r, t): s``, as ``(a, b, c)``; None with fewer than three
    points or where they lie on one line (the normal equations' determinant is nothing next to its
    terms)."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_r = sum(r for r, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    mean_s = sum(points.values()) / n
    # Centred sums: the 2x2 normal equations for (b, c), then a from the means.
    stt = sum((t - mean_t) ** 2 for _, t in points)
    srr = sum((r - mean_r) ** 2 for r, _ in points)
    srt = sum((r - mean_r) * (t - mean_t) for r, t in points)
    sts = sum((t - mean_t) * (s - mean_s) for (_, t), s in points.items())
    srs = sum((r - mean_r) * (s - mean_s) for (r, _), s in points.items())
    determinant = stt * srr - srt * srt
    if stt <= 0 or srr <= 0 or determinant <= 1e-9 * stt * srr:
        return None
    per_token = (sts * srr - srs * srt) / determinant
    per_row = (srs * stt - sts * srt) / determinant
    return mean_s - per_token * mean_t - per_row * mean_r, per_token, per_row
