"""The in-process SLO benchmark's variants (scripts/benchmarks/slo.py) and its verdicts
(scripts/benchmarks/slo_figures.py), with a fake adapter and made-up rounds."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks import slo  # noqa: E402
from benchmarks.slo_figures import summarize_rounds  # noqa: E402

from tests.unit.test_step_engine import FakeAdapter  # noqa: E402


@pytest.mark.parametrize(
    ("variant", "narrowed", "refuses"),
    [("tiers-narrow", True, True), ("tiers", False, True), ("oldest", False, False)],
)
def test_the_narrow_variant_is_the_tiers_with_forwards_narrowed_and_no_other_is(variant, narrowed, refuses):
    engine = slo.engine_for(SimpleNamespace(adapter=FakeAdapter(), cap=4), variant, 8)
    assert engine.scheduler.limits.narrow_forwards is narrowed
    assert engine.scheduler.service.refuse_late is refuses


def test_an_unknown_variant_is_refused_before_anything_loads(capsys):
    with pytest.raises(SystemExit):
        slo.main(["--variants", "tiers,narrowest"])
    assert "narrowest unknown" in capsys.readouterr().err


def test_the_verdicts_read_the_first_variant_against_each_other():
    def run(attainment: float) -> dict:
        return {"interactive": {"attainment": attainment}, "background": {}}

    rounds = [
        {
            "load": 0.7,
            "round": i + 1,
            "runs": {"tiers-narrow": run(0.9), "tiers": run(0.5), "oldest": run(0.6)},
        }
        for i in range(5)
    ]
    report = {"loads": [0.7], "rounds": rounds, "config": {"variants": ["tiers-narrow", "tiers", "oldest"]}}
    summarize_rounds(report)
    assert set(report["verdicts"]) == {
        "70% load: tiers-narrow vs tiers, interactive attainment within the deadline",
        "70% load: tiers-narrow vs oldest, interactive attainment within the deadline",
    }
    assert report["verdicts"][
        "70% load: tiers-narrow vs tiers, interactive attainment within the deadline"
    ] == ("90% vs 50% (median round difference +40 points, 90% interval +40 to +40 points: better)")


def test_the_block_counts_the_narrow_variants_narrowed_forwards_over_its_rounds():
    from tables.slo import _narrowed

    def entry(load: float, narrowed: int) -> dict:
        return {"load": load, "runs": {"tiers-narrow": {"forwards": 20, "forwards_narrowed": narrowed}}}

    rounds = [entry(0.7, 1), entry(0.7, 2), entry(1.1, 5), entry(1.1, 0)]
    artefact = {"loads": [0.7, 1.1], "rounds": rounds}
    assert _narrowed(artefact).endswith("over its rounds: 70% load: 3 of 40; 110% load: 5 of 40.")
    assert _narrowed({"loads": [0.7], "rounds": [{"load": 0.7, "runs": {"tiers": {}}}]}) == ""  # none run
