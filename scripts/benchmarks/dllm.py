"""Benchmark: the diffusion LM with step-level continuous batching against one-request-at-a-time serving.

Both variants are the same model, weights and engine in the real server; only the running set differs:
  continuous     max_running 8 (the shipped config): requests share one forward per step
  one_at_a_time  max_running 1, waiting_room 0: a request runs alone; the rest wait in Triton's queue

Each concurrency level is a closed loop: every client sends its next request when the last one finished.
Reports tokens/s, requests/s, mean/p95 latency and time to first block; writes dllm_bench.json,
dllm_bench.md and dllm_bench.png to --out.

    .venv/bin/python scripts/bench.py dllm --param intra_op_threads=1
    .venv/bin/python scripts/bench_dllm.py --param intra_op_threads=1   # the same
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import artefacts
from triton_diffusion_client import TextResult, TextSession

from benchmarks.common import (
    PROMPTS,
    REPO_ROOT,
    benchmark_parser,
    machine_description,
    mean,
    metric_delta,
    percentile,
)
from benchmarks.reports import write_plot
from triton_diffusion.serving.server_process import WEIGHTS, copy_model, read_metrics, start_server
from triton_diffusion.tiny_models import build_missing

VARIANTS = {
    "continuous": {},
    "one_at_a_time": {"max_running": "1", "waiting_room": "0"},
}


@dataclass
class DllmStats:
    variant: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    tokens_per_s: float
    requests_per_s: float
    latency_mean_s: float
    latency_p95_s: float
    first_block_mean_s: float
    first_block_p95_s: float
    rows_per_forward: float  # from the server's metrics
    step_ms: float  # mean engine step (shared forward and commits), from the server's metrics


def make_requests(count: int, seed: int, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        gen_length = rng.choice(args.gen_lengths)
        requests.append(
            {
                "prompt": rng.choice(PROMPTS),
                "gen_length": gen_length,
                "block_length": args.block_length,
                "steps": gen_length // args.tokens_per_step,
                "temperature": args.temperature,
                "seed": seed * 1000 + i,
            }
        )
    return requests


def drive(url: str, model: str, concurrency: int, per_client: int, args: argparse.Namespace):
    results: list[TextResult] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        with TextSession(url, model) as session:
            for request in make_requests(per_client, index + 1, args):
                result = session.generate(request, f"c{index}")
                with lock:
                    results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def run_variant(server, model: str, variant: str, args: argparse.Namespace) -> list[DllmStats]:
    out = []
    # Warm up: the first forwards of a fresh process are slow.
    drive(server.grpc_url, model, 2, 2, args)
    for concurrency in args.concurrency:
        before = read_metrics(server)
        results, duration = drive(server.grpc_url, model, concurrency, args.requests_per_client, args)
        after = read_metrics(server)
        ok = [r for r in results if r.ok]
        latencies = [r.latency_s for r in ok]
        first_blocks = [r.first_block_s for r in ok if r.first_block_s is not None]
        rows = metric_delta(before, after, "triton_diffusion_lm_forward_rows_sum", model)
        forwards = metric_delta(before, after, "triton_diffusion_lm_forward_rows_count", model)
        step_seconds = metric_delta(before, after, "triton_diffusion_lm_step_seconds_sum", model)
        stats = DllmStats(
            variant=variant,
            concurrency=concurrency,
            requests=len(results),
            failed=len(results) - len(ok),
            duration_s=duration,
            tokens_per_s=sum(r.tokens for r in ok) / duration,
            requests_per_s=len(ok) / duration,
            latency_mean_s=mean(latencies),
            latency_p95_s=percentile(latencies, 0.95),
            first_block_mean_s=mean(first_blocks),
            first_block_p95_s=percentile(first_blocks, 0.95),
            rows_per_forward=rows / forwards if forwards else float("nan"),
            step_ms=1000 * step_seconds / forwards if forwards else float("nan"),
        )
        print(
            f"  {variant:14s} clients={concurrency}: {stats.tokens_per_s:7.1f} tokens/s, "
            f"latency mean {stats.latency_mean_s:.3f} s p95 {stats.latency_p95_s:.3f} s, "
            f"first block mean {stats.first_block_mean_s:.3f} s, rows/forward {stats.rows_per_forward:.2f}, "
            f"step {stats.step_ms:.1f} ms" + (f", {stats.failed} failed" if stats.failed else ""),
            flush=True,
        )
        out.append(stats)
    return out


class _Quiet:
    """Renders the engine's reports by only decoding each block (as the server does) and counting tokens;
    the channel its requests answer through drops what it is sent."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens = 0

    # ResponseChannel
    def send_partial(self, outputs) -> None:
        pass

    def send_final(self, outputs) -> None:
        pass

    def send_error(self, error) -> None:
        raise RuntimeError(f"benchmark request failed: {error}")

    def is_cancelled(self) -> bool:
        return False

    # what the engine host does with a StepReport
    def render(self, report) -> None:
        for stepped in report.stepped:
            if stepped.snapshot is not None:  # a block was completed
                self.tokenizer.decode(stepped.snapshot[0], skip_special_tokens=True)
        for finished in report.finished:
            self.tokens += len(finished.output.tokens())
            finished.job.request.finish({})


def engine_ceiling(args: argparse.Namespace, requests: int) -> dict[str, float]:
    """The engine in this process, no server or clients: ``requests`` requests at once against the same
    requests one after another. The ceiling the served figures approach."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from triton_diffusion.adapters.diffusion_lm_adapter import DecodingRequest, DiffusionLMAdapter
    from triton_diffusion.adapters.masked_diffusion import DecodeParams
    from triton_diffusion.adapters.masked_lm import MaskedLMForward, prompt_token_ids
    from triton_diffusion.engine.jobs import Job
    from triton_diffusion.engine.scheduler import EngineLimits
    from triton_diffusion.engine.step_engine import StepEngine
    from triton_diffusion.serving.requests import TrackedRequest

    threads = dict(item.split("=", 1) for item in args.param).get("intra_op_threads")
    if threads:
        torch.set_num_threads(int(threads))
    tokenizer = AutoTokenizer.from_pretrained(WEIGHTS / "tiny-dllm")
    forward = MaskedLMForward(AutoModelForMaskedLM.from_pretrained(WEIGHTS / "tiny-dllm").eval())
    specs = make_requests(requests, 99, args)

    def run(max_running: int) -> float:
        host = _Quiet(tokenizer)
        adapter = DiffusionLMAdapter(forward, tokenizer.pad_token_id, forward.padding_side)
        engine = StepEngine(adapter, EngineLimits(max_running, max_running))
        for i, spec in enumerate(specs):
            params = DecodeParams(
                spec["gen_length"], spec["block_length"], spec["steps"], temperature=spec["temperature"]
            )
            prompt = torch.tensor(prompt_token_ids(tokenizer, spec["prompt"], chat=True))
            decoding = DecodingRequest(
                prompt,
                params,
                torch.Generator().manual_seed(spec["seed"]),
                tokenizer.mask_token_id,
                (tokenizer.eos_token_id,),
            )
            engine.add(Job(TrackedRequest(str(i), host), decoding))
        started = time.perf_counter()
        with torch.inference_mode():
            while engine.active:
                host.render(engine.step())
        return host.tokens / (time.perf_counter() - started)

    run(requests)  # warm up
    return {"requests": requests, "together_tokens_per_s": run(requests), "alone_tokens_per_s": run(1)}


def markdown(report: dict) -> str:
    runs = [DllmStats(**r) for r in report["runs"]]
    lines = [
        f"Diffusion LM benchmark ({report['machine']}), requests: {report['workload']}",
        "",
        "| clients | variant | tokens/s | requests/s | latency mean (s) | latency p95 (s) "
        "| first block mean (s) | rows per forward | step (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: (r.concurrency, r.variant)):
        lines.append(
            f"| {r.concurrency} | {r.variant} | {r.tokens_per_s:.1f} | {r.requests_per_s:.2f} "
            f"| {r.latency_mean_s:.3f} | {r.latency_p95_s:.3f} | {r.first_block_mean_s:.3f} "
            f"| {r.rows_per_forward:.2f} | {r.step_ms:.1f} |"
        )
    lines.append("")
    ceiling = report.get("engine_ceiling")
    if ceiling:
        lines.append(
            f"- The engine alone, in process (no server, no clients): {ceiling['requests']} requests "
            "together "
            f"{ceiling['together_tokens_per_s']:.0f} tokens/s, one after another "
            f"{ceiling['alone_tokens_per_s']:.0f} tokens/s "
            f"({ceiling['together_tokens_per_s'] / ceiling['alone_tokens_per_s']:.2f}x)."
        )
    by = {(r.variant, r.concurrency): r for r in runs}
    for concurrency in sorted({r.concurrency for r in runs}):
        cont, solo = by.get(("continuous", concurrency)), by.get(("one_at_a_time", concurrency))
        if cont and solo:
            speedup = cont.tokens_per_s / solo.tokens_per_s
            lines.append(
                f"- {concurrency} clients: continuous batching gives {speedup:.2f}x "
                f"the tokens/s of one-at-a-time serving; p95 latency {cont.latency_p95_s:.3f} s against "
                f"{solo.latency_p95_s:.3f} s."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "dllm")
    parser.add_argument("--concurrency", default="1,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument(
        "--gen-lengths",
        default="64",
        type=lambda s: [int(x) for x in s.split(",")],
        help="each request picks one at random (e.g. 32,64,128 for mixed lengths)",
    )
    parser.add_argument("--block-length", type=int, default=16)
    # LLaDA's defaults: one token per step, greedy.
    parser.add_argument("--tokens-per-step", type=int, default=1, help="steps = gen_length / this")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: s.split(","))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config parameter for both variants, e.g. intra_op_threads=1",
    )
    args = parser.parse_args(argv)

    build_missing(WEIGHTS, only=["tiny-dllm"])
    workload = (
        f"gen_length {'/'.join(map(str, args.gen_lengths))}, block_length {args.block_length}, "
        f"steps = gen_length / {args.tokens_per_step}, temperature {args.temperature}, "
        f"{args.requests_per_client} requests per client"
    )
    print(f"workload: {workload}", flush=True)
    runs: list[DllmStats] = []
    for variant in args.variants:
        # One server per variant, so the other variant's process does not compete for the CPU.
        repo = Path(tempfile.mkdtemp(prefix=f"bench-dllm-{variant}-"))
        params = dict(item.split("=", 1) for item in args.param)
        params |= {"model": str(WEIGHTS / "tiny-dllm"), **VARIANTS[variant]}
        copy_model("diffusion_lm", repo, variant, params)
        server = start_server(repo, repo / "tritonserver.log", [variant])
        try:
            runs += run_variant(server, variant, variant, args)
        finally:
            server.stop()
    ceiling = engine_ceiling(args, max(args.concurrency))
    report = {
        "machine": machine_description(),
        "workload": workload,
        "runs": [asdict(r) for r in runs],
        "engine_ceiling": ceiling,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    artefacts.write(args.out / "dllm_bench.json", report)
    (args.out / "dllm_bench.md").write_text(markdown(report))
    write_plot(runs, args.out / "dllm_bench.png", "tokens_per_s", "tokens/s", "concurrent clients")
    print(markdown(report))
