"""The performance index's plots: PNGs drawn by matplotlib from the committed artefacts, written by
``scripts/figures.py`` beside the figure blocks and checked by ``figures.py --check``.

Each plot is a function of its artefacts that returns the series it draws (plain JSON data); the PNG
carries a digest of that data in its metadata, so ``--check`` fails when an artefact changed and the plot
was not drawn again, without comparing pixels (which differ between matplotlib and font versions).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from artefacts import REPO_ROOT, read
from tables.headline import checkpoint_rounds
from verdicts import median_interval

FOLDER = REPO_ROOT / "docs" / "performance" / "plots"
KEY = "figures-digest"


def _over_rounds(points: dict[float, list[float]]) -> dict[str, list[float]]:
    """Each x's rounds as their median and their lowest and highest, in x order."""
    xs = sorted(points)
    return {
        "x": xs,
        "median": [median(points[x]) for x in xs],
        "low": [min(points[x]) for x in xs],
        "high": [max(points[x]) for x in xs],
    }


def latency_vs_load(engines: dict[str, Any]) -> dict[str, Any]:
    """Mean and p95 latency against offered load (share of the request-level engine's capacity), each
    load's rounds as their median and range."""
    points: dict[str, dict[float, list[float]]] = {}
    for run in engines.get("runs", []):
        traffic = run.get("traffic", "")
        if not traffic.startswith("poisson") or run.get("engine") not in ("step", "request"):
            continue
        load = int(traffic.removeprefix("poisson"))
        for figure in ("mean", "p95"):
            points.setdefault(f"{run['engine']} {figure}", {}).setdefault(load, []).append(
                run[f"latency_{figure}_s"]
            )
    return {
        "kind": "lines",
        "x": "offered load, % of request-level capacity",
        "y": "latency, s (median over rounds; band: their range)",
        "title": f"{engines.get('arch')} {engines.get('size')}: latency against load",
        "series": {name: _over_rounds(by_load) for name, by_load in points.items()},
    }


def throughput_vs_concurrency(engines: dict[str, Any]) -> dict[str, Any]:
    """Images/s against closed-loop clients, both engines, each concurrency's rounds as their median and
    range."""
    points: dict[str, dict[float, list[float]]] = {}
    for run in engines.get("runs", []):
        if run.get("traffic") != "homogeneous" or run.get("engine") not in ("step", "request"):
            continue
        points.setdefault(run["engine"], {}).setdefault(run["concurrency"], []).append(run["images_per_s"])
    return {
        "kind": "lines",
        "x": "closed-loop clients",
        "y": "images/s (median over rounds; band: their range)",
        "title": f"{engines.get('arch')}: throughput against concurrency",
        "series": {name: _over_rounds(by_clients) for name, by_clients in points.items()},
    }


def gains(mixed: dict[str, Any], checkpoints: dict[str, Any], caches: dict[str, Any]) -> dict[str, Any]:
    """Each feature's ratio over rounds: median and 90% sign-test interval (none from fewer than 5)."""
    bars: list[dict[str, Any]] = []

    def add(label: str, rounds: list[float]) -> None:
        found = median_interval(rounds)
        bars.append(
            {
                "label": label,
                "median": median(rounds),
                "interval": list(found[:2]) if found else None,
                "rounds": len(rounds),
            }
        )

    for row in mixed.get("summary", []):
        ratio = row.get("throughput_vs_by_shape")
        if row.get("variant") == "packed" and row.get("load") == "closed" and ratio:
            add(f"packed / by shape, {row['family']} {row['traffic']}", ratio["rounds"])
    for variant, entry in ((caches.get("summary") or {}).get("closed") or {}).items():
        if variant != "none" and entry.get("vs_none"):
            add(f"step cache {variant} / none", [v for v in entry["vs_none"]["rounds"] if v is not None])
    for interval, rounds in checkpoint_rounds(checkpoints).items():
        add(f"checkpoints every {interval} / off (step time: above 1 is a cost)", rounds)
    return {
        "kind": "bars",
        "title": "each feature's ratio (above 1: faster, or for checkpoints a cost): median, 90% interval",
        "bars": bars,
    }


PLOTS: dict[str, tuple[tuple[str, ...], Callable[..., dict[str, Any]]]] = {
    "latency_vs_load": (("docs/cpu/bench_engines.json",), latency_vs_load),
    "throughput_vs_concurrency": (("docs/cpu/bench_engines.json",), throughput_vs_concurrency),
    "gains": (
        ("docs/cpu/mixed_sizes.json", "docs/cpu/checkpoint_cost.json", "docs/cpu/caches/bench_caches.json"),
        gains,
    ),
}


def digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def draw(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4))
    if data["kind"] == "lines":
        for name, line in sorted(data["series"].items()):
            style = "--" if name.endswith("p95") else "-"
            (drawn,) = axes.plot(line["x"], line["median"], marker="o", linestyle=style, label=name)
            axes.fill_between(line["x"], line["low"], line["high"], color=drawn.get_color(), alpha=0.15)
        axes.set_xlabel(data["x"])
        axes.set_ylabel(data["y"])
        axes.legend()
    else:
        bars = data["bars"]
        for i, bar in enumerate(bars):
            if bar["interval"]:
                low, high = bar["interval"]
                axes.plot([low, high], [i, i], color="tab:blue", linewidth=3)
            axes.plot([bar["median"]], [i], "o", color="black")
        axes.axvline(1.0, color="grey", linewidth=1)
        axes.set_yticks(range(len(bars)), [f"{b['label']} ({b['rounds']} rounds)" for b in bars], fontsize=7)
        axes.set_xlabel("ratio")
    axes.set_title(data["title"], fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90, metadata={KEY: digest(data), "Software": None})
    plt.close(figure)


def stamped(path: Path) -> str | None:
    """The digest a PNG was drawn with (None: missing or not ours)."""
    if not path.is_file():
        return None
    from PIL import Image

    with Image.open(path) as image:
        return image.text.get(KEY)  # type: ignore[attr-defined]


def write_all(check: bool) -> list[str]:
    """Draw every plot whose digest differs from its data's (``check``: draw nothing); the stale ones."""
    stale = []
    for name, (paths, build) in PLOTS.items():
        data = build(*[read(REPO_ROOT / p) for p in paths])
        path = FOLDER / f"{name}.png"
        if stamped(path) != digest(data):
            stale.append(str(path.relative_to(REPO_ROOT)))
            if not check:
                draw(data, path)
    return stale
