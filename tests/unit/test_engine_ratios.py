"""The in-process engines benchmark's ratios (scripts/benchmarks/engine_ratios.py): each round's ratio from
the two engines' runs of that round, for every traffic the rounds ran (closed loop, mixed, each Poisson
load), with made-up runs; no engine runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks.common import per_round  # noqa: E402
from benchmarks.engine_ratios import ratios  # noqa: E402
from benchmarks.engine_runs import Outcome  # noqa: E402
from tables.engines import in_process_ratios  # noqa: E402


def run(engine: str, traffic: str, round_: int, images_per_s: float, latency: float = 1.0, **more) -> Outcome:
    concurrency = None if traffic.startswith("poisson") else 8
    rate = 10.0 if concurrency is None else None
    return Outcome(
        engine,
        traffic,
        concurrency,
        rate,
        requests=40,
        duration_s=more.pop("duration_s", 4.0),
        images_per_s=images_per_s,
        latency_mean_s=latency,
        latency_p95_s=2 * latency,
        first_step_mean_s=latency / 4,
        first_step_p95_s=latency / 2,
        offered_images_per_s=more.pop("offered", None),
        round=round_,
    )


def test_each_rounds_ratio_is_its_own_two_runs_not_the_runs_in_list_order():
    # The step engine's round 1 ran before its round 0 in the list (as rotated orders can put them).
    runs = [run("step", "mixed", 1, 30.0), run("step", "mixed", 0, 20.0)]
    runs += [run("request", "mixed", 0, 10.0), run("request", "mixed", 1, 10.0)]
    assert per_round(runs, ("step", "request"), "mixed", "images_per_s") == [2.0, 3.0]


def test_a_round_one_engine_lacks_is_left_out():
    runs = [run("step", "mixed", r, 20.0 + r) for r in range(3)] + [run("request", "mixed", 0, 10.0)]
    runs.append(run("request", "mixed", 2, 11.0))  # round 1 cut short before the request engine ran
    assert per_round(runs, ("step", "request"), "mixed", "images_per_s") == [2.0, 2.0]


def test_every_traffic_with_rounds_gets_its_median_and_its_rounds():
    runs, pairs = [], [(20.0, 10.0), (33.0, 11.0), (24.0, 12.0), (9.0, 10.0), (40.0, 10.0)]
    for r, (step, request) in enumerate(pairs):
        runs += [run("step", "homogeneous", r, step), run("request", "homogeneous", r, request)]
        runs += [run("step", "mixed", r, 2 * step), run("request", "mixed", r, request)]
        runs.append(run("request", "poisson80", r, 9.0, latency=1.0, offered=10.0))
        runs.append(run("step", "poisson80", r, 9.5, latency=0.5 + r / 10, offered=10.0))
        runs.append(run("step-eager", "poisson80", r, 9.0, latency=0.8, offered=10.0))
    found, rounds = ratios({"runs": runs, "cap": 8})
    homogeneous = "homogeneous c=8: step / request throughput"
    assert rounds[homogeneous] == [2.0, 3.0, 2.0, 0.9, 4.0]
    assert found[homogeneous] == (2.0, ">= 1.0")  # the median round, not the pooled throughput
    assert rounds["mixed: step / request throughput"] == [4.0, 6.0, 4.0, 1.8, 8.0]
    mean = "Poisson 80%: step / request mean latency"
    assert rounds[mean] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    assert found[mean] == (pytest.approx(0.7), "<= 0.65")
    assert found["Poisson 80%: step-eager / request mean latency"] == (pytest.approx(0.8), "-")  # no target
    assert rounds["Poisson 80%: step delivered / offered"] == pytest.approx([0.95] * 5)
    assert "Poisson 50%: step / request mean latency" not in found  # a load not run


def test_one_round_reads_its_own_ratio_at_the_top_concurrency_and_keeps_no_rounds():
    runs = [run("step", "homogeneous", 0, 20.0, duration_s=4.0), run("request", "homogeneous", 0, 10.0)]
    runs += [run("step", "homogeneous", 0, 30.0, duration_s=2.0)]  # a lower concurrency's, by its round
    runs[-1].concurrency = 4
    found, rounds = ratios({"runs": runs, "cap": 8})
    assert found == {"homogeneous c=8: step / request throughput": (2.0, ">= 1.0")}
    assert rounds == {}


def test_the_block_names_each_runs_round_where_the_take_ran_rounds():
    runs = [run("step", "mixed", r, 20.0).__dict__ for r in range(2)]
    found, rounds = ratios({"runs": [run("step", "mixed", 0, 2.0), run("request", "mixed", 0, 1.0)]})
    text = in_process_ratios({"runs": runs, "ratios": found, "ratio_rounds": rounds})
    assert "| mixed, c=8, round 0 | step |" in text and "| mixed, c=8, round 1 | step |" in text
    text = in_process_ratios({"runs": runs[:1], "ratios": found, "ratio_rounds": rounds})
    assert "| mixed, c=8 | step |" in text  # one round: no round named


def test_the_fronts_ratios_pair_each_round_with_grpc_directs_and_read_a_verdict():
    """bench.py --openai: each round's front run over gRPC direct's of the same round (not in list order),
    the median round's value, the rounds kept for the verdict; the front block reads them (an older take
    without rounds: no verdict)."""
    from benchmarks.server import front_ratios, front_rounds
    from benchmarks.servers import RunStats
    from tables.engines import openai_front

    def stats(path: str, round_: int, images_per_s: float, front_ms: float = 1.0) -> RunStats:
        cpu = {"front": front_ms, "server": 10.0, "client": 2.0}
        return RunStats("step", 8, None, 48, 48, 0, 1.0, 48.0, images_per_s, 0.1, 0.1, 0.2, 0.3, None, 100.0,
                        8.0, traffic=path, cpu_ms_per_request=cpu, round=round_)  # fmt: skip

    grpc = [stats("grpc", r, 50.0 + r) for r in (4, 3, 2, 1, 0)]  # listed out of round order
    front = [stats("openai", r, 0.98 * (50.0 + r), front_ms=r + 1.0) for r in range(5)]
    values, rounds = front_ratios(grpc, front, "the official openai client", 8)
    name = "OpenAI front (the official openai client) / gRPC direct throughput, step engine, c=8"
    assert rounds[name] == pytest.approx([0.98] * 5) and values[name] == (pytest.approx(0.98), ">= 0.95")
    own = "OpenAI front's own CPU / the server's, per request (the official openai client)"
    assert values[own] == (pytest.approx(0.3), "-")  # the median round's share (3 ms / 10 ms)
    artefact = {"ratios": values, "ratio_rounds": rounds}
    assert "| >= 0.95 | met (90% interval 0.98-0.98) |" in openai_front(artefact)
    assert "| >= 0.95 | one run: no verdict |" in openai_front({"ratios": values})
    # Whole cycles of the three paths' balanced orders (six rounds), at least one (a verdict needs 5).
    assert (front_rounds(2), front_rounds(6), front_rounds(8)) == (6, 6, 12)


def test_the_raw_ceiling_and_the_profile_are_read_from_their_rounds():
    """diffusers' own batch call in each round at the top concurrency: each round's step run over that
    round's raw figure; a profile a round: the engine's own share from each. An older take (one raw run,
    one profile) keeps its one value and no rounds (no verdict)."""
    steps = [run("step", "homogeneous", r, 20.0 + r) for r in (2, 0, 1, 4, 3)]  # out of round order
    raw_rounds = [40.0, 42.0, 44.0, 46.0, 48.0]
    profiles = [{"own_share_of_step": share} for share in (0.02, 0.05, 0.03, 0.04, 0.01)]
    report = {"runs": steps, "cap": 8, "raw_rounds": raw_rounds, "profile_rounds": profiles}
    found, rounds = ratios(report)
    raw = "homogeneous c=8: step / raw batch-8 throughput"
    assert rounds[raw] == pytest.approx([20 / 40, 21 / 42, 22 / 44, 23 / 46, 24 / 48])
    assert found[raw] == (pytest.approx(0.5), ">= 0.95")
    own = "profile: engine's own work / step time"
    assert rounds[own] == [0.02, 0.05, 0.03, 0.04, 0.01] and found[own] == (0.03, "<= 0.03")
    older = {"runs": steps[:1], "cap": 8, "raw": {"batch8_images_per_s": 44.0}, "profile": profiles[2]}
    found, rounds = ratios(older)
    assert found[raw] == (pytest.approx(0.5), ">= 0.95") and found[own] == (0.03, "<= 0.03")
    assert raw not in rounds and own not in rounds


def test_the_engines_own_work_and_its_starts_are_read_against_diffusers_own_call_round_by_round():
    """Each round's profile against diffusers' own call timed in the same round: the row math and the
    bookkeeping over the rest of diffusers' loop, starting jobs over its encoding and starting latents;
    the block names the paired round's figures."""
    profiles = [
        {"row_math_ms": 0.6, "own_ms": 0.2 + r / 10, "admission_ms": 1.5, "own_share_of_step": 0.03 + r / 100}
        for r in range(5)
    ]
    profiles = [{**p, "rows_per_forward": 8, "step_ms": 21.0, "model_forward_ms": 17.0, "decode_ms": 1.6}
                for p in profiles]  # fmt: skip
    raws = [  # each round's own figures: a wrong pairing shows
        {"images_per_call": 8, "step_ms": 20.0 + r, "denoiser_ms": 17.0, "loop_ms": 0.4, "start_ms": 1.0 + r,
         "decode_ms": 1.6} for r in range(5)
    ]  # fmt: skip
    report = {"runs": [], "cap": 8, "profile_rounds": profiles, "raw_profile_rounds": raws}
    found, rounds = ratios(report)
    work = "profile: engine's own work / diffusers' loop's own work, a step"
    assert rounds[work] == pytest.approx([2.0, 2.25, 2.5, 2.75, 3.0]) and found[work][1] == "-"
    starts = "profile: starting jobs / diffusers' start, a step"
    assert rounds[starts] == pytest.approx([1.5 / (1.0 + r) for r in range(5)])
    report |= {"profile": profiles[2], **dict(zip(("ratios", "ratio_rounds"), (found, rounds), strict=True))}
    text = in_process_ratios(report)
    assert "In the profile at the median of the engine's own share (5 profiles" in text
    # The profile shown is round 2's: diffusers' call beside it is round 2's too.
    assert "diffusers' own call for 8 images in the same round, timed in place: 22 ms a denoising" in text
    assert "the rest of its loop (guidance, the scheduler's step, bookkeeping) 0.4 ms" in text
