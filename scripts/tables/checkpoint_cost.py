"""The checkpoint-cost block (scripts/benchmarks/checkpoint_cost.py): an engine step's time at each
checkpoint interval against checkpoints off, read over rounds by the one verdict rule."""

from __future__ import annotations

from statistics import median
from typing import Any

from verdicts import verdict

# The target: checkpoints cost at most 2% of an engine step.
TARGET = "<= 1.02"


def render(artefact: dict[str, Any]) -> str:
    s = artefact["settings"]
    lines = [
        f"{s['arch']} at {s['size']}x{s['size']}{_profile(artefact)}, a full running set of "
        f"{s['running']} jobs of {s['steps']} steps (one finished is replaced at once), "
        f"{_design(artefact)} Ratio: the mean engine step against the same round's with checkpoints off; its "
        "reading by the one verdict rule (the median's 90% sign-test interval against the target "
        f"{TARGET}).",
        "",
        "| checkpoint_every_steps | engine step ms | / off | bytes a checkpoint | reading |",
        "|---|---|---|---|---|",
    ]
    for row in artefact["summary"]:
        ratio = row["ratio_to_off"]
        if row["interval"] == 0:
            lines.append(f"| off | {row['step_ms_median']:.2f} | 1 | - | |")
            continue
        found = verdict(_rounds(artefact, row["interval"]), TARGET)
        lines.append(
            f"| {row['interval']} | {row['step_ms_median']:.2f} | **{ratio['median']:.3f}** "
            f"| {row['bytes_per_checkpoint']:.0f} | {found} |"
        )
    return "\n".join(lines)


def render_against(artefact: dict[str, Any]) -> str:
    """``checkpoint-cost --against REV``: this commit's store and REV's, alternated block by block."""
    s = artefact["settings"]
    rev = s["against"]
    design = _design(
        artefact,
        "with checkpoints off and at each interval with each store",
        "a warm-up with each store in turn",
    )
    lines = [
        f"{s['arch']} at {s['size']}x{s['size']}{_profile(artefact)}, a full running set of "
        f"{s['running']} jobs of {s['steps']} steps, with the checkpoint store of the commit this was taken "
        f"at and of commit `{rev}` (its modules read from git, run beside the other's on the same engine, "
        f"each store in a folder of its own); "
        f"{design} Per "
        f"round and store, the mean engine step against the same round's with checkpoints off (the two "
        f"middle columns: medians over rounds); "
        f"then the first store's ratio over `{rev}`'s in the same round (the median of those quotients, not "
        f"the quotient of the medians; below 1: it costs less), read against 1.",
        "",
        f"| checkpoint_every_steps | / off, this store | / off, `{rev}` | this / `{rev}` | reading |",
        "|---|---|---|---|---|",
    ]
    for row in artefact["summary"]:
        if row["interval"] == 0:
            continue
        that = _rounds(artefact, row["interval"], rev)
        found = verdict(row["against"], None, higher_is_better=False)
        lines.append(
            f"| {row['interval']} | **{row['ratio_to_off']['median']:.3f}** | **{median(that):.3f}** "
            f"| **{found.median:.3f}** | {found} |"
        )
    return "\n".join(lines)


def _design(artefact: dict[str, Any], variants: str = "at each interval", warm_up: str = "a warm-up") -> str:
    """How the intervals were alternated: in blocks on one engine a round, or (an artefact from before
    blocks) a run each."""
    s = artefact["settings"]
    if "block" not in s:
        return (
            f"{s['engine_steps']} engine steps a run after a warm-up, {s['rounds']} alternated rounds; the "
            "checkpoints written by a real checkpoint store on its own thread while the engine steps on."
        )
    return (
        f"{s['rounds']} rounds, each a fresh engine: after {warm_up}, {s['engine_steps']} engine steps "
        f"{variants}, in blocks of {s['block']} alternated in {_order(artefact)}; the checkpoints written, "
        "and an answered request's removed, by a real checkpoint store on its own thread, which gathers "
        f"them for up to {artefact['store_batch_s']:g} s before it writes a batch; what it has left of a "
        "block's work "
        "when the block ends is waited for within the block (disk waits included, where served they would "
        "overlap later steps; in a block shorter than the gathering, every write); requests answered in a "
        "block without a store's checkpoints have their removal from it made in its next block."
    )


def _order(artefact: dict[str, Any]) -> str:
    if artefact.get("block_order") == "balanced":
        return (
            "orders balanced for what a block leaves to the next (within the orders of each whole cycle, "
            "each variant after each other equally often; not at the joins between orders)"
        )
    return "rotated order"


def _profile(artefact: dict[str, Any]) -> str:
    """How the run was timed, where a device profile timed its denoiser and decode."""
    table = artefact.get("device_profile_table")
    if not table:
        return ""
    decodes = table.get("decodes", {}).get("source", {}).get("artefact")  # a profile's of another's
    where = table["source"]["artefact"] + (f"; its decodes in {decodes}" if decodes else "")
    return (
        f" under the device profile {artefact['device_profile']} (the denoiser and VAE decode wait the times "
        f"given for {table['what']}, in {where}, and compute nothing; the rest runs at this CPU's speed; "
        "latents in float32; adapters/device_profiles.py)"
    )


def step_ratios(runs: list[dict], interval: int, store: str = "this") -> dict[int, float]:
    """By round, the mean engine step at ``interval`` with ``store`` (this commit's, or the commit's an
    ``--against`` artefact ran beside it) over the same round's with checkpoints off; a round without both
    left out (cut short). Off: one a round for every store (store None), or, in an artefact of a run per
    store, each one's own; a run without a store (an artefact from before ``--against``) is this one's."""

    def of_store(run: dict) -> bool:  # off's store None: shared (an interval's run always names one)
        return run.get("store", "this") in (None, store)

    off = {r["round"]: r["step_s_mean"] for r in runs if r["interval"] == 0 and of_store(r)}
    return {
        r["round"]: r["step_s_mean"] / off[r["round"]]
        for r in runs
        if r["interval"] == interval and of_store(r) and r["round"] in off
    }


def _rounds(artefact: dict[str, Any], interval: int, store: str = "this") -> list[float]:
    return list(step_ratios(artefact["runs"], interval, store).values())


def sentence(artefact: dict[str, Any], *at_profiles: dict[str, Any]) -> str:
    """What checkpoints cost, said where they are turned on: each measured interval's engine step against
    checkpoints off, with its reading, on the CPU and at each device profile given."""

    def readings(one: dict[str, Any]) -> str:
        parts = []
        for row in one["summary"]:
            if row["interval"] == 0:
                continue
            found = verdict(_rounds(one, row["interval"]), TARGET)
            steps = f"{row['interval']} step{'s' * (row['interval'] != 1)}"
            parts.append(f"every {steps}: **{row['ratio_to_off']['median']:.3f}x** ({found})")
        return "; ".join(parts)

    s = artefact["settings"]
    text = (
        "Checkpoints are **off by default** (no `checkpoint_every_steps`). What they cost, measured on "
        f"{s['arch']} at {s['size']}x{s['size']} with {s['running']} running jobs on a CPU (an engine step "
        f"with checkpoints against the same round's without, target {TARGET}): {readings(artefact)}."
    )
    for one in at_profiles:
        p = one["settings"]
        step_ms = next(row["step_ms_median"] for row in one["summary"] if row["interval"] == 0)
        text += (
            f" At the `{one['device_profile']}` device profile's cost ratios ({p['arch']} at "
            f"{p['size']}x{p['size']}, its denoiser and decode waiting the times the profile gives for an "
            f"H100; an engine step with checkpoints off took {step_ms:.0f} ms here): {readings(one)}."
        )
    return text
