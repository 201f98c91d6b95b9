"""The figure block of the mixed-sizes benchmark (scripts/bench.py mixed-sizes): packed forwards against
one shape per forward against the request-level engine, per family, traffic and load. A pure function of
the artefact's JSON (its ``summary``: medians over alternated rounds with min and max); the benchmark prints
the same text when it ends."""

from __future__ import annotations

import statistics
from typing import Any

from tables.markdown import number, percent, reading, table

HEADERS = (
    "family",
    "traffic",
    "load",
    "variant",
    "images/s",
    "/ by-shape (min-max)",
    "mean s",
    "p95 s",
    "forwards per step",
    "jobs per forward",
    "padded tokens",
    "gate: by size",
    "packed / plane",
)


def _median(cell: dict[str, Any] | None, digits: int = 3) -> str:
    return number(cell["median"], digits) if cell else "-"


def _ratio(cell: dict[str, Any] | None) -> str:
    if not cell:
        return "-"
    return f"**{cell['median']:.2f}** ({cell['min']:.2f}-{cell['max']:.2f})"


def _load(load: str, concurrency: int) -> str:
    if load == "closed":
        return f"closed, c={concurrency}"
    return f"Poisson {load.removeprefix('poisson')}%"


def target(artefact: dict[str, Any], family: str, traffic: str) -> str:
    """A family's target for a traffic (packed / by-shape closed-loop throughput): its own where the
    artefact records one, else the settings' (artefacts from before the targets were per family), else
    none."""
    own = artefact.get("families", {}).get(family, {}).get("targets")
    return (own or artefact["settings"]["targets"]).get(traffic, "")


def _verdicts(artefact: dict[str, Any]) -> list[list[str]]:
    """The targets: packed / by-shape closed-loop throughput, read by the one verdict rule
    (scripts/verdicts.py)."""
    rows = []
    for row in artefact["summary"]:
        ratio = row.get("throughput_vs_by_shape")
        if (
            row["variant"] not in ("packed", "packed-ungated")
            or row["load"] != "closed"
            or not ratio
            or not target(artefact, row["family"], row["traffic"])
        ):
            continue
        label = f"{row['family']} {row['traffic']}, closed loop: {row['variant']} / by-shape throughput"
        # The gate's targets are the served default's (packed); without it, a gain or a loss against 1.
        goal = target(artefact, row["family"], row["traffic"]) if row["variant"] == "packed" else ""
        rows.append(
            [
                label,
                f"**{number(ratio['median'])}**",
                goal,
                reading(ratio["median"], goal, ratio["rounds"]),
            ]
        )
    return rows + _gate_rows(artefact)


def _gate_rows(artefact: dict[str, Any]) -> list[list[str]]:
    """What the packing gate does to throughput: packed over packed-ungated in the same round (closed
    loop), per family and traffic, read against 1."""
    runs: dict[tuple[str, str], dict[str, dict[int, float]]] = {}
    for run in artefact.get("runs", []):
        if run.get("load") == "closed" and run["variant"] in ("packed", "packed-ungated"):
            cell = runs.setdefault((run["family"], run["traffic"]), {})
            cell.setdefault(run["variant"], {})[run["round"]] = run["images_per_s"]
    rows = []
    for (family, traffic), by_variant in runs.items():
        gated, ungated = by_variant.get("packed", {}), by_variant.get("packed-ungated", {})
        ratios = [gated[r] / ungated[r] for r in sorted(gated) if ungated.get(r)]
        if ratios:
            value = statistics.median(ratios)
            label = f"{family} {traffic}, closed loop: packed / packed-ungated throughput (the gate)"
            rows.append([label, f"**{number(value)}**", "", reading(value, "", ratios)])
    return rows


def _share(summary: dict[str, Any] | None) -> str:
    """A share's median over rounds, with the rounds' min-max where they differ."""
    if not summary:
        return "-"
    median = percent(summary["median"], 1)
    if summary["min"] == summary["max"]:
        return median
    return f"{median} ({percent(summary['min'], 1)}-{percent(summary['max'], 1)})"


def _orders(settings: dict[str, Any]) -> str:
    """How the variants took turns: orders balanced for what one run leaves to the next (a collection of
    the last run's garbage before each), or (older takes) rotated."""
    if settings.get("orders") == "balanced":
        return (
            "rounds in orders balanced for what one run leaves to the next (within the orders of each whole "
            "cycle, each variant after each other equally often; not at the joins between rounds; the "
            "garbage collected before each run)"
        )
    return "alternated rounds"


def render(artefact: dict[str, Any]) -> str:
    settings = artefact["settings"]
    sizes = ", ".join(settings["sizes"])
    loads = "/".join(f"{round(100 * load)}%" for load in settings["loads"])
    poisson = (
        f"Poisson at {loads} of the {settings['capacity_of']} variant's closed-loop images/s "
        f"({settings['poisson_requests']} requests a run, the first {percent(settings['warm_up_fraction'])} "
        "left out)"
        if loads
        else "no Poisson runs"
    )
    homogeneous = settings.get("traffic", {}).get("homogeneous") or list(settings["sizes"])[:1]
    variants = settings.get("variants") or ["packed", "by-shape", "request"]
    ungated = (
        " `packed-ungated`: packing with the packing gate off (every forward of several sizes packed)."
        if "packed-ungated" in variants
        else ""
    )
    device = f" on {settings['device']} in {settings['dtype']}" if "device" in settings else ""
    if settings.get("flux1_size"):
        device += ", FLUX.1's transformer at full size (random weights: speed only)"
    if settings.get("device_profile"):
        device += (
            f", under the device profile `{settings['device_profile']}` (tiny-flux's transformer waits an "
            "estimate of the time FLUX.1-dev's would take on an NVIDIA H100: each forward's arithmetic at "
            "the rate one measured forward ran; its VAE decode what SD 1.5's decoder took there for as many "
            "pixels; both compute nothing; adapters/device_profiles.py)"
        )
    parts = [
        f"Sizes (WxH) {sizes} drawn uniformly for `mixed`, {', '.join(homogeneous)} for `homogeneous`"
        f"{device}; "
        f"{settings['steps']} steps, "
        f"guidance {settings['guidance_scale']}, at most {settings['cap']} jobs a forward or images a call; "
        f"closed loop at {settings['concurrency']} clients ({settings['requests']} requests a run), "
        f"{poisson}. {settings['rounds']} {_orders(settings)} ({', '.join(variants)} in each): medians, "
        "ratios to the same round's by-shape run with their min-max over rounds. Forwards per step: the "
        "request-level engine's pipeline calls per engine step. Padded tokens: their share of the tokens "
        "the forwards computed (- where the forwards do not report tokens). Gate, by size: of the "
        "forwards whose jobs were of several sizes, the share the packing gate ran one size at a time "
        "(the median over rounds, with the rounds' min-max). Packed / plane: what the run's packed forwards "
        "took over the cost plane's price for their rows and tokens (the factor the gate prices a packed "
        "forward by; the median over rounds; - where none ran)." + ungated
    ]
    calibrated = [arch for arch, family in artefact["families"].items() if family.get("calibration")]
    if calibrated:
        parts.append(
            f"The packing gate priced from a calibration at load for {', '.join(calibrated)} "
            "(its forwards' seconds are in the artefact)."
        )
    without = [arch for arch, family in artefact["families"].items() if not family.get("packing_available")]
    if without:
        parts.append(
            f"**Not a measurement of packing for {', '.join(without)}:** the step adapter had no "
            "`packs_sizes` at this commit, so `packed` ran what `by-shape` runs."
        )
    pressures = [
        run["cpu_pressure"] for run in artefact.get("runs", []) if run.get("cpu_pressure") is not None
    ]
    if pressures:
        parts.append(
            f"CPU pressure (a task waiting for a core, Linux PSI) over the runs: median "
            f"{percent(sorted(pressures)[len(pressures) // 2])}, at most {percent(max(pressures))}; a run "
            "with other work on the cores can be many times slower (each run's figure is in the artefact)."
        )
    if not artefact.get("complete"):
        parts.append("**Incomplete:** the run was cut short; these are the runs it finished.")
    concurrency = settings["concurrency"]
    rows = [
        [
            row["family"],
            row["traffic"],
            _load(row["load"], concurrency),
            row["variant"],
            _median(row["images_per_s"]),
            "1" if row["variant"] == settings["baseline"] else _ratio(row.get("throughput_vs_by_shape")),
            _median(row["latency_mean_s"]),
            _median(row["latency_p95_s"]),
            _median(row["forwards_per_step"], 2),
            _median(row["jobs_per_forward"], 2),
            percent(row["padded_share"]["median"], 1) if row.get("tokens_reported") else "-",
            _share(row.get("by_size_share")),
            _median(row.get("packed_over_plane"), 2),
        ]
        for row in artefact["summary"]
    ]
    parts.append(table(HEADERS, rows))
    verdicts = _verdicts(artefact)
    if verdicts:
        parts.append(table(("ratio", "value", "target", "reading"), verdicts))
    return "\n\n".join(parts) + "\n"
