"""The key figures of each part of ``scripts/gpu_checks.py``, read back from the files it wrote, for one
line of its summary. Each reader takes the part's folder and the run (for figures across parts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def request_saturation(folder: Path) -> float | None:
    path = folder / "bench_engines.json"
    return load_json(path).get("request_saturated_images_per_s") if path.is_file() else None


def cuda_graphs_figures(folder: Path, run: Any) -> str:
    report = load_json(folder / "bench_graphs.json")
    peak = report.get("peak_tflops")
    parts = []
    for row in report["forward"]:
        text = f"{row['images']} img {1000 * row['eager_s']:.1f} ms eager"
        if "captured_s" in row:
            text += f" / {1000 * row['captured_s']:.1f} captured ({row['eager_s'] / row['captured_s']:.2f}x)"
        parts.append(text)
    last = report["forward"][-1]
    best = min(last["eager_s"], last.get("captured_s", last["eager_s"]))
    rate = last["flops"] / best / 1e12
    parts.append(
        f"{rate:.1f} TFLOP/s at {last['images']} img" + (f" ({rate / peak:.1%} of peak)" if peak else "")
    )
    pipeline = report["pipeline_alone_s"]
    alone = report.get("captured_alone_s", report["eager_alone_s"])
    kind = "captured" if "captured_alone_s" in report else "eager"
    parts.append(f"one request: pipeline(...) / {kind} {pipeline / alone:.2f}x (target >= 2)")
    if "uint8_difference" in report:
        diff = report["uint8_difference"]
        parts.append(
            f"uint8 diff alone {diff['captured_alone_vs_eager_alone']}, "
            f"amid 7 {diff['captured_amid_7_vs_eager_alone']}"
        )
    return "; ".join(parts)


def engines_figures(folder: Path, run: Any) -> str:
    report = load_json(folder / "bench_engines.json")
    runs = report["runs"]
    top = max((r["concurrency"] for r in runs if r["traffic"] == "homogeneous"), default=None)

    def pick(engine: str, traffic: str, concurrency: int | None = None) -> dict | None:
        found = [
            r
            for r in runs
            if r["engine"] == engine and r["traffic"] == traffic and concurrency in (None, r["concurrency"])
        ]
        return found[-1] if found else None

    parts = [f"cuda_graphs {'on' if report.get('cuda_graphs') else 'off'}"]
    alone = pick("step", "homogeneous", 1)
    if alone:
        parts.append(f"c=1 step mean {alone['latency_mean_s']:.3f} s")
    step, request = pick("step", "homogeneous", top), pick("request", "homogeneous", top)
    if step and request:
        parts.append(f"c={top} {step['images_per_s']:.2f} img/s (request {request['images_per_s']:.2f})")
    wanted = ("mixed: step", "Poisson 80%: step / request mean", "Poisson 80%: step / request p95", "profile")
    for name, (value, _target) in report.get("ratios", {}).items():
        if name.startswith(wanted):
            parts.append(f"{name} {value:.2f}")
    for k, check in report.get("stopwatch_check", {}).items():  # what the cost model learns, checked
        parts.append(f"stopwatch / synced host clock, a forward of {k} img {check['ratio']:.3f}")
    other = run.folder("engines_graphs") / "bench_engines.json"
    if not report.get("cuda_graphs") and alone and other.is_file():
        captured = [r for r in load_json(other)["runs"] if r["engine"] == "step" and r["concurrency"] == 1]
        if captured:
            parts.append(
                f"c=1 eager / captured latency {alone['latency_mean_s'] / captured[-1]['latency_mean_s']:.2f}"
            )
    return "; ".join(parts)


def lora_figures(folder: Path, run: Any) -> str:
    (path,) = sorted(folder.glob("bench_lora.json")) or sorted(folder.glob("lora_*.json"))
    report = load_json(path)
    ratios = {
        name: value[0] if isinstance(value, list) else value for name, value in report["ratios"].items()
    }
    parts = [f"{name} {value:.2f}" for name, value in ratios.items() if name.startswith("mixed-4")]
    bound = report.get("exactness")
    if bound:
        parts.append(
            f"{bound['dtype']} bound {bound['largest_uint8_difference']} uint8 "
            f"(adapter moves the image {bound['adapter_moves_image_mean']:.1f})"
        )
    return "; ".join(parts)


def family_figures(folder: Path, run: Any) -> str:
    rows = load_json(folder / "family.json")["rows"]
    parts = []
    for dtype in dict.fromkeys(row["dtype"] for row in rows):
        of = [row for row in rows if row["dtype"] == dtype]
        measured = [row for row in of if "fused_vs_alone" in row]
        text = f"{dtype}: {len(measured)}/{len(of)} families"
        if measured:
            worst = max(measured, key=lambda row: row["fused_vs_alone"])
            text += f", fused vs alone <= {worst['fused_vs_alone']} ({worst['model']})"
            stepped = [row["step_engine_vs_pipeline"] for row in measured if "step_engine_vs_pipeline" in row]
            if stepped:
                text += f", step engine vs pipeline <= {max(stepped)}"
        parts.append(text)
    return "; ".join(parts)


def mixed_sizes_figures(folder: Path, run: Any) -> str:
    """Per traffic and load: packed's and request's throughput over by-shape's (closed loop), or their p95
    latency over by-shape's (Poisson), medians over rounds with the min-max."""
    report = load_json(folder / "mixed_sizes.json")
    parts = [f"{report['settings'].get('device', '?')} {report['settings'].get('dtype', '')}".strip()]
    for row in report["summary"]:
        if row["variant"] == report["settings"]["baseline"]:
            continue
        closed = row["load"] == "closed"
        ratio = row.get("throughput_vs_by_shape" if closed else "p95_vs_by_shape")
        if not ratio:
            continue
        figure = "img/s" if closed else "p95"
        parts.append(
            f"{row['traffic']} {row['load']} {row['variant']} / by-shape {figure} {ratio['median']:.2f} "
            f"({ratio['min']:.2f}-{ratio['max']:.2f})"
        )
    return "; ".join(parts)


def no_figures(folder: Path, run: Any) -> str:
    return "see its files"
