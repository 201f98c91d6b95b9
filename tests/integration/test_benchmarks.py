"""Smoke runs of the benchmark and perf_analyzer scripts: files are written and the numbers are sane
(not how fast they are: speed belongs in the benchmark's own report)."""

import csv
import json
import os
import subprocess
import sys

from triton_diffusion.serving.launcher import REPO_ROOT


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
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text().startswith("Machine:")
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert [(r["variant"], r["concurrency"]) for r in report["runs"]] == [
        ("singleton", 1),
        ("singleton", 2),
        ("dynamic", 1),
        ("dynamic", 2),
    ]
    for run in report["runs"]:
        assert run["errors"] == 0 and run["requests"] == 4 and run["images"] == 4
        assert run["requests_per_s"] > 0 and 0 < run["latency_p50_s"] <= run["latency_p99_s"]
        assert 0 < run["first_progress_mean_s"] <= run["latency_mean_s"]
        assert run["peak_memory_mb"] > 50
        assert 1 <= run["mean_rows_per_call"] <= (1 if run["variant"] == "singleton" else 2)
    assert [r["batch"] for r in report["raw"]] == [1, 2]
    assert all(r["images_per_s"] > 0 for r in report["raw"])
    assert set(report["ratios"]) >= {"dynamic / singleton throughput", "dynamic / raw batched (server cost)"}


def test_perf_analyzer_script_writes_a_csv(server, tmp_path):
    out = tmp_path / "perf_analyzer.csv"
    env = dict(os.environ, URL=server.grpc_url, CONCURRENCY="1:2:1", INTERVAL_MS="1500", OUT=str(out))
    result = subprocess.run(
        [str(REPO_ROOT / "scripts" / "perf_analyzer.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [int(r["Concurrency"]) for r in rows] == [1, 2]
    assert all(float(r["Inferences/Second"]) > 0 and float(r["p95 latency"]) > 0 for r in rows)
