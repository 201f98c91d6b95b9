"""What a step costs on one H100, what a part's work costs, and the plan: which parts fit in one call.

A part's budget is its GPU run's denoising forwards (at how many images each) times STEP_COSTS, plus the
seconds no step cost sets (start, weights, graph capture; an open loop's arrival times), times MARGIN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

MARGIN = 1.25  # a part's budget over its estimate


@dataclass(frozen=True)
class StepCost:
    """Seconds of one denoising forward of ``images`` images (both CFG rows where the model has them) on
    one H100 in bf16, and where the figure comes from."""

    images: int
    seconds: float
    source: str


STEP_COSTS: dict[str, tuple[StepCost, ...]] = {
    "sd15-512": (
        StepCost(
            1,
            0.037,
            "measured: docs/gpu/bench_engines_sd15.json (H100 80GB HBM3, torch 2.11, 2026-11-22, eager): "
            "diffusers' pipeline at batch 1 made 1.349 images/s at 20 steps, 0.741 s an image with the "
            "text encoding and decode folded in: 37 ms a step",
        ),
        StepCost(
            8,
            0.066,
            "measured: the same file's profile: 66.1 ms an engine step at 8 images (16 rows) a forward",
        ),
    ),
    "flux1-1024": (
        StepCost(
            1,
            0.254,
            "measured elsewhere (not yet here): FLUX.1-dev through diffusers' FluxPipeline in bf16 at "
            "1024x1024, 28 steps, batch 1, on one H100: 7.11 s an image, the mean of its runs "
            "(github.com/varadrane1707/BenchmarkFlux, README, 'H100 GPU Performance', row BF16), the text "
            "encoding and decode folded in: 254 ms a step. Its FLOPs (about 74.5 TFLOP a step: 4096 image "
            "+ 512 text tokens through 19 double + 38 single blocks 3072 wide; linear layers 59.4, "
            "attention 14.9) in that time are 293 TFLOP/s, 37% of the 798 TFLOP/s an 8192^3 bf16 matmul "
            "reached on the device tool's H100 (an estimate from FLOPs at 73% of it gave 128 ms, half "
            "this). One forward per step (guidance-distilled, no CFG); k images cost k times one "
            "(compute-bound)",
        ),
    ),
}


def step_seconds(model: str, images: int) -> float:
    """One forward of ``images`` images: linear between measured sizes, the smallest one's below them
    (launch-bound), in proportion to images above the largest (compute-bound)."""
    points = STEP_COSTS[model]
    if images >= points[-1].images:
        return points[-1].seconds * images / points[-1].images
    if images <= points[0].images:
        return points[0].seconds
    for low, high in zip(points, points[1:], strict=False):
        if images <= high.images:
            share = (images - low.images) / (high.images - low.images)
            return low.seconds + share * (high.seconds - low.seconds)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Work:
    """One piece of a part's GPU run: ``forwards`` denoising forwards of ``images`` images each, plus
    ``seconds`` that no step cost sets (starting, imports, building weights, capturing graphs; the arrival
    times of an open loop)."""

    what: str
    forwards: int = 0
    images: int = 1
    model: str = "sd15-512"
    seconds: float = 0.0

    def estimate(self) -> float:
        return self.seconds + (self.forwards * step_seconds(self.model, self.images) if self.forwards else 0)


def open_loop(what: str, requests: int, steps: float, load: float, batch: int, model: str = "sd15-512"):
    """Poisson arrivals at ``load`` of the saturated throughput (``batch`` images a forward): the run lasts
    until the last arrival (or, overloaded, until the work is done), plus the last request's own latency."""
    per_image = steps * step_seconds(model, batch) / batch
    span = max(requests * per_image / load, requests * per_image)
    return Work(what, seconds=span + steps * step_seconds(model, batch))


def estimate(work: list[Work]) -> float:
    return sum(piece.estimate() for piece in work)


# ---- the plan: which parts fit in this call ----------------------------------------------------------
class Planned(Protocol):
    name: str

    def budget(self) -> float: ...

    def missing(self) -> str | None: ...


@dataclass
class Plan:
    limit: float
    budgets: dict[str, float] = field(default_factory=dict)  # the parts planned, in running order
    left_out: dict[str, str] = field(default_factory=dict)  # the parts that do not fit, and why

    @property
    def total(self) -> float:
        return sum(self.budgets.values())

    def later(self, name: str) -> float:
        """The budgets of the planned parts after ``name``: what the part must leave them."""
        names = list(self.budgets)
        return sum(self.budgets[n] for n in names[names.index(name) + 1 :])

    def lines(self) -> list[str]:
        lines = [f"plan for one H100 within {self.limit:.0f} s (budget = estimate x {MARGIN}):"]
        lines += [f"  {name:18} {budget:4.0f} s" for name, budget in self.budgets.items()]
        lines.append(f"  {'total':18} {self.total:4.0f} s of {self.limit:.0f}")
        if self.left_out:
            lines.append(
                "left out of this call: "
                + "; ".join(f"{name} ({why})" for name, why in self.left_out.items())
                + f"; another call: --parts {','.join(self.left_out)}"
            )
        return lines


def make_plan(parts: list[Planned], chosen: list[str], limit: float) -> Plan:
    """The chosen, built parts in registry order, each that fits in what the earlier ones left."""
    plan = Plan(limit)
    for part in parts:
        if part.name not in chosen or part.missing():
            continue
        budget = part.budget()
        left = limit - plan.total
        if budget <= left:
            plan.budgets[part.name] = budget
        else:
            plan.left_out[part.name] = f"needs {budget:.0f} s, {left:.0f} s left"
    return plan
