"""The benchmarks, one module each, and the one entry point that runs them: ``scripts/bench.py NAME [args]``.

Each benchmark (``BENCHMARKS``) is a module with ``main(argv)``, and imports only the shared modules, never
another benchmark:

    common       the prompts, traffic constants, statistics, target ratios, the machine line, the parser
    arrivals     Poisson arrival times and ``Traffic``, the true clock of the in-process runs
    reports      the markdown cells and ratio table a benchmark prints beside its JSON, and its plots
    inprocess    the served model in one process (``Bench``), ``Recorder``, ``Channel``, ``sync``,
                 ``full_size_flux1`` (FLUX.1's transformer at full size, for the GPU runs)
    engine_runs  the in-process engines benchmark's runs of each engine, stage clock and image mix
    servers      a real server per configuration (``ServerVariant``) and its gRPC / OpenAI-front clients
    slo_figures  the service-tier benchmarks' per-class figures, summary and verdicts

and ``scripts/artefacts.py`` (every artefact's provenance and atomic write, shared beyond the benchmarks).
Nothing in this package imports a benchmark module but this dispatcher, and it only by name
(``importlib``), so there is no import circle; ``tests/unit/test_benchmarks_package.py`` holds that.

The old scripts (``scripts/bench_engines.py`` and the others in ``script``) stay as shims that run their
benchmark here with the same arguments: the committed artefacts and the docs record those command lines.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str  # its module in this package, and bench.py's NAME
    script: str  # the old script under scripts/ that runs it (the shim; bench.py for server; "" for none)
    what: str


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("server", "bench.py", "the two image engines through the real server (the default)"),
        Benchmark("engines", "bench_engines.py", "the two image engines in one process (CPU or GPU)"),
        Benchmark("caches", "bench_caches.py", "step caches per request on the step engine, in process"),
        Benchmark("slo", "bench_slo.py", "service tiers and deadlines under mixed traffic, in process"),
        Benchmark("slo_server", "bench_slo_server.py", "service tiers and deadlines through the server"),
        Benchmark("graphs", "bench_graphs.py", "captured (CUDA graph) forwards against eager, FLOPs"),
        Benchmark("lora", "bench_lora.py", "per-request LoRA: mixed adapters vs none vs one batch each"),
        Benchmark("dllm", "bench_dllm.py", "the diffusion LM: continuous batching vs one at a time"),
        Benchmark("mixed_sizes", "", "mixed sizes: packed forwards vs one shape per forward vs request"),
        Benchmark("crash_soak", "", "a model's process killed every N s under load: checkpoints vs none"),
        Benchmark(
            "checkpoint_cost", "", "what checkpoints cost an engine step, at each interval against off"
        ),
        Benchmark("goodput", "", "degrading rows against refusing them under overload, through the server"),
        Benchmark("all", "", "every CPU benchmark, each sized to its share of one budget; then figures"),
    )
}
DEFAULT = "server"  # what bench.py ran before it took a NAME: a first argument that is no NAME runs it

USAGE = """usage: bench.py [NAME] [options]

Runs one benchmark of scripts/benchmarks/. `bench.py NAME --help` gives its options. Without a NAME (no
argument, or a first argument that is an option) it runs `server`, as bench.py always has, so
`bench.py --concurrency 1,4,16 --mixed` and `bench.py --slo --slo-args '...'` still work.

benchmarks:
{names}

Each one's old script runs it too, with the same arguments (the commands the artefacts record):
{scripts}
"""


def command(benchmark: Benchmark) -> str:
    """Its NAME on bench.py's command line: the module's name, with hyphens for a benchmark without an old
    script (``mixed-sizes``; the older ones keep the spelling their recorded commands use). Either
    spelling runs it (``resolve``)."""
    return benchmark.name if benchmark.script else benchmark.name.replace("_", "-")


def usage() -> str:
    names = "\n".join(f"  {command(b):11} {b.what}" for b in BENCHMARKS.values())
    scripts = "\n".join(
        f"  scripts/{b.script:20} = bench.py {b.name}"
        for b in BENCHMARKS.values()
        if b.script not in ("", "bench.py")
    )
    return USAGE.format(names=names, scripts=scripts)


def load(name: str):
    """The benchmark module ``name`` (imported only now: each pulls in torch or a server's client)."""
    return importlib.import_module(f"{__name__}.{name}")


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """Which benchmark ``bench.py`` runs for ``argv``, and its arguments: the NAME first, else the default.
    A benchmark's ``instead(argv)``, where it has one, may name another in its place (``engines
    --step-cache`` runs ``caches``, ``server --slo`` runs ``slo_server``: the old scripts' switches)."""
    if argv and argv[0].replace("-", "_") in BENCHMARKS:
        name, argv = argv[0].replace("-", "_"), argv[1:]
    else:
        name = DEFAULT
    switch = getattr(load(name), "instead", None)
    other = switch(argv) if switch is not None else None
    return other if other is not None else (name, argv)


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench.py``: run the benchmark ``argv`` names (see ``resolve``); 0 when it ends."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage().rstrip())
        return 0
    name, argv = resolve(argv)
    load(name).main(argv)
    return 0
