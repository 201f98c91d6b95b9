"""The performance index's headline (scripts/tables/headline.py): each row says when and on which machine
its artefact was taken, as one table's rows come from takes on different hosts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from tables.headline import checkpoint_rounds, render  # noqa: E402


def provenance(date: str, cpu: str, gpu: str | None = None) -> dict:
    return {"date": f"{date}T00:00:00+00:00", "machine": {"cpu": cpu, "cores": 2, "gpu": gpu}}


def engines(where: dict) -> dict:
    runs = [
        {"engine": "step", "traffic": "mixed", "images_per_s": 3.0},
        {"engine": "request", "traffic": "mixed", "images_per_s": 1.0},
    ]
    return {"arch": "tiny-sd", "size": "64x64", "runs": runs, "provenance": where}


def checkpoints(where: dict) -> dict:
    """Five rounds, each its own off (1.0, 1.1, ...) and its every-5 step 1% above it."""
    runs = []
    for round_ in range(5):
        off = 1.0 + round_ / 10
        runs.append({"round": round_, "interval": 0, "store": None, "step_s_mean": off})
        runs.append({"round": round_, "interval": 5, "store": "this", "step_s_mean": off * 1.01})
    return {"runs": runs, "provenance": where}


def row(page: str, what: str) -> str:
    return next(line for line in page.splitlines() if what in line)


def test_the_engines_checkpoint_and_gpu_rows_each_name_the_machine_of_their_own_artefact():
    intel = provenance("2026-12-02", "Intel(R) Xeon(R) Processor")
    amd = provenance("2026-12-05", "AMD EPYC")
    h100 = provenance("2026-11-27", "Intel(R) Xeon(R) Platinum", "NVIDIA H100 80GB HBM3 x1")
    amd["machine"]["gpu"] = "NVIDIA H100 80GB HBM3 x1"  # a CPU take on a host with a GPU: its CPU
    page = render(engines(intel), {}, checkpoints(amd), {}, {}, engines(h100), {"runs": []})
    cpu, gpu = page.split("**GPU**")
    assert row(cpu, "mixed step counts").endswith("| 2026-12-02, Intel(R) Xeon(R) Processor |")
    assert row(cpu, "checkpoints every 5 steps").endswith("| 2026-12-05, AMD EPYC |")
    assert row(gpu, "mixed step counts").endswith("| 2026-11-27, NVIDIA H100 80GB HBM3 x1 |")  # its GPU
    assert "Intel" not in page.splitlines()[0] and "AMD" not in page.splitlines()[0]  # not one for all


def test_a_checkpoint_rows_rounds_are_each_rounds_step_over_its_own_off():
    artefact = checkpoints(provenance("2026-12-05", "AMD EPYC"))
    artefact["runs"][3]["step_s_mean"] = 1.65  # round 1's every-5 step: 1.5 x its off (1.1)
    artefact["runs"].append({"round": 5, "interval": 5, "store": "this", "step_s_mean": 2.0})  # no off: cut
    # Another store's run (an --against artefact's): not this store's round.
    artefact["runs"].append({"round": 2, "interval": 5, "store": "b1db203", "step_s_mean": 9.0})
    rounds = checkpoint_rounds(artefact)
    assert list(rounds) == [5]
    assert rounds[5] == pytest.approx([1.01, 1.5, 1.01, 1.01, 1.01])


def test_an_engines_row_reads_its_verdict_from_its_own_rounds_where_the_take_ran_them():
    artefact = engines(provenance("2026-12-05", "AMD EPYC"))
    artefact["runs"] += [
        {"engine": "step", "traffic": "poisson80", "latency_mean_s": 0.5},
        {"engine": "request", "traffic": "poisson80", "latency_mean_s": 1.0},
    ]
    label = "Poisson 80%: step / request mean latency"
    artefact["ratios"] = {label: [0.5, "<= 0.65"], "mixed: step / request throughput": [3.0, ">= 2"]}
    artefact["ratio_rounds"] = {label: [0.4, 0.55, 0.45, 0.6, 0.58]}  # mixed: one run
    page = render(artefact, {}, {}, {}, {}, {"runs": []}, {"runs": []})
    # The rounds' median (0.55), not the one run's ratio (0.5).
    assert (
        "Poisson at 80% load | step / request mean latency | **0.55** | <= 0.65 | met (90% interval" in page
    )
    assert "step counts and guidance | step / request images/s | **3** | - | one run: no verdict" in page
    artefact["ratio_rounds"][label] = [0.4, 0.5, 0.45, 0.55, 0.7]  # a round past the target
    page = render(artefact, {}, {}, {}, {}, {"runs": []}, {"runs": []})
    assert "| <= 0.65 | not shown (90% interval 0.4-0.7) |" in page
