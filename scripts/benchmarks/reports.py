"""The markdown a benchmark prints and writes beside its JSON artefact (cells, the ratio table) and its
plots. The docs' figure blocks are rendered from the artefacts by ``scripts/figures.py`` and
``scripts/tables/``, not from these.

Nothing here imports torch; matplotlib only when a plot is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def load_cell(concurrency: int | None, rate: float | None) -> str:
    """A table's "concurrency / rate" cell: the closed loop's clients or the Poisson rate."""
    return str(concurrency) if rate is None else f"{rate:.2f}/s"


def number_cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def ratio_table(ratios: dict[str, tuple[float, str]]) -> list[str]:
    """Markdown lines of the ratio table: name, value, target."""
    lines = ["| ratio | value | target |", "|---|---|---|"]
    lines += [f"| {name} | {value:.3f} | {target} |" for name, (value, target) in ratios.items()]
    return lines


def write_plot(
    runs: list[Any],
    path: Path,
    throughput: str = "requests_per_s",
    throughput_label: str = "requests/s",
    xlabel: str = "concurrency",
) -> None:
    """Throughput and p95 latency against concurrency, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in dict.fromkeys(r.variant for r in runs):
        points = sorted(
            (r for r in runs if r.variant == variant and r.concurrency), key=lambda r: r.concurrency
        )
        xs = [r.concurrency for r in points]
        left.plot(xs, [getattr(r, throughput) for r in points], marker="o", label=variant)
        right.plot(xs, [r.latency_p95_s for r in points], marker="o", label=variant)
    left.set(xlabel=xlabel, ylabel=throughput_label, title="Throughput")
    right.set(xlabel=xlabel, ylabel="p95 latency (s)", title="p95 latency")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_heatmap(
    cells: dict[tuple[int, int], float], sizes: list[int], delays: list[int], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[cells[(size, delay)] for delay in delays] for size in sizes]
    fig, axis = plt.subplots(figsize=(6, 4))
    image = axis.imshow(grid, cmap="viridis", origin="lower")
    axis.set_xticks(range(len(delays)), [f"{d / 1000:g} ms" for d in delays])
    axis.set_yticks(range(len(sizes)), [str(s) for s in sizes])
    axis.set(xlabel="max_queue_delay", ylabel="images per fused call", title="Throughput (requests/s)")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            axis.text(j, i, f"{value:.1f}", ha="center", va="center", color="white")
    fig.colorbar(image)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
