"""``scripts/gpu_checks.py``: the one prepared GPU check, kept from rotting between GPU runs.

The smoke (``--smoke``: tiny models, a few steps, on this CPU) runs every registered part through the
bench scripts' command lines, as the GPU run does, once, on a machine as the device has it
(tests/integration/test_gpu_machine_env.py, which checks every part's files there too). The budget, the
cut-short part that keeps what it wrote, the bundle for the device tool's OUT folder and a rerun of one
part are checked here with stand-in parts in seconds.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_checks  # noqa: E402
from benchmarks import BENCHMARKS  # noqa: E402
from gpu import budget, environment, parts, runner  # noqa: E402

RUNS = {benchmark.script: benchmark.name for benchmark in BENCHMARKS.values()}  # old script -> module


def stand_in(tmp_path: Path, name: str, body: str, needs: tuple = ()) -> parts.Part:
    """A part whose script writes ``<name>.json`` into its folder (two rows so far, as the bench scripts
    write after each row), then runs ``body``."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import json, sys, time\nfrom pathlib import Path\n"
        f"Path(sys.argv[1], '{name}.json')"
        ".write_text(json.dumps({'x': 1, 'rows': [1, 2], 'complete': False}))"
        f"\n{body}\n"
    )
    return parts.Part(
        name,
        f"stand-in {name}",
        lambda: [budget.Work("a second", seconds=1)],
        lambda run: [str(script), str(run.folder(name))],
        (f"{name}.json",),
        lambda folder, run: f"x={json.loads((folder / f'{name}.json').read_text())['x']}",
        needs,
    )


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    registry = [
        stand_in(tmp_path, "fast", "pass"),
        stand_in(tmp_path, "slow", "time.sleep(60)"),
        stand_in(tmp_path, "later", "pass"),
        stand_in(tmp_path, "future", "pass", needs=(("scripts/no_such_bench.py", None),)),
    ]
    monkeypatch.setattr(gpu_checks, "PARTS", registry)
    monkeypatch.setattr(gpu_checks.tempfile, "tempdir", str(tmp_path))  # the bundle's scratch folder
    monkeypatch.setattr(runner, "MIN_START_S", 0.5)
    monkeypatch.setattr(gpu_checks, "machine", lambda python, commit: {"device": "CPU", "commit": "abc"})
    monkeypatch.setattr(
        gpu_checks, "probe_imports", lambda python, scripts, smoke: None
    )  # they run at import
    return registry


def test_a_part_cut_at_the_budget_keeps_what_it_wrote_and_out_gets_a_bundle(tmp_path, monkeypatch, stand_ins):
    bundle = tmp_path / "OUT"
    bundle.mkdir()
    monkeypatch.setenv("OUT", str(bundle))
    assert gpu_checks.main(["--smoke", "--budget-s", "3"]) == 1
    assert sorted(p.name for p in bundle.iterdir()) == ["gpu_checks.tar.gz", "summary.md"]  # 8 files at most
    summary = (bundle / "summary.md").read_text()
    assert "| fast | done | " in summary and "x=1" in summary
    assert "| slow | cut short (stopped at the budget, " in summary
    assert "kept slow.json: 2 rows, incomplete" in summary
    assert "| later | not reached (" in summary
    assert "| future | not built yet (needs scripts/no_such_bench.py) |" in summary
    with tarfile.open(bundle / "gpu_checks.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"summary.md", "fast/fast.json", "slow/slow.json", "slow/log.txt"} <= names


def test_a_rerun_of_one_part_keeps_the_others_outcomes(tmp_path, monkeypatch, stand_ins):
    out = tmp_path / "figures"
    monkeypatch.delenv("OUT", raising=False)
    gpu_checks.main(["--smoke", "--budget-s", "3", "--out", str(out)])
    assert gpu_checks.main(["--smoke", "--parts", "later", "--out", str(out)]) == 1  # slow: still cut short
    summary = (out / "summary.md").read_text()
    assert "| fast | done (an earlier run) | " in summary and "| later | done | " in summary
    assert (out / "fast" / "fast.json").is_file() and (out / "later" / "later.json").is_file()


def test_each_budget_is_the_parts_forwards_at_the_step_costs_and_the_plan_fits_the_call():
    assert budget.step_seconds("sd15-512", 1) == 0.037 and budget.step_seconds("sd15-512", 8) == 0.066
    assert budget.step_seconds("sd15-512", 16) == pytest.approx(0.132)  # compute-bound above
    assert budget.step_seconds("flux1-1024", 4) == pytest.approx(4 * 0.254)  # 7.11 s / 28 steps
    assert all(point.source for points in budget.STEP_COSTS.values() for point in points)
    assert all("measured" in point.source for points in budget.STEP_COSTS.values() for point in points)
    caches = next(p for p in parts.PARTS if p.name == "step_caches")
    work = parts.step_caches_work()
    assert caches.budget() == pytest.approx(budget.MARGIN * sum(w.estimate() for w in work))
    # every forward of the step caches' run is FLUX.1's at 1024x1024: 254 ms an image
    closed = next(w for w in work if "closed loop" in w.what)
    assert closed.estimate() == pytest.approx(closed.forwards * closed.images * 0.254)
    # one call holds what the plan keeps; what it leaves out runs in the next calls, each within the limit
    calls, left = [], [p.name for p in parts.PARTS]
    while left:
        plan = budget.make_plan(parts.PARTS, left, gpu_checks.DEFAULT_BUDGET_S)
        assert 0 < plan.total <= gpu_checks.DEFAULT_BUDGET_S, left  # every part fits in a call of its own
        calls.append(list(plan.budgets))
        left = list(plan.left_out)
    # the step caches' part shares one call with slo and the checkpoint cost, in that order; mixed sizes
    # takes a third
    assert calls[1:] == [["step_caches", "slo", "checkpoint_cost"], ["mixed_sizes"]]
    assert caches.budget() < gpu_checks.DEFAULT_BUDGET_S / 2


def test_the_mixed_sizes_budget_counts_its_forwards_at_flux1_sizes():
    mixed = next(p for p in parts.PARTS if p.name == "mixed_sizes")
    work = parts.mixed_sizes_work()
    assert mixed.budget() == pytest.approx(budget.MARGIN * sum(w.estimate() for w in work))
    assert budget.estimate(work) <= 120 and mixed.budget() < 150  # one short call on one H100
    # by FLOPs: 1024x1024 is the measured step; the smaller sizes cost their share of it
    assert parts.flux1_share(1024) == pytest.approx(1.0, abs=0.01)
    assert 0.25 < parts.flux1_share(512) < parts.flux1_share(768) < 0.6
    # a packed closed loop: every row padded to 1024x1024 at most, requests x steps of them a round
    m = parts.MIXED_SIZES
    packed = next(w for w in work if "closed loop" in w.what and "packed" in w.what)
    assert packed.forwards == m["requests"] * m["steps"] and packed.model == "flux1-1024"
    assert sum("Poisson" in w.what for w in work) == 3 * m["rounds"]  # packed, by-shape, request
    # the GPU command: FLUX.1's full-size transformer in bf16 at the three sizes, mixed traffic only
    command = " ".join(mixed.command(parts.Run(Path("/out"), smoke=False)))
    assert command.startswith("bench.py mixed-sizes --arch tiny-flux --traffic mixed --flux1-size")
    assert "--sizes 512x512,768x768,1024x1024" in command and "--dtype bfloat16" in command
    assert "--loads 0.8" in command and "--rounds 2" in command


def test_the_plan_leaves_out_what_does_not_fit_and_refuses_when_nothing_does(monkeypatch, capsys):
    budgets = {p.name: p.budget() for p in parts.PARTS}
    first, second = list(budgets)[:2]
    limit = budgets[first] + 1
    plan = budget.make_plan(parts.PARTS, [first, second], limit)
    assert list(plan.budgets) == [first] and second in plan.left_out
    assert f"another call: --parts {second}" in "\n".join(plan.lines())
    assert plan.later(first) == 0

    def no_machine(*args, **kwargs):
        raise AssertionError("the plan refuses before anything starts")

    monkeypatch.setattr(gpu_checks, "machine", no_machine)
    assert gpu_checks.main(["--budget-s", "5", "--out", "/nonexistent"]) == 2
    out = capsys.readouterr()
    assert "total" in out.out and "nothing fits in --budget-s: not started" in out.err


def test_the_gpu_commands_use_flags_their_scripts_have():
    """The smoke runs the smoke's flags only: a GPU flag a script renamed would show first on the GPU."""
    run = parts.Run(Path("/nonexistent"), smoke=False)
    for part in parts.PARTS:
        if part.missing():
            continue
        script, *args = part.command(run)
        source = (SCRIPTS / script).read_text()
        if script == "bench.py" and args and not args[0].startswith("-"):  # bench.py NAME: NAME's flags
            source += (SCRIPTS / "benchmarks" / f"{args.pop(0).replace('-', '_')}.py").read_text()
        elif script in RUNS:  # a shim: the flags are its benchmark module's
            source += (SCRIPTS / "benchmarks" / f"{RUNS[script]}.py").read_text()
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, (part.name, flag)


def test_the_smoke_runs_each_part_on_one_torch_thread(monkeypatch):
    """The smoke shares two cores with the rest of the suite, where two spinning torch threads made the
    checkpoint-cost smoke's steps many times slower: its children get OMP_NUM_THREADS=1 (where it is not
    set), and a script that sets its own threads on a CPU is told 1."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert environment.child_environment(smoke=True)["OMP_NUM_THREADS"] == "1"
    run = parts.Run(Path("/nonexistent"), smoke=True)
    own_default = []
    for part in parts.PARTS:
        script, *args = part.command(run)
        source = (SCRIPTS / script).read_text()
        if script == "bench.py" and args and not args[0].startswith("-"):
            source += (SCRIPTS / "benchmarks" / f"{args[0].replace('-', '_')}.py").read_text()
        elif script in RUNS:  # a shim: its benchmark module sets the threads
            source += (SCRIPTS / "benchmarks" / f"{RUNS[script]}.py").read_text()
        if "set_num_threads(args.threads or" in source:  # a default of its own on a CPU
            own_default.append(part.name)
            assert args[args.index("--threads") + 1] == "1", part.name
    assert own_default == ["checkpoint_cost"]  # the one script with a default of its own


def test_the_family_count_is_family_invariances():
    import family_invariance

    assert parts.FAMILIES == len(family_invariance.FAMILIES)


def test_the_wheel_list_names_one_version_of_each_and_no_torch():
    pins = environment.wheel_pins()
    assert len(pins) == len(
        [line for line in environment.WHEEL_LIST.read_text().splitlines() if line.split("#")[0].strip()]
    )
    assert {"diffusers", "transformers", "requests", "huggingface_hub"} <= set(pins)
    assert not {"torch", "torchvision", "triton"} & set(pins)


def test_on_a_gpu_each_part_has_its_budget_and_a_running_part_reaches_the_bundle(
    tmp_path, monkeypatch, stand_ins
):
    """Not the smoke: the plan keeps what fits in --budget-s (each stand-in's budget is 1.25 s), names what
    it leaves out, stops the slow part at its budget, and publishes while a part's files change."""
    monkeypatch.setattr(gpu_checks, "machine", lambda python, commit: {"device": "A GPU", "commit": "abc"})
    monkeypatch.setattr(runner, "REFRESH_S", 0.3)
    seen = []
    publish = runner.publish

    def recording(run, bundle, text, info):
        seen.append({name: o.status + " " + o.detail for name, o in run.outcomes.items()})
        publish(run, bundle, text, info)

    monkeypatch.setattr(runner, "publish", recording)
    out = tmp_path / "figures"
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_checks.main(["--budget-s", "3", "--out", str(out)]) == 1
    summary = (out / "summary.md").read_text()
    assert "| fast | done | " in summary
    assert "| slow | cut short (stopped at the budget, " in summary and "2 rows, incomplete" in summary
    assert "| later | not planned (needs 1 s, 0 s left: another call, --parts later) |" in summary
    assert "| future | not built yet (needs scripts/no_such_bench.py) |" in summary
    assert any(s.get("slow", "").startswith("running kept slow.json: 2 rows") for s in seen), seen
