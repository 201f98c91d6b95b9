"""The in-process SLO benchmark's variants (scripts/benchmarks/slo.py) and its verdicts
(scripts/benchmarks/slo_figures.py), with a fake adapter and made-up rounds."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks import slo  # noqa: E402
from benchmarks.slo_figures import Item, summarize_rounds  # noqa: E402

from tests.unit.recording import tracked  # noqa: E402
from tests.unit.test_step_engine import FakeAdapter, Spec  # noqa: E402
from triton_diffusion.engine.jobs import Forward, Job, StepReport  # noqa: E402


@pytest.mark.parametrize(
    ("variant", "narrowed", "refuses"),
    [("tiers-narrow", True, True), ("tiers", False, True), ("oldest", False, False)],
)
def test_the_narrow_variant_is_the_tiers_with_forwards_narrowed_and_no_other_is(variant, narrowed, refuses):
    """Its engine narrows and refuses late jobs (as the tiers' does) and its jobs carry the interactive
    class's tier and deadline (as the tiers' do); first come, first served's neither."""
    engine = slo.engine_for(SimpleNamespace(adapter=FakeAdapter(), cap=4), variant, 8)
    assert engine.scheduler.limits.narrow_forwards is narrowed
    assert engine.scheduler.service.refuse_late is refuses

    def made(index, values, engine):
        return Job(tracked(f"r{index}"), Spec(steps=4), planned_steps=4, shape="64x64", tokens=1)

    item = Item(True, {"num_inference_steps": 4}, slo_s=2.0)
    job = slo.job(SimpleNamespace(job=made), 0, item, variant, 100.0, True)
    assert (job.spec.tier, job.spec.deadline) == ((slo.PRIORITY, 102.0) if refuses else (slo.DEFAULT, None))


def test_a_run_counts_its_forwards_and_those_narrowed():
    """Forwards narrowed count once each, whatever they left out."""
    outcomes = slo.Outcomes()
    recorder = slo.SloRecorder(SimpleNamespace(), outcomes)
    forwards = [Forward(2, 2, 0.1, narrowed=3), Forward(4, 4, 0.1), Forward(1, 1, 0.1, narrowed=1)]
    recorder.render(StepReport(forwards=forwards))
    assert (outcomes.forwards, outcomes.narrowed) == (3, 2)


def test_an_unknown_variant_is_refused_before_anything_loads(capsys):
    """A misspelt variant ends the run before the model loads, naming it."""
    with pytest.raises(SystemExit):
        slo.main(["--variants", "tiers,narrowest"])
    assert "narrowest unknown" in capsys.readouterr().err


def test_the_verdicts_read_the_first_variant_against_each_other():
    """The config's first variant against each other one, whatever order a round ran them in (rotated)."""

    def run(attainment: float) -> dict:
        return {"interactive": {"attainment": attainment}, "background": {}}

    order = ["tiers-narrow", "tiers", "oldest"]
    attainment = {"tiers-narrow": 0.9, "tiers": 0.5, "oldest": 0.6}
    rounds = []
    for i in range(5):
        ran = order[i % 3 :] + order[: i % 3]
        rounds.append({"load": 0.7, "round": i + 1, "runs": {v: run(attainment[v]) for v in ran}})
    report = {"loads": [0.7], "rounds": rounds, "config": {"variants": order}}
    summarize_rounds(report)
    assert set(report["verdicts"]) == {
        "70% load: tiers-narrow vs tiers, interactive attainment within the deadline",
        "70% load: tiers-narrow vs oldest, interactive attainment within the deadline",
    }
    assert report["verdicts"][
        "70% load: tiers-narrow vs tiers, interactive attainment within the deadline"
    ] == ("90% vs 50% (median round difference +40 points, 90% interval +40 to +40 points: better)")


def test_the_block_counts_the_narrow_variants_narrowed_forwards_over_its_rounds():
    """Summed over its rounds at each load; nothing where no run of it counted them."""
    from tables.slo import _narrowed

    def entry(load: float, narrowed: int) -> dict:
        return {"load": load, "runs": {"tiers-narrow": {"forwards": 20, "forwards_narrowed": narrowed}}}

    rounds = [entry(0.7, 1), entry(0.7, 2), entry(1.1, 5), entry(1.1, 0)]
    artefact = {"loads": [0.7, 1.1], "rounds": rounds}
    assert _narrowed(artefact).endswith("warm-up included): 70% load: 3 of 40; 110% load: 5 of 40.")
    assert _narrowed({"loads": [0.7], "rounds": [{"load": 0.7, "runs": {"tiers": {}}}]}) == ""  # none run
