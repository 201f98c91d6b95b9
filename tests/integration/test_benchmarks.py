"""Smoke runs of the benchmark and perf_analyzer scripts: files are written and the numbers are sane
(not how fast they are: speed belongs in the benchmark's own report)."""

import csv
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from triton_diffusion.serving.launcher import REPO_ROOT

# The OpenAI front's paths in each of its 6 rounds (one whole cycle of balanced orders: within it each
# path runs after each other equally often): gRPC direct, the official client, http.client.
FRONT_ORDERS = [
    ("grpc", "openai", "http"),
    ("openai", "http", "grpc"),
    ("http", "grpc", "openai"),
    ("http", "openai", "grpc"),
    ("grpc", "http", "openai"),
    ("openai", "grpc", "http"),
]


def test_bench_writes_its_report(tmp_path):
    out = tmp_path / "bench"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "bench.py"),
            "--concurrency",
            "1,2",
            "--requests",
            "4",
            "--max-batch-size",
            "2",
            "--progress",
            "--mixed",
            "--poisson",
            "--poisson-requests",
            "10",
            "--rounds",
            "2",
            "--openai",
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text().startswith("Machine:")
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    # Two rounds, the servers in rotated order: every concurrency in the first, the top one after; each
    # Poisson load's rounds (arrivals of their own) in rotated order too.
    orders = (("request", "step"), ("step", "request"))
    poisson = [
        (engine, f"poisson{load}", None, round_)
        for load in (50, 80, 95)
        for round_, order in enumerate(orders)
        for engine in order
    ]
    assert [(r["variant"], r["traffic"], r["concurrency"], r["round"]) for r in report["runs"]] == [
        ("request", "homogeneous", 1, 0),
        ("request", "homogeneous", 2, 0),
        ("request", "mixed", 2, 0),
        ("step", "homogeneous", 1, 0),
        ("step", "homogeneous", 2, 0),
        ("step", "mixed", 2, 0),
        ("step", "homogeneous", 2, 1),
        ("step", "mixed", 2, 1),
        ("request", "homogeneous", 2, 1),
        ("request", "mixed", 2, 1),
        *poisson,
        # The OpenAI front's overhead: one server, gRPC direct, the official client and http.client, in
        # one whole cycle of balanced orders (more than the take's 2 rounds).
        *[("step", path, 2, round_) for round_, order in enumerate(FRONT_ORDERS) for path in order],
    ]
    for label in ("homogeneous c=2: step / request throughput", "Poisson 80%: step / request p95 latency"):
        assert len(report["ratio_rounds"][label]) == 2  # each read from its two rounds
    # Each Poisson round on arrivals of its own, the same for both servers.
    seeds = {
        (r["round"], r["variant"]): r["arrival_seed"] for r in report["runs"] if r["traffic"] == "poisson80"
    }
    assert seeds == {(0, "request"): 1, (0, "step"): 1, (1, "request"): 2, (1, "step"): 2}
    for run in report["runs"]:
        # Poisson: the first 10% of the 10 requests (an empty server filling up) are left out.
        count = 9 if run["traffic"].startswith("poisson") else 4
        assert run["errors"] == 0 and run["requests"] == count and run["images"] == count
        assert run["requests_per_s"] > 0 and 0 < run["latency_p50_s"] <= run["latency_p99_s"]
        if run["traffic"] not in ("grpc", "openai", "http"):  # those send no progress
            assert 0 < run["first_progress_mean_s"] <= run["latency_mean_s"]
        assert run["peak_memory_mb"] > 50
        assert 1 <= run["mean_rows_per_call"] <= 2
    assert [r["batch"] for r in report["raw"]] == [1, 2]
    assert all(r["images_per_s"] > 0 for r in report["raw"])
    assert "homogeneous c=2: step / request throughput" in report["ratios"]
    assert any(name.startswith("mixed") for name in report["ratios"])
    for traffic, label in (("openai", "the official openai client"), ("http", "http.client")):
        name = f"OpenAI front ({label}) / gRPC direct throughput, step engine, c=2"
        # Read from its rounds: each the path's run over gRPC direct's in the same round.
        direct = {run["round"]: run for run in report["runs"] if run["traffic"] == "grpc"}
        runs = [run for run in report["runs"] if run["traffic"] == traffic]
        each = [run["images_per_s"] / direct[run["round"]]["images_per_s"] for run in runs]
        assert report["ratio_rounds"][name] == pytest.approx(each) and len(each) == 6
        assert report["ratios"][name][0] == pytest.approx(statistics.median(each))
        # The front's CPU per request over the server's: the median of the path's own runs.
        shares = [run["cpu_ms_per_request"]["front"] / run["cpu_ms_per_request"]["server"] for run in runs]
        ratio = report["ratios"][f"OpenAI front's own CPU / the server's, per request ({label})"][0]
        assert ratio == pytest.approx(statistics.median(shares))
    # CPU per request of the front, the server and the client, on every path. CPU time comes in clock
    # ticks of 10 ms, and 4 requests of the front (about 1.5 ms each) or of a light client may take less
    # than one: counted over the runs, each part is seen.
    paths = report["runs"][-18:]
    assert all(run["cpu_ms_per_request"]["server"] > 0 for run in paths)
    # The front works for the requests that go through it: more of its CPU than on gRPC direct (idle).
    through = sum(run["cpu_ms_per_request"]["front"] for run in paths if run["traffic"] != "grpc")
    assert through > sum(run["cpu_ms_per_request"]["front"] for run in paths if run["traffic"] == "grpc")
    assert sum(run["cpu_ms_per_request"]["client"] for run in paths) > 0
    assert sum(run["cpu_ms_per_request"]["front"] for run in paths if run["traffic"] != "grpc") > 0


def test_the_engine_benchmark_runs_both_engines_and_profiles_the_step_engine(tmp_path):
    out = tmp_path / "engines"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "bench_engines.py"),
            "--concurrency",
            "2",
            "--requests",
            "6",
            "--steps",
            "3",
            "--cap",
            "2",
            "--profile-forwards",
            "4",
            "--poisson-requests",
            "10",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    report = json.loads((out / "bench_engines.json").read_text())
    traffic = {(r["engine"], r["traffic"]) for r in report["runs"]}
    # Two rounds of each traffic, each ratio read from both.
    for kind in ("homogeneous", "mixed", "poisson50", "poisson80", "poisson95"):
        assert sorted(
            r["round"] for r in report["runs"] if r["traffic"] == kind and r["engine"] == "step"
        ) == [0, 1]
    for label in ("mixed: step / request throughput", "Poisson 80%: step / request mean latency"):
        assert len(report["ratio_rounds"][label]) == 2
    # Each Poisson round on arrivals of its own, the same for every engine.
    seeds = {
        (r["round"], r["engine"]): r["arrival_seed"] for r in report["runs"] if r["traffic"] == "poisson80"
    }
    assert seeds == {(r, e): 1 + r for r in (0, 1) for e in ("request", "step", "step-eager")}
    for engine in ("request", "step"):
        kinds = ("homogeneous", "mixed", "poisson50", "poisson80", "poisson95")
        assert {(engine, kind) for kind in kinds} <= traffic
    # The step engine before admission pacing runs beside the served one, with a timeline of its steps.
    assert {("step-eager", kind) for kind in ("poisson50", "poisson80", "poisson95")} <= traffic
    for run in report["runs"]:
        if run["engine"].startswith("step") and run["traffic"].startswith("poisson"):
            timeline = run["extra"]["timeline"]
            assert timeline["steps"] > 0 and 0 < timeline["model_forward_ms"] < timeline["step_ms"]
    # Text-only and img2img requests: one model on the step engine against two request-level models.
    for engine in ("request", "step"):
        assert {(engine, "text+image"), (engine, "text+image poisson80")} <= traffic
    weights = report["image_mix_weights"]  # the second model holds a second copy of the weights
    assert (
        weights["one_model_mib"] > 1 and abs(weights["two_models_mib"] / weights["one_model_mib"] - 2) < 0.01
    )
    for run in report["runs"]:
        poisson = "poisson" in run["traffic"]
        assert run["requests"] == (10 if poisson else 6) and run["images_per_s"] > 0
        # Poisson: the first 10% left out, and the rate offered reported beside the one delivered.
        assert run["measured_requests"] == (9 if poisson else 6)
        assert (run["offered_images_per_s"] is not None) == poisson
    # A profile a round, and diffusers' own batch call in each round at the top concurrency: each read
    # from its rounds.
    assert len(report["profile_rounds"]) == 2 and report["profile"] in report["profile_rounds"]
    for profile in report["profile_rounds"]:
        assert 0 < profile["model_forward_ms"] < profile["step_ms"] and 0 <= profile["own_share_of_step"] < 1
    assert len(report["raw_rounds"]) == 2 and all(each > 0 for each in report["raw_rounds"])
    # diffusers' own call timed in place beside each profile, its methods given back afterwards.
    assert len(report["raw_profile_rounds"]) == 2
    for raw in report["raw_profile_rounds"]:
        assert 0 < raw["denoiser_ms"] < raw["step_ms"] and raw["start_ms"] > 0 and raw["decode_ms"] > 0
    for label in (
        "homogeneous c=2: step / raw batch-2 throughput",
        "profile: engine's own work / step time",
        "profile: engine's own work / diffusers' loop's own work, a step",
    ):
        assert len(report["ratio_rounds"][label]) == 2
    # A forward timed by the engine's stopwatch beside the host's clock around a synced call (the GPU's
    # check: on this CPU both are the host's clock).
    assert set(report["stopwatch_check"]) == {"1", "8"}
    for check in report["stopwatch_check"].values():
        assert check["stopwatch_s"] > 0 and check["synced_host_s"] > 0
        assert check["ratio"] == pytest.approx(check["stopwatch_s"] / check["synced_host_s"])
    assert set(report["raw"]) == {"batch1_images_per_s", "batch2_images_per_s"}


def test_the_graphs_benchmark_times_forwards_and_counts_their_flops(tmp_path):
    out = tmp_path / "graphs"
    command = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "bench_graphs.py"),
        "--steps",
        "2",
        "--repeats",
        "1",
    ]
    subprocess.run([*command, "--out", str(out)], check=True, timeout=600)
    report = json.loads((out / "bench_graphs.json").read_text())
    rows = [(row["images"], row["model_rows"]) for row in report["forward"]]
    assert rows == [(1, 2), (4, 8), (8, 16)]
    flops = [row["flops"] for row in report["forward"]]
    assert 0 < flops[0] and flops[2] == 2 * flops[1] == 8 * flops[0]  # FLOPs grow with the rows
    assert report["eager_alone_s"] > 0 and report["pipeline_alone_s"] > 0
    gpu = torch.cuda.is_available()  # captured only on a GPU
    assert (report["graphs"] is not None) == gpu and ("captured_alone_s" in report) == gpu


def run_perf_analyzer_script(tmp_path, url: str, *extra: str, **env: str) -> subprocess.CompletedProcess:
    variables = dict(
        os.environ, URL=url, CONCURRENCY="1:2:1", WINDOW_REQUESTS="3", OUT=str(tmp_path / "pa.csv"), **env
    )
    command = [str(REPO_ROOT / "scripts" / "perf_analyzer.sh"), *extra]
    return subprocess.run(command, env=variables, capture_output=True, text=True, timeout=300)


def test_perf_analyzer_script_writes_a_csv(server, tmp_path):
    # Stability is not under test here (the CI machine is shared and noisy): any three windows pass, and a
    # window ends after three completed requests however slow the machine (a time window could end empty).
    result = run_perf_analyzer_script(tmp_path, server.grpc_url, STABILITY="1000")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "pa.csv").open()))
    # perf_analyzer writes its rows in an order of its own (seen both ways): each level once.
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 2]
    assert all(float(r["Inferences/Second"]) > 0 and float(r["p95 latency"]) > 0 for r in rows)


def test_perf_analyzer_script_fails_when_the_sweep_ends_early(tmp_path):
    """perf_analyzer ends a sweep at a level it cannot measure stably, writes only the levels before it and
    exits 0: the script fails and says how many were measured. Here a stand-in for the binary does that
    (a real one cannot be made unstable at the second level only)."""
    stand_in = tmp_path / "perf_analyzer"
    stand_in.write_text(
        "#!/usr/bin/env bash\n"
        'while [ $# -gt 0 ]; do [ "$1" = -f ] && out="$2"; shift; done\n'
        'printf "Concurrency,Inferences/Second\\n1,5.0\\n" >"$out"\n'
        'echo "Failed to obtain stable measurement within 10 measurement windows for concurrency 2." >&2\n'
    )
    stand_in.chmod(0o755)
    result = run_perf_analyzer_script(tmp_path, "unused:1", PERF_ANALYZER=str(stand_in))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "1 of 2 concurrency levels measured" in result.stderr
    # A sweep a latency limit ends is ended on purpose: not an error.
    result = run_perf_analyzer_script(
        tmp_path, "unused:1", "--latency-threshold", "50", PERF_ANALYZER=str(stand_in)
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_diffusion_lm_benchmarks_in_process_ceiling_runs_on_the_shared_engine():
    import argparse

    sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the benchmarks' package (scripts/benchmarks/)
    from benchmarks import dllm

    args = argparse.Namespace(param=[], gen_lengths=[32], block_length=16, tokens_per_step=2, temperature=0.0)
    ceiling = dllm.engine_ceiling(args, 3)
    assert (
        ceiling["requests"] == 3
        and ceiling["together_tokens_per_s"] > 0
        and ceiling["alone_tokens_per_s"] > 0
    )
