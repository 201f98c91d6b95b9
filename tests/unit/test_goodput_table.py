"""The goodput benchmark's table words and helpers (scripts/tables/goodput.py: the per-tier table, misses,
the room, the rules, the targets, the models and the capacity as each artefact records them), its model
per variant (scripts/benchmarks/goodput.py) and the headline's goodput row (scripts/tables/headline.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from tables.goodput import _tiers  # noqa: E402


def run(variant: str, met: int, degraded: int | None) -> dict:
    tier = {"offered": 5, "met": met} | ({} if degraded is None else {"degraded": degraded})
    return {"load": 1.5, "variant": variant, "by_tier": {"flex": tier}}


def artefact(*runs: dict) -> dict:
    return {
        "loads": [1.5],
        "config": {"variants": ["tiers", "degrade"], "tier_shares": {"flex": 1.0}},
        "runs": runs,
    }


def test_each_tier_shows_what_the_degrade_variant_degraded_over_its_rounds():
    table = _tiers(
        artefact(run("tiers", 1, 0), run("degrade", 3, 2), run("tiers", 2, 0), run("degrade", 4, 1))
    )
    assert "| load | tier | tiers in time | degrade in time | degrade: answered degraded |" in table
    assert "| 1.5x | flex | 3/10 | 7/10 | 3/10 |" in table


def test_a_round_that_drew_none_of_a_tier_counts_nothing():
    drew_none = {"load": 1.5, "variant": "degrade", "by_tier": {}}
    table = _tiers(artefact(run("tiers", 1, 0), run("degrade", 3, 2), drew_none))
    assert "| 1.5x | flex | 1/5 | 3/5 | 2/5 |" in table


def test_an_artefact_from_before_the_count_shows_none():
    assert "| 1.5x | flex | 1/5 | 3/5 | - |" in _tiers(
        artefact(run("tiers", 1, None), run("degrade", 3, None))
    )


def test_misses_count_refused_and_expired_and_those_expired_after_starting():
    from tables.goodput import _misses

    rounds = [
        {"tiers": {"refused": 1, "expired": 4, "expired_started": 3}},
        {"tiers": {"refused": 2, "expired": 1, "expired_started": 0}},
    ]
    assert _misses(rounds, "tiers") == "3, 5 (3)"
    assert _misses(rounds, "degrade") == "-"  # not run
    assert _misses([{"tiers": {"refused": 1, "expired": 4}}], "tiers") == "-"  # from before the count


def test_the_room_is_read_from_the_artefacts_model_edits():
    # A model per variant, as the benchmark makes them now, and the two models of the artefacts before.
    from benchmarks.goodput import model_of, models
    from tables.goodput import room_words

    variants = ("fifo", "tiers-room", "degrade-room")
    now = {"cap": 8, "model_edits": models(8, 1.0, variants), "model_of": {v: model_of(v) for v in variants}}
    assert room_words(now) == "1 x its capacity"
    before = {
        "cap": 8,
        "model_edits": {"goodput": {"deadline_room": "0"}, "goodput_room": {"deadline_room": "24"}},
        "model_of": {"fifo": "goodput", "tiers-room": "goodput_room", "degrade-room": "goodput_room"},
    }
    assert room_words(before) == "1.5 x its capacity"
    assert room_words({"cap": 8}) == "3 x its capacity"  # an artefact from before --room: 3 x, as then


def test_each_variant_runs_on_a_model_of_its_own():
    from benchmarks.goodput import model_of, models

    variants = (
        "fifo", "tiers", "degrade", "tiers-room", "degrade-room", "tiers-need", "degrade-need", "narrow-room"
    )  # fmt: skip
    served = models(8, 1.0, variants)
    assert len(served) == len(variants) == len({model_of(v) for v in variants})
    assert served[model_of("degrade")] == {"deadline_room": "0"}
    assert served[model_of("degrade-room")] == {"deadline_room": "16"}
    assert served[model_of("tiers-need")] == {"deadline_room": "16", "tier_pause": "deadline"}
    assert served[model_of("narrow-room")] == {"deadline_room": "16", "narrow_forwards": "true"}


def test_narrow_room_sends_what_tiers_room_sends_and_its_narrowed_forwards_are_summed_per_load():
    """narrow-room differs from tiers-room by its model only: the client sends the same; the table reads
    its runs' narrowed forwards, per load, over its rounds (the other variant's not counted)."""
    from benchmarks.goodput import NARROWED, sent
    from tables.goodput import _narrowed

    from triton_diffusion.serving.metrics import FAMILIES

    assert NARROWED in FAMILIES  # the count the server exports

    request = {"prompt": "p", "seed": 1, "service_tier": "flex"}
    assert sent(request, "narrow-room", 1.0, 10) == sent(request, "tiers-room", 1.0, 10)
    runs = [
        {"load": 0.8, "variant": "narrow-room", "forwards_narrowed": 3.0},
        {"load": 0.8, "variant": "tiers-room", "forwards_narrowed": 0.0},
        {"load": 0.8, "variant": "narrow-room", "forwards_narrowed": 4.0},
        {"load": 2.0, "variant": "narrow-room", "forwards_narrowed": 0.0},
        {"load": 2.0, "variant": "tiers-room", "forwards_narrowed": 9.0},
    ]
    line = _narrowed({"loads": [0.8, 2.0], "runs": runs})
    assert line.endswith(": 7 at 0.8x, 0 at 2x.")


def test_the_warm_up_is_read_as_a_count_or_from_the_fraction_before_it():
    from tables.goodput import warm_up

    assert warm_up({"requests": 278, "warm_up": 128, "warm_up_fraction": 0.1}) == 128
    assert warm_up({"requests": 150, "warm_up_fraction": 0.1}) == 15


def test_a_degraded_requests_rules_are_read_from_its_batch_not_its_reason():
    from benchmarks.goodput import why_degraded

    reports = [
        {"reason": "words a person reads", "rules": ["deadline"]},
        {"reason": "", "rules": ["overload"]},
        {"reason": "", "rules": ["room"]},
        {"reason": "overload: both", "rules": ["deadline", "overload"]},  # a cut and a cache, or two images
    ]
    assert why_degraded(reports) == {"deadline": 2, "overload": 2, "deadline of another image after it": 1}


def test_the_quiet_target_says_how_many_degraded_requests_the_run_without_degradation_missed():
    from tables.goodput import _quiet

    def low(
        variant: str, round_: int, degraded: list[int], missed: list[int] | None, load: float = 0.8
    ) -> dict:
        return {
            "load": load,
            "round": round_,
            "variant": variant,
            "offered": 10,
            "degraded": len(degraded),
            "degraded_requests": degraded,
            "degraded_why": {"deadline": len(degraded)},
        } | ({} if missed is None else {"missed_requests": missed})

    runs = [
        low("tiers-room", 1, [], [3, 4, 7]),
        low("degrade-room", 1, [4, 5], []),
        low("tiers-room", 2, [], [1, 5]),
        low("degrade-room", 2, [1], [2]),
        # At 0.5x: request 4 degraded, missed by round 1's tiers run at 0.8x only.
        low("tiers-room", 1, [], [], load=0.5),
        low("degrade-room", 1, [4], [], load=0.5),
        # The other door's pair (degrade with tiers): one degraded, missed there.
        low("tiers", 1, [], [9]),
        low("degrade", 1, [9], []),
    ]
    text = _quiet({"runs": runs})
    assert "(degrade-room): **missed** (4 of 30" in text
    assert "by round: 0.5x 1; 0.8x 2, 1)." in text  # rounds in order, loads in order
    # Paired by round and load: request 4 in round 1 at 0.8x and request 1 in round 2 were missed by
    # their own round's tiers run; request 5 only by another round's, request 4 at 0.5x only at 0.8x.
    assert "tiers-room, which degrades nothing, missed 5 of 30; 2 of the 4 degraded" in text
    assert "(degrade): **missed** (1 of 10" in text
    assert "tiers, which degrades nothing, missed 1 of 10; 1 of the 1 degraded" in text
    before = [{k: v for k, v in r.items() if k != "missed_requests"} for r in runs]
    assert "which degrades nothing" not in _quiet({"runs": before})  # an artefact from before says nothing


def test_the_table_says_which_variants_shared_a_model():
    from tables.goodput import models_words

    own = {"model_of": {"fifo": "goodput_fifo", "tiers-room": "goodput_tiers_room"}}
    assert models_words(own) == "Each variant on a model of its own. "
    shared = {"model_of": {"fifo": "goodput", "tiers-room": "goodput_room", "degrade-room": "goodput_room"}}
    assert models_words(shared).startswith("tiers-room and degrade-room on one model (")
    two = {"model_of": {"tiers": "a", "degrade": "a", "tiers-room": "b", "degrade-room": "b"}}
    assert models_words(two).startswith("tiers and degrade; tiers-room and degrade-room on one model each")
    assert models_words({}) == ""


def test_the_capacity_says_each_models_measurement():
    from tables.goodput import capacity_words

    same = "the same sequence of arrivals in every round"
    assert capacity_words({"config": {"cap": 8}, "capacity": 20.0}) == f"closed loop at 8 in step; {same}"
    now = {"config": {"cap": 8}, "capacity": 16.0, "capacity_by_model": [15.0, 16.0, 17.25]}
    assert (
        capacity_words(now)
        == f"closed loop at 8 in step, the median of each model's: 15.00, 16.00, 17.25; {same}"
    )
    phased = {
        **now,
        "config": {"cap": 8, "arrival_seeds": "--seed + round - 1"},
        "capacity_rule": "out of phase",
        "capacity_in_step_by_model": [19.0, 20.0, 21.5],
    }
    words = capacity_words(phased)
    assert words.startswith("closed loop at 8 out of phase") and "15.00, 16.00, 17.25" in words
    assert "in step (the workers started together): 19.00, 20.00, 21.50" in words
    assert words.endswith("each round's arrivals a sequence of its own")


def test_the_capacity_counts_answers_while_every_worker_was_busy():
    from benchmarks.goodput import steady_rate

    # 2 workers: the start-up's first answer and the drain's last are not counted; 3 answers in the
    # 1.5 s between the 2nd (t=1.0) and the 2nd from last (t=2.5).
    stamps = [2.5, 0.2, 1.0, 1.5, 2.0, 9.0]
    assert steady_rate(stamps, 2) == 3 / 1.5
    assert steady_rate([0.0, 1.0, 2.0, 3.0], 1) == 3 / 3.0
    # Counted from the first answer after the last worker started, where that is later.
    assert steady_rate(stamps, 2, all_busy=1.2) == 2 / 1.0
    with pytest.raises(ValueError, match="at least 5"):
        steady_rate([0.0, 1.0, 2.0, 3.0], 2)  # too few to count any
    with pytest.raises(ValueError, match="no answer counted"):
        steady_rate(stamps, 2, all_busy=3.0)


def test_each_round_has_arrivals_of_its_own_and_its_variants_share_them(monkeypatch, tmp_path):
    """Fails if the rounds reuse one arrival sequence (they would sample one burst five times over) or if
    the variants of a round see different arrivals."""
    import argparse

    import benchmarks.goodput as goodput

    seen: dict[tuple[float, int], list[tuple[str, list[float]]]] = {}

    def run(url, requests, arrivals, variant, *rest):
        key = next(load_of)
        seen.setdefault(key, []).append((variant, arrivals))
        failed = type("Failed", (), {"ok": False})()
        return [failed] * len(requests), [0.0] * len(requests)

    monkeypatch.setattr(goodput, "run", run)
    monkeypatch.setattr(goodput, "generate_one", lambda *a, **k: type("R", (), {"latency_s": 0.1})())
    monkeypatch.setattr(goodput, "in_step_capacity", lambda *a: 10.0)
    monkeypatch.setattr(goodput, "capacity", lambda *a: 8.0)
    monkeypatch.setattr(
        goodput, "figures", lambda *a: {"degraded_requests": [], "met": 0, "offered": 10, "degraded": 0}
    )
    monkeypatch.setattr(goodput, "compare", lambda *a: None)
    monkeypatch.setattr(goodput, "provenance", lambda: {})
    variants, rounds, loads = ("fifo", "tiers-room", "degrade-room"), 3, (0.5, 1.5)
    load_of = iter((load, r) for load in loads for r in range(rounds) for _ in variants)
    args = argparse.Namespace(
        tiers="0.2,0.4,0.4", requests=12, steps=4, seed=1, size=64, no_deadline_share=0.0, least_share=0.5,
        warm_up=2, cap=2, room=1.0, variants=variants, deadline_scale=3.0, arch="tiny-sd",
        device_profile=None, degrade_cache="", rounds=rounds, loads=",".join(map(str, loads)),
    )  # fmt: skip
    report = goodput.measure("url", args, {"model": "m"}, tmp_path / "goodput.json")
    assert report["capacity"] == 8.0 and report["capacity_in_step_by_model"] == [10.0] * 3
    for load in loads:
        sequences = []
        for r in range(rounds):
            runs = seen[load, r]
            assert [arrivals for _, arrivals in runs] == [runs[0][1]] * len(variants)  # shared in a round
            sequences.append(runs[0][1])
        assert len({tuple(s) for s in sequences}) == rounds  # each round its own


def test_the_headline_reads_degradation_at_1_5x_by_round_with_its_target():
    from tables.goodput import at_load, goodput_ratios
    from tables.headline import render

    def run(load, round_, variant, goodput):
        return {"load": load, "round": round_, "variant": variant, "goodput": goodput}

    runs = []
    for round_, (tiers, degrade) in enumerate([(2, 4), (2, 6), (2, 8), (2, 10), (0, 3)], start=1):
        runs += [run(1.5, round_, "tiers-room", tiers), run(1.5, round_, "degrade-room", degrade)]
        runs += [run(2.0, round_, "tiers-room", 2), run(2.0, round_, "degrade-room", 1)]  # not read
    artefact = {"config": {"arch": "tiny-sd"}, "runs": runs, "provenance": {"date": "2026-12-03T00:00:00"}}
    assert goodput_ratios(at_load(artefact, 1.5), "degrade-room", "tiers-room") == [2, 3, 4, 5, float("inf")]
    page = render({}, {}, {}, {}, {}, {}, artefact)
    row = next(line for line in page.splitlines() if "degrading rows at 1.5x capacity" in line)
    assert row == (
        "| degrading rows at 1.5x capacity, tiny-sd (degrade-room / tiers-room) | goodput degrade / tiers "
        "without it | **4** | >= 1.5 | met (90% interval 2-inf) | 2026-12-03 |"
    )
    assert "degrading rows" not in render({}, {}, {}, {}, {}, {}, {"runs": []})


def test_a_headline_median_over_nothing_reads_inf_not_missed():
    from tables.headline import _rounds_row

    row = _rounds_row("x", "a / b", [float("inf")] * 3, "", "2026-12-03", True)
    assert row[2] == "**inf**"


def test_a_run_records_its_latency_by_third_and_the_table_reads_fifos_queue():
    from benchmarks.goodput import figures
    from tables.goodput import _queue
    from triton_diffusion_client import GenerateResult

    requests = [{"service_tier": "default"} for _ in range(9)]
    results = [GenerateResult(str(i), "p") for i in range(9)]
    results[8] = GenerateResult("8", "p", error="refused: cannot finish within its deadline")
    latency = [0.1, 0.3, 0.2, 1.0, 5.0, 2.0, 9.0, 7.0, 0.0]  # a queue that grew
    found = figures(requests, results, latency, list(range(9)), window_s=1.0, deadline_s=1.0)
    # The median of each third's answered requests (the last third's refused one not counted).
    assert found["latency_thirds"] == [0.2, 2.0, 8.0]
    none = figures(requests, [results[8]] * 9, latency, list(range(9)), window_s=1.0, deadline_s=1.0)
    assert none["latency_thirds"] == [None, None, None]

    def fifo(load: float, thirds: list | None) -> dict:
        return {"variant": "fifo", "load": load} | ({} if thirds is None else {"latency_thirds": thirds})

    runs = [fifo(0.5, [0.2, 0.3, 0.25]), fifo(0.5, [0.2, 0.2, 0.3]), fifo(0.8, [0.5, 2.0, 6.0])]
    text = _queue({"loads": [0.5, 0.8, 1.5], "runs": runs + [fifo(1.5, None)]})
    assert text.endswith("0.5x 0.20 s to 0.28 s; 0.8x 0.50 s to 6.00 s.")
    assert _queue({"loads": [0.5], "runs": [fifo(0.5, None)]}) == ""  # an artefact from before says nothing


def test_capacity_reads_that_disagree_by_more_than_the_spread_stop_the_take():
    from benchmarks.goodput import MOST_CAPACITY_SPREAD, steady_machine

    steady_machine([18.0, 17.7, 17.9])  # docs/cpu/goodput.json's reads: steady
    steady_machine([20.0, 20.0 * MOST_CAPACITY_SPREAD])  # at the bound: steady
    with pytest.raises(SystemExit, match="22.0, 30.6, 29.3 req/s differ"):
        steady_machine([22.0, 30.6, 29.3])  # reads that disagree
