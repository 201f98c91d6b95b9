"""Service tiers and deadlines through the real server (``bench.py --slo`` runs this): slo.py's traffic
sent by the standalone client over gRPC to one tritonserver holding three copies of the model.

  interactive  ``service_tier`` priority, --interactive-steps steps, ``timeout`` (the deadline, µs) =
               --deadline-scale x its latency alone through the server
  background   the default tier, --background-steps (a range) steps, no deadline

Variants on the same Poisson arrivals, at --loads of the request-level copy's capacity on the mix:
  tiers    the step engine; interactive requests send their tier and timeout
  oldest   the step engine; the same requests without tier or timeout (first come, first served)
  request  ``engine: request`` (fused calls in arrival order; it enforces neither tiers nor deadlines)

Latency runs from each request's scheduled arrival. The figures are slo_figures.py's (``class_report``):
every offered request counts, a refused, expired or failed one as a miss in attainment and goodput and
as infinitely late in the p95 over offered requests, beside the p95 over the answered ones only; plus
preemptions (from the server's metrics) and the steady-state check. --rounds rounds per load, the order of
the variants rotated from round to round; the artefact (``<out>/bench_slo_server.json``, written with
``scripts/artefacts.py`` after every measured run) keeps every round with slo_figures.py's ``summary`` and
``verdicts``; ``scripts/tables/slo.py`` (``render_server``) renders it.

    .venv/bin/python scripts/bench.py slo_server --requests 200 --loads 0.9,1.1,3.0
    .venv/bin/python scripts/bench.py --slo --slo-args "--requests 200 --loads 0.9,1.1,3.0" --out DIR
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from artefacts import provenance, write
from triton_diffusion_client import GenerateResult, generate_one

from benchmarks.arrivals import poisson_arrivals
from benchmarks.common import REPO_ROOT, benchmark_parser, metric_delta
from benchmarks.slo_figures import NOTES, Item, class_report, progress, summarize_rounds
from triton_diffusion.serving.server_process import copy_model, read_metrics, start_server
from triton_diffusion.tiny_models import build_missing

VARIANTS = ("tiers", "oldest", "request")
WARM_UP_FRACTION = 0.1


def request_of(index: int, steps: int, size: tuple[int, int]) -> dict:
    return {"prompt": f"a lighthouse at dusk {index}", "seed": index, "height": size[0], "width": size[1],
            "num_inference_steps": steps, "guidance_scale": 7.5}  # fmt: skip


def mix(count: int, share: float, steps: int, background: tuple[int, int], slo_s: float, size, seed: int):
    rng = random.Random(seed)
    return [
        Item(True, request_of(i, steps, size), slo_s)
        if rng.random() < share
        else Item(False, request_of(i, rng.randint(*background), size))
        for i in range(count)
    ]


def sent(item: Item, variant: str) -> dict:
    """What the client sends: the tier and deadline only where the variant uses them."""
    if variant != "tiers" or not item.interactive:
        return item.values
    return {**item.values, "service_tier": "priority", "timeout": int(item.slo_s * 1e6)}


def why_left(result: GenerateResult) -> str:
    message = result.error or ""
    if "cannot finish within" in message:
        return "refused"
    return "expired" if "passed after step" in message else "failed"


def run(url: str, model: str, items: list[Item], arrivals: list[float], variant: str) -> tuple[dict, int]:
    """Every item at its arrival (a thread each, charged its lateness); (spans, left, refusal seconds)."""
    results: list[GenerateResult | None] = [None] * len(items)
    late = [0.0] * len(items)
    started = time.perf_counter()

    def send(index: int) -> None:
        time.sleep(max(0.0, started + arrivals[index] - time.perf_counter()))
        late[index] = time.perf_counter() - (started + arrivals[index])
        results[index] = generate_one(sent(items[index], variant), f"slo-{index}", url, model, 600.0)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    measured = list(range(int(len(items) * WARM_UP_FRACTION), len(items)))
    spans, left, refusals, ends = {}, {}, {}, []
    for i in measured:
        result = results[i]
        took = result.latency_s + late[i]
        ends.append(arrivals[i] + took)
        if result.ok:
            spans[i] = (arrivals[i], arrivals[i] + took)
        else:
            left[i] = why_left(result)
            if left[i] == "refused":
                refusals[i] = took
    window = max(ends) - min(arrivals[i] for i in measured) if measured else 0.0
    outcome = {"measured": measured, "spans": spans, "left": left, "refusals": refusals, "window": window}
    return outcome, sum(r is not None and not r.ok and why_left(r) == "failed" for r in results)


def alone_latency(url: str, model: str, steps: int, size, repeats: int = 5) -> float:
    times = [generate_one(request_of(50_000 + i, steps, size), f"alone-{i}", url, model).latency_s
             for i in range(repeats)]  # fmt: skip
    return statistics.median(times)


def capacity(url: str, model: str, items: list[Item], concurrency: int) -> float:
    """The request-level copy's throughput on the mix, closed loop at ``concurrency`` (requests/s)."""
    sample = [item.values for item in items[: 3 * concurrency]]
    pending = list(enumerate(sample))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index, values = pending.pop()
            generate_one(values, f"cap-{index}", url, model, 600.0)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(sample) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "slo_server")
    parser.add_argument("--arch", default="tiny-sd")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--cap", type=int, default=8, help="max_running and max_rows_per_call")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--loads", default="0.7,0.9,1.1")
    parser.add_argument("--interactive-share", type=float, default=0.5)
    parser.add_argument("--interactive-steps", type=int, default=4)
    parser.add_argument("--background-steps", default="16-30")
    parser.add_argument("--deadline-scale", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant and load, order rotated")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "slo_server")
    args = parser.parse_args(argv)
    weights = REPO_ROOT / "weights"
    build_missing(weights, only=[args.arch])
    size = (args.height, args.width)
    common = {"model": str(weights / args.arch), "max_rows_per_call": str(args.cap)}
    step = {**common, "engine": "step", "max_running": str(args.cap), "max_paused": str(args.cap)}
    configs = {"tiers": step, "oldest": step, "request": {**common, "engine": "request"}}
    with tempfile.TemporaryDirectory(prefix="bench-slo-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        for variant in VARIANTS:
            copy_model("text_to_image", repo, f"slo_{variant}", configs[variant])
        server = start_server(repo, Path(tmp) / "tritonserver.log", [f"slo_{v}" for v in VARIANTS])
        try:
            report = measure(server, args, size, args.out / "bench_slo_server.json")
        finally:
            server.stop()
    for label, text in report.get("verdicts", {}).items():
        print(f"{label}: {text}")
    return report


def measure(server, args: argparse.Namespace, size: tuple[int, int], path: Path) -> dict:
    url = server.grpc_url
    for variant in VARIANTS:  # warm: the step engines' estimates start from measured forwards
        for i in range(2):
            generate_one(request_of(60_000 + i, args.interactive_steps, size), "warm", url, f"slo_{variant}")
    alone = alone_latency(url, "slo_tiers", args.interactive_steps, size)
    slo_s = args.deadline_scale * alone
    background = tuple(int(x) for x in args.background_steps.split("-"))
    share = args.interactive_share
    items = mix(args.requests, share, args.interactive_steps, background, slo_s, size, args.seed)
    cap_rate = capacity(url, "slo_request", items, args.cap)
    print(f"alone {alone:.3f} s, request-level capacity {cap_rate:.2f} req/s", flush=True)
    report: dict = {
        "benchmark": "bench_slo_server",
        "config": {
            "arch": args.arch,
            "size": f"{args.width}x{args.height}",
            "cap": args.cap,
            "requests": args.requests,
            "interactive_steps": args.interactive_steps,
            "background_steps": args.background_steps,
            "interactive_share": share,
            "deadline_scale": args.deadline_scale,
            "rounds": args.rounds,
            "variants": list(VARIANTS),
            "warm_up_fraction": WARM_UP_FRACTION,
            "through": "tritonserver, gRPC, the project's client (one thread per request)",
        },
        "interactive_alone_s": alone,
        "deadline_s": slo_s,
        "capacity": cap_rate,
        "loads": [float(x) for x in args.loads.split(",")],
        "notes": [*NOTES, "Through the server: alone and capacity are measured through it; 'failed' counts "
                  "requests that ended with any other error (none expected)."],
        "rounds": [],
        "complete": False,
        "provenance": provenance(),
    }  # fmt: skip
    for load in report["loads"]:
        arrivals = poisson_arrivals(len(items), load * cap_rate, args.seed)
        for round_index in range(args.rounds):
            shift = round_index % len(VARIANTS)
            order = [*VARIANTS[shift:], *VARIANTS[:shift]]
            entry: dict = {"load": load, "round": round_index + 1, "order": order, "runs": {}}
            report["rounds"].append(entry)
            for variant in order:
                model = f"slo_{variant}"
                before = read_metrics(server)
                outcome, failed = run(url, model, items, arrivals, variant)
                after = read_metrics(server)
                result = class_report(
                    variant, items, outcome["measured"], outcome["spans"], outcome["left"],
                    outcome["refusals"], args.deadline_scale, outcome["window"], alone,
                )  # fmt: skip
                preempted = metric_delta(before, after, "triton_diffusion_preemptions_total", model)
                result["preemptions"] = int(preempted)
                result["failed_all_requests"] = failed  # the warm-up's included
                entry["runs"][variant] = result
                summarize_rounds(report)
                write(path, report)
                print(f"  {load} round {round_index + 1} {variant}: {progress(result)}", flush=True)
    report["complete"] = True  # every planned run measured
    write(path, report)
    return report
