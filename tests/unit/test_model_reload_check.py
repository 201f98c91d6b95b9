"""scripts/model_reload_check.py's verdict and its renderer (scripts/tables/model_reload.py), on fake
figures: reloading one model is called safe only when nothing hung, no old copy was left unloading, the
other model answered everything, RSS stayed flat and the server shut down within its exit timeout."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import model_reload_check as check  # noqa: E402
from tables import model_reload  # noqa: E402


def cycle(victim="inline", in_flight="error", stuck=0, bystander=None, rss=(40.0, 40.5), answered=True):
    return {
        "cycle": 1,
        "victim": victim,
        "in_flight": in_flight,
        "in_flight_error": "Stub process 'inline_0_0' is not healthy." if in_flight == "error" else None,
        "in_flight_finally": in_flight,
        "load_needed_touch": False,
        "load_s": 1.9,
        "ready_after_load_s": 1.95,
        "reloaded_answered": answered,
        "stuck_copies": stuck,
        "bystander": "threaded" if victim == "inline" else "inline",
        "bystander_requests": bystander or {"answered": 5},
        "victim_trickle": {"answered": 2, "error": 3},
        "server_rss_mib": list(rss),
        "stubs": [2, 2],
        "shm_regions_on_disk": [2, 2],
        "shm_regions_mapped": [2, 2],
    }


def shutdown(within=True):
    return {
        "exit_timeout_s": 10,
        "seconds": 2.1 if within else 10.9,
        "within_timeout": within,
        "sigkilled": False,
        "exit_timeout_expired": not within,
        "live_models_at_shutdown": 2,
        "processes_left": 0,
        "strays_after_exit": 0,
    }


def artefact(cycles, stop, trickle=None):
    return {
        "settings": {
            "server_version": "2.51.0",
            "models": {"inline": "answers from execute()", "threaded": "answers from a background thread"},
            "responses_per_request": 4,
            "response_pause_s": 0.5,
            "hang_s": 15,
            "exit_timeout_s": 10,
        },
        "cycles": cycles,
        "shutdown": stop,
        "verdict": check.verdict(cycles, stop, trickle or {}, 8.0),
    }


def test_a_clean_reload_is_safe():
    result = check.verdict([cycle(), cycle("threaded")], shutdown(), {"inline": {"answered": 9}}, 8.0)
    assert result["safe"] and result["failures"] == [] and result["keep"] == "reload the one model"
    assert result["rss_mib_per_cycle"] == 0.25


def test_each_failure_makes_it_unsafe_and_says_why():
    cases = {
        "hung": [cycle("threaded", in_flight="hang")],
        "never finished unloading": [cycle(stuck=1)],
        "of the other model not answered": [cycle(bystander={"answered": 3, "error": 1})],
        "did not answer": [cycle(answered=False)],
        "RSS grew": [cycle(rss=(40.0, 60.0))],
    }
    for words, cycles in cases.items():
        result = check.verdict(cycles, shutdown(), {}, 8.0)
        assert not result["safe"] and result["keep"] == "restart the whole server", words
        assert any(words in failure for failure in result["failures"]), (words, result["failures"])
    late = check.verdict([cycle()], shutdown(within=False), {}, 8.0)
    assert not late["safe"] and "exit timeout of 10 s" in late["failures"][0]
    trickle_hang = check.verdict([cycle()], shutdown(), {"threaded": {"answered": 3, "hang": 1}}, 8.0)
    assert "1 request(s) hung" in trickle_hang["failures"][0]


def test_the_renderer_shows_each_cycle_and_the_verdict():
    safe = model_reload.render(artefact([cycle(), cycle("threaded")], shutdown()))
    assert safe.count("\n| 1 | `") == 2 and "**Verdict: safe.**" in safe
    assert "5/5 answered" in safe and "40.0 → 40.5" in safe and "within its timeout" in safe

    unsafe = model_reload.render(artefact([cycle("threaded", in_flight="hang", stuck=1)], shutdown(False)))
    assert "**hang** (nothing, even after the reload)" in unsafe
    assert "**the exit timeout expired**" in unsafe
    assert "**Verdict: not safe; keep the whole-server restart.**" in unsafe
    assert "never finished unloading" in unsafe
