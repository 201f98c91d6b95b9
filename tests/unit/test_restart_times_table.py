"""The restart-times block (scripts/tables/restart_times.py): a measure's median and reading per variant,
and where both ran, now over before per round read by the one verdict rule; and the older commit's model
files, which import its own package first (scripts/restart_times.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from tables.restart_times import _ratios, render  # noqa: E402


def artefact(now: list[float], before: list[float]) -> dict:
    rows = []
    for round_, (a, b) in enumerate(zip(now, before, strict=True)):
        for variant, seconds in (("now", a), ("before", b)):
            rows.append(
                {
                    "variant": variant,
                    "round": round_,
                    "ready_s": seconds,
                    "crash_back_s": seconds,
                    "stop_idle_s": 1,
                }
            )
    setup = {"victim": "text_to_image", "served_commits": {"now": "b", "before": "a"}}
    return {"setup": setup, "rows": rows}


def test_now_over_before_is_read_per_round():
    # Round 1 reverses (now slower): pairing by sorted value or by position in another order differs.
    found = artefact([9, 22, 27, 36, 45], [10, 20, 30, 40, 50])
    assert _ratios(found, "crash_back_s") == [0.9, 1.1, 0.9, 0.9, 0.9]
    row = next(line for line in render(found).splitlines() if line.startswith("| crash restart"))
    assert row == (
        "| crash restart (stub killed to ready) | 30.0 (not shown, 90% interval 10-50) | 27.0 (not shown, "
        "90% interval 9-45) | 0.9: no gain or loss shown (90% interval 0.9-1.1) |"
    )
    worse = artefact([11, 22, 33, 44, 55], [10, 20, 30, 40, 50])
    row = next(line for line in render(worse).splitlines() if line.startswith("| crash restart"))
    assert row.endswith("| 1.1: loss (90% interval 1.1-1.1) |")


def test_a_take_of_now_alone_has_no_ratio_column():
    alone = {**artefact([9, 18], [10, 20])}
    alone["rows"] = [row for row in alone["rows"] if row["variant"] == "now"]
    assert "now / before" not in render(alone)


def test_the_block_says_whether_an_unrecorded_start_came_first():
    found = artefact([9, 18], [10, 20])
    assert "not recorded" not in render(found)
    found["setup"]["warm_up"] = "one start of each variant before round 0, not recorded"
    assert (
        "rounds alternated (before: commit `a`; now: commit `b`), after one start of each not recorded."
        in (render(found))
    )


def test_an_older_commits_model_files_import_its_own_package_first():
    from restart_times import own_src

    shipped = (
        '"""A model."""\n\nfrom triton_diffusion.models.model_file import serve\n\n'
        'TritonPythonModel = serve("x")\n'
    )
    patched = own_src(shipped, Path("/tmp/before/src"))
    compile(patched, "model.py", "exec")
    assert patched.startswith('"""A model."""\nimport sys\n')  # after the docstring, before any import
    lines = patched.splitlines()
    assert lines.index(
        "sys.path.insert(0, '/tmp/before/src')  # restart_times: the served commit's package"
    ) < (lines.index("from triton_diffusion.models.model_file import serve"))
