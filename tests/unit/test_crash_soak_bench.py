"""The crash soak's bookkeeping (scripts/benchmarks/crash_soak.py) and its figure block
(scripts/tables/crash_soak.py), with made-up per-request records, no server: what a run counts (offered,
completed, lost, goodput, latency) and how many steps each crash made the requests compute again, with and
without a resumed step; how rounds become medians; what the block shows, a skipped variant included."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks import crash_soak  # noqa: E402
from benchmarks.crash_figures import paired_verdicts, run_figures, steps_recomputed, summarise  # noqa: E402
from benchmarks.crash_soak import Crasher, checkpoint_edits, unreadable  # noqa: E402
from tables.crash_soak import render  # noqa: E402


def attempt(start=None, reached=None, error=None) -> dict:
    return {"start": start, "reached": reached, "error": error}


def record(index, attempts, ok=True, latency=2.0, arrival=0.0, resumed=None) -> dict:
    return {
        "index": index,
        "ok": ok,
        "error": None if ok else "no final response",
        "latency_s": latency,
        "arrival_s": arrival,
        "images": 1 if ok else 0,
        "attempts": attempts,
        "resumed_from_step": resumed,
        "resume_key": True,
    }


def test_a_request_never_resent_recomputes_nothing():
    assert steps_recomputed(record(0, [attempt(0, 16)])) == 0


def test_without_a_resumed_step_a_resent_request_recomputes_all_it_had_reached():
    crashed = record(0, [attempt(0, 7, "UNAVAILABLE"), attempt(0, 16)])
    assert steps_recomputed(crashed) == 7


def test_a_resumed_request_recomputes_only_the_steps_past_its_checkpoint():
    # Reached step 7, resumed from the checkpoint at 6: one step again. The final attempt's start is its
    # BATCH resumed_from_step, not its first progress step.
    crashed = record(0, [attempt(0, 7, "UNAVAILABLE"), attempt(6, 16)], resumed=6)
    assert steps_recomputed(crashed) == 1
    # A BATCH without resumed_from_step: it started again from 0, whatever the progress said.
    assert steps_recomputed(record(0, [attempt(0, 7, "x"), attempt(6, 16)])) == 7


def test_two_crashes_a_silent_attempt_and_a_lost_request():
    # Reached 5; resent, resumed at 4 (first progress 5) and reached 9; resent, one attempt that never
    # reported a step (the server not back), then resumed from 8: (5 - 4) + (9 - 8).
    twice = record(
        0,
        [attempt(0, 5, "x"), attempt(4, 9, "x"), attempt(None, None, "x"), attempt(None, 16)],
        resumed=8,
    )
    assert steps_recomputed(twice) == 2
    # Lost after reaching 3, resent from 0, lost again at 6: the second failure has no next attempt.
    lost = record(1, [attempt(0, 3, "x"), attempt(0, 6, "x")], ok=False)
    assert steps_recomputed(lost) == 3
    # A first attempt that failed before any step: nothing recomputed.
    assert steps_recomputed(record(2, [attempt(None, None, "x"), attempt(0, 16)])) == 0


def test_a_run_counts_offered_completed_lost_goodput_and_steps_per_crash():
    records = [
        record(0, [attempt(0, 16)], latency=1.0, arrival=0.0),
        record(1, [attempt(0, 8, "x"), attempt(0, 16)], latency=3.0, arrival=2.0),
        record(2, [attempt(0, 4, "x"), attempt(2, 16)], latency=5.0, arrival=7.0, resumed=2),
        record(3, [attempt(None, None, "unknown model")], ok=False, latency=0.1, arrival=8.0),
    ]
    figures = run_figures(records, crashes=2, duration_s=10.0, hung=1)
    assert figures["offered"] == 5 and figures["completed"] == 3 and figures["lost"] == 2
    assert figures["span_s"] == 12.0  # the last answer, at 7 + 5, after the traffic's 10 s
    assert figures["goodput_images_per_s"] == 3 / 12.0
    assert figures["latency_mean_s"] == 3.0 and 4.5 < figures["latency_p95_s"] <= 5.0
    assert figures["retried"] == 2 and figures["resumed"] == 1
    assert figures["steps_recomputed"] == 8 + 2 and figures["steps_recomputed_per_crash"] == 5.0


def test_a_run_without_crashes_or_answers_still_has_figures():
    figures = run_figures([record(0, [attempt()], ok=False)], crashes=0, duration_s=5.0)
    assert figures["completed"] == 0 and figures["latency_p95_s"] is None
    assert figures["steps_recomputed_per_crash"] is None and figures["goodput_images_per_s"] == 0.0


def run(variant: str, round_: int, goodput: float, per_crash: float | None) -> dict:
    return {
        "variant": variant,
        "round": round_,
        "offered": 40,
        "completed": 39,
        "lost": 1,
        "goodput_images_per_s": goodput,
        "crashes": 3,
        "latency_mean_s": 2.0,
        "latency_p95_s": 9.0,
        "steps_recomputed_per_crash": per_crash,
        "span_s": 97.5,
        "kills": [{"at_s": 60.0, "recovery_s": 14.2}, {"at_s": 120.0, "recovery_s": None}],
        "crash_failure": None,
    }


def artefact(runs: list[dict], skipped: str | None = None) -> dict:
    return {
        "settings": {
            "model": "tiny-sd text_to_image",
            "rounds": 2,
            "duration": 240.0,
            "crash_every": 60.0,
            "steps": 16,
            "size": 64,
            "load": 0.5,
            "timeout": 120.0,
            "retries": 3,
            "checkpoint_every": 2,
            "rate_per_s": 0.8,
            "solo_latency_s": 0.625,
        },
        "variants": {"checkpoints": {"skipped": skipped}, "none": {"skipped": None}},
        "runs": runs,
        "summary": summarise(runs),
        "complete": True,
    }


def test_rounds_become_medians_with_their_spread_per_variant():
    runs = [run("checkpoints", 0, 0.5, 1.0), run("none", 0, 0.4, 9.0)]
    runs += [run("checkpoints", 1, 0.7, 2.0), run("none", 1, 0.4, None)]
    rows = {row["variant"]: row for row in summarise(runs)}
    assert list(rows) == ["checkpoints", "none"]
    assert rows["checkpoints"]["goodput_images_per_s"] == {
        "median": 0.6,
        "min": 0.5,
        "max": 0.7,
        "rounds": [0.5, 0.7],
    }
    assert rows["none"]["steps_recomputed_per_crash"]["rounds"] == [9.0]  # a round without crashes left out


def test_the_block_shows_each_variant_and_run():
    runs = [run("checkpoints", 0, 0.5, 1.0), run("none", 0, 0.4, 9.0)]
    runs += [run("checkpoints", 1, 0.7, 2.0), run("none", 1, 0.4, 8.0)]
    text = render(artefact(runs))
    assert "0.80 requests/s (50% of one request at a time: 0.62 s alone)" in text
    assert "| `checkpoints` | 40 | 39 | 1 | 0.6 (0.5-0.7) | 3 | 2 | 9 | 1.5 (1-2) |" in text
    assert "| `none` | 40 | 39 | 1 | 0.4 | 3 | 2 | 9 | 8.5 (8-9) |" in text
    assert "| 1 | `none` | 40 | 39 | 1 | 0.4 | 3 | 2 | 9 | 8 | 97.5 | 14.2 |" in text
    assert "over the run's span (from the start of its arrivals to its last answer, or their 240 s" in text
    assert "not run" not in text and "Incomplete" not in text
    assert "each kill once" not in text  # kills at their scheduled times
    assert "Every run the same arrivals." in text  # an artefact from before --arrivals-per-round
    per_round = artefact(runs)
    per_round["settings"]["arrivals_per_round"] = True
    text = render(per_round)
    assert "Each round's arrivals a draw of their own" in text and "Every run the same" not in text
    mid_job = artefact(runs)
    mid_job["settings"]["mid_job"] = 8
    mid_job["settings"]["mid_job_wait_s"] = 60.0
    said = "killed every 60 s (each kill once a request in flight had computed 8 steps, or after 60 s"
    assert said in render(mid_job)


def test_the_block_says_when_the_checkpointed_variant_could_not_run():
    why = "model text_to_image: config parameter 'checkpoint_every_steps' is not a known parameter"
    cut = {**artefact([run("none", 0, 0.4, 9.0)], skipped=why), "complete": False}
    text = render(cut)
    assert f"**`checkpoints` not run:** the server of this commit could not load it ({why})." in text
    assert "**Incomplete:**" in text and "`checkpoints` |" not in text


def test_the_checkpointed_variant_is_skipped_where_the_settings_do_not_read_it(tmp_path):
    assert checkpoint_edits("none", tmp_path, 2) == {} and unreadable({}) is None
    edits = checkpoint_edits("checkpoints", tmp_path, 2)
    assert edits == {"checkpoint_every_steps": "2", "checkpoint_dir": str(tmp_path / "checkpoints")}
    why = unreadable(edits)  # None once the server reads them; until then the load error, named
    assert why is None or "checkpoint_every_steps" in why
    assert "checkpoint" in (unreadable({"checkpoint_every_stepz": "2"}) or "")


def test_rounds_are_read_as_pairs_with_the_one_verdict_rule_and_shown():
    """Each round's checkpoints run against its none run: five rounds where checkpoints always win give a
    gain on both figures; a round without crashes counts nothing for steps; the block says so."""
    runs = []
    for round_, (good, bad) in enumerate([(0.5, 0.4), (0.6, 0.5), (0.45, 0.4), (0.7, 0.5), (0.5, 0.45)]):
        runs += [run("checkpoints", round_, good, 1.0), run("none", round_, bad, 9.0 if round_ else None)]
    found = paired_verdicts(runs)
    assert found["goodput_ratio"]["values"] == pytest.approx([1.25, 1.2, 1.125, 1.4, 0.5 / 0.45])
    assert found["goodput_ratio"]["verdict"] == "gain"
    assert found["steps_saved_per_crash"]["values"] == [8.0] * 4  # round 0's none saw no crash
    assert found["steps_saved_per_crash"]["verdict"] == "not shown: too few rounds"
    made = {**artefact(runs), "verdicts": found}
    assert "goodput, checkpoints / none: **1.2**, gain (90% interval 1.11-1.4)" in render(made)
    flipped = [{**r, "goodput_images_per_s": 1.0} for r in runs]  # the same goodput: no gain shown
    assert paired_verdicts(flipped)["goodput_ratio"]["verdict"] == "no gain or loss shown"


def test_the_mean_latency_is_read_as_a_ratio_whose_gain_is_below_one():
    """Where every request completes in both variants the goodput cannot tell them apart; the time a crash
    costs the requests it hit shows in their mean latency: checkpoints / none, a gain below 1."""
    runs = []
    for round_, (fast, slow) in enumerate([(6.0, 8.0), (5.0, 7.0), (6.5, 8.0), (5.5, 7.5), (6.0, 7.0)]):
        runs += [
            {**run("checkpoints", round_, 1.0, 1.0), "latency_mean_s": fast, "lost": 0},
            {**run("none", round_, 1.0, 9.0), "latency_mean_s": slow, "lost": 0},
        ]
    found = paired_verdicts(runs)
    assert found["goodput_ratio"]["verdict"] == "no gain or loss shown"
    assert found["latency_mean_ratio"]["values"] == pytest.approx([0.75, 5 / 7, 6.5 / 8, 5.5 / 7.5, 6 / 7])
    assert found["latency_mean_ratio"]["verdict"] == "gain"
    assert "mean latency, checkpoints / none (below 1 a gain): **0.75**, gain" in render(
        {**artefact(runs), "verdicts": found}
    )
    slower = [{**r, "latency_mean_s": 9.0 if r["variant"] == "checkpoints" else 6.0} for r in runs]
    assert paired_verdicts(slower)["latency_mean_ratio"]["verdict"] == "loss"
    # A round where a variant lost a request compares different requests: it counts nothing.
    lossy = [{**r, "lost": 1} if r["round"] == 0 and r["variant"] == "none" else r for r in runs]
    assert len(paired_verdicts(lossy)["latency_mean_ratio"]["values"]) == 4


def crasher_kills(monkeypatch: pytest.MonkeyPatch, at: list[float], **kwargs: float) -> list[float]:
    """When a crasher made its kills (seconds from its start), on a fake server that is ready at once."""
    killed: list[int] = []
    monkeypatch.setattr(crash_soak, "server_ready", lambda server: not killed or killed.pop() is None)
    stub = SimpleNamespace(model=crash_soak.MODEL, pid=4242)
    monkeypatch.setattr(crash_soak, "list_stubs", lambda pid: [stub])
    monkeypatch.setattr(crash_soak.os, "kill", lambda pid, signal: killed.append(pid))
    server = SimpleNamespace(process=SimpleNamespace(pid=1))
    crasher = Crasher(server, at, crash_soak.time.perf_counter(), **kwargs)
    crasher.run()
    assert crasher.failure is None
    return [kill["at_s"] for kill in crasher.kills]


def test_kills_are_kept_at_least_the_gap_apart(monkeypatch: pytest.MonkeyPatch):
    # A kill held back (readiness, --mid-job) must not bring the next one within the supervisor's
    # anti-spin window: the crasher moves it.
    first, second = crasher_kills(monkeypatch, [0.0, 0.1], min_gap_s=1.5)
    assert second - first >= 1.49  # at_s is rounded to 0.01
    first, second = crasher_kills(monkeypatch, [0.0, 0.1])
    assert second - first < 1.5  # without the gap: at its scheduled time


def test_a_kill_moved_past_the_arrivals_is_not_made(monkeypatch: pytest.MonkeyPatch):
    assert len(crasher_kills(monkeypatch, [0.0, 0.1], min_gap_s=1.0, end_s=0.5)) == 1
    assert len(crasher_kills(monkeypatch, [0.0, 0.1], min_gap_s=0.2, end_s=0.5)) == 2


def test_a_kill_held_back_past_the_arrivals_by_readiness_is_not_made(monkeypatch: pytest.MonkeyPatch):
    ready_from = crash_soak.time.perf_counter() + 0.6  # a server not ready until after the arrivals end
    clock = crash_soak.time.perf_counter
    monkeypatch.setattr(crash_soak, "server_ready", lambda server: clock() >= ready_from)
    stub = SimpleNamespace(model=crash_soak.MODEL, pid=1)
    monkeypatch.setattr(crash_soak, "list_stubs", lambda pid: [stub])
    killed: list[int] = []
    monkeypatch.setattr(crash_soak.os, "kill", lambda pid, signal: killed.append(pid))
    server = SimpleNamespace(process=SimpleNamespace(pid=1))
    crasher = Crasher(server, [0.0], crash_soak.time.perf_counter(), end_s=0.3)
    crasher.run()
    assert killed == [] and crasher.kills == [] and crasher.failure is None
