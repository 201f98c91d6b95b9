"""Figure blocks of the engine benchmarks: bench.py (through the server), bench_engines.py (in process),
bench_graphs.py and bench_dllm.py. Pure functions of the artefacts' JSON."""

from __future__ import annotations

from typing import Any

from tables.markdown import number, ratio_rows, table

RATIO_HEADERS = ("ratio", "value", "target", "reading")


def ratio_table(artefact: dict[str, Any]) -> str:
    """The artefact's ``ratios`` ({label: [value, target]}), each read against its target from its rounds
    where the artefact keeps them (``ratio_rounds``: {label: [one value a round]}); a ratio without its
    rounds has no verdict."""
    rows = ratio_rows(artefact["ratios"], artefact.get("ratio_rounds") or ratio_rounds(artefact))
    return table(RATIO_HEADERS, rows)


def ratio_rounds(artefact: dict[str, Any]) -> dict[str, list[float]]:
    """Per-round throughput ratios ``a / b`` from the rounds' seconds the LoRA benchmark keeps for each
    variant (``results[name].round_seconds``, the same batches each round): b's seconds over a's."""
    results = artefact.get("results")
    if not isinstance(results, dict):
        return {}
    rounds = {}
    for label in artefact.get("ratios", {}):
        a, _, b = label.partition(" / ")
        first, second = results.get(a, {}).get("round_seconds"), results.get(b, {}).get("round_seconds")
        if first and second and len(first) == len(second):
            rounds[label] = [s / f for f, s in zip(first, second, strict=True)]
    return rounds


def _traffic(run: dict[str, Any]) -> str:
    if run.get("rate") is not None:
        return f"{run['traffic']} ({number(run['rate'])} req/s offered)"
    return f"{run['traffic']}, c={run['concurrency']}"


def _runs_table(runs: list[dict[str, Any]], variant_key: str, first: str) -> str:
    rows = []
    rounds = any(run.get("round") for run in runs)  # a take of several rounds names each run's
    for run in runs:
        delivered = number(run.get("images_per_s"))
        per_forward = run.get("mean_rows_per_call", run.get("rows_per_forward"))
        rows.append(
            [
                _traffic(run) + (f", round {run.get('round', 0)}" if rounds else ""),
                run[variant_key],
                delivered,
                number(run.get("latency_mean_s")),
                number(run.get("latency_p95_s")),
                number(run.get(first)),
                number(per_forward, 2),
                run.get("errors", 0),
            ]
        )
    headers = (
        "traffic",
        "engine",
        "images/s",
        "mean s",
        "p95 s",
        "first step s",
        "images per forward/call",
        "errors",
    )
    return table(headers, rows)


def server_ratios(artefact: dict[str, Any]) -> str:
    """bench.py: every run (the engines side by side) and the ratios."""
    runs = [r for r in artefact["runs"] if r.get("traffic") not in ("grpc", "openai", "http")]
    return "\n\n".join([_runs_table(runs, "variant", "first_progress_mean_s"), ratio_table(artefact)])


def in_process_ratios(artefact: dict[str, Any]) -> str:
    """bench_engines.py: every run, then the ratios and the step engine's profile at full occupancy."""
    parts = [_runs_table(artefact["runs"], "engine", "first_step_mean_s"), ratio_table(artefact)]
    profile = artefact.get("profile")
    if profile:
        rounds = len(artefact.get("profile_rounds") or [])
        which = (
            f"In the profile at the median of the engine's own share ({rounds} profiles, one a round; of "
            "the two middle ones, the higher), at full occupancy"
            if rounds > 1
            else "At full occupancy"
        )
        parts.append(
            f"{which} ({profile['rows_per_forward']} images per forward) a step took "
            f"{number(profile['step_ms'])} ms: the model forward {number(profile['model_forward_ms'])} ms, "
            f"the row math around it (guidance, scheduler steps) {number(profile['row_math_ms'])} ms and "
            f"the engine's bookkeeping {number(profile['own_ms'])} ms: together "
            f"{profile['own_share_of_step']:.1%} of the step (the ratio row's \"engine's own work\"); "
            "starting jobs (text encoding, each job's scheduler, noise) "
            f"{number(profile['admission_ms'])} ms and decoding {number(profile['decode_ms'])} ms a step "
            "besides."
        )
        raws, profiles = artefact.get("raw_profile_rounds") or [], artefact.get("profile_rounds") or []
        if profile in profiles and profiles.index(profile) < len(raws):
            raw = raws[profiles.index(profile)]
            parts.append(
                f"diffusers' own call for {raw['images_per_call']} images in the same round, timed in place: "
                f"{number(raw['step_ms'])} ms a denoising step, the denoiser {number(raw['denoiser_ms'])} ms "
                f"and the rest of its loop (guidance, the scheduler's step, bookkeeping) "
                f"{number(raw['loop_ms'])} ms; its start (inputs checked, text encoding, timesteps and step "
                f"arguments, starting latents) {number(raw['start_ms'])} ms and decoding "
                f"{number(raw['decode_ms'])} ms a step besides."
            )
    return "\n\n".join(parts)


def openai_front(artefact: dict[str, Any]) -> str:
    """bench.py --openai: the front against gRPC direct, each path's ratio read from its rounds where the
    artefact keeps them (an older take's two pooled rounds: no verdict)."""
    ratios = {k: v for k, v in artefact["ratios"].items() if "OpenAI" in k or "client's CPU" in k}
    return table(RATIO_HEADERS, ratio_rows(ratios, artefact.get("ratio_rounds")))


def graphs(artefact: dict[str, Any]) -> str:
    """bench_graphs.py: one forward's FLOPs and time per batch size; one request alone."""
    rows = []
    for forward in artefact["forward"]:
        tflops = forward["flops"] / forward["eager_s"] / 1e12
        captured = forward.get("captured_s")
        rows.append(
            [
                forward["images"],
                forward["model_rows"],
                number(forward["flops"] / 1e9),
                number(forward["eager_s"] * 1e3),
                number(captured * 1e3) if captured else "-",
                number(tflops, 2),
            ]
        )
    headers = ("images", "model rows", "GFLOP", "eager ms", "captured ms", "TFLOP/s eager")
    text = table(headers, rows)
    return (
        f"{text}\n\nOne request alone: the step engine {number(artefact['eager_alone_s'])} s, "
        f"`pipeline(...)` {number(artefact['pipeline_alone_s'])} s."
    )


def dllm(artefact: dict[str, Any]) -> str:
    """bench_dllm.py: continuous batching against one request at a time, and the engine's ceiling."""
    rows = [
        [
            run["variant"],
            run["concurrency"],
            number(run["tokens_per_s"]),
            number(run["latency_mean_s"]),
            number(run["latency_p95_s"]),
            number(run["first_block_mean_s"]),
            number(run["rows_per_forward"], 2),
            run["failed"],
        ]
        for run in artefact["runs"]
    ]
    headers = (
        "variant",
        "concurrency",
        "tokens/s",
        "mean s",
        "p95 s",
        "first block s",
        "rows per forward",
        "failed",
    )
    ceiling = artefact.get("engine_ceiling")
    text = f"Workload: {artefact['workload']}.\n\n{table(headers, rows)}"
    if ceiling:
        text += (
            f"\n\nThe engine alone ({ceiling['requests']} requests): "
            f"{number(ceiling['together_tokens_per_s'])} tokens/s together against "
            f"{number(ceiling['alone_tokens_per_s'])} one at a time."
        )
    return text
