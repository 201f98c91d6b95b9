"""The goodput block (scripts/benchmarks/goodput.py): degrading rows against refusing them under overload,
per load; goodput ratios read over rounds by the one verdict rule."""

from __future__ import annotations

from statistics import mean, median
from typing import Any

from verdicts import verdict

# The targets (issue: "degrade rows instead of refusing requests"): at 1.5x capacity, goodput at least
# 1.5x the tiers without degradation; at or below 0.8x, nothing degraded.
TARGET_AT_1_5 = ">= 1.5"
# The variants on the model whose door lets a request with a deadline in (deadline_room; an artefact from
# before has none).
ROOM, ROOM_DEGRADE = "tiers-room", "degrade-room"
# The goodput ratios shown, where the artefact has both: degradation against tiers without it (the
# target's, at 1.5x) on each door, what the door that lets deadlines in does, and degradation against
# first come first served.
PAIRS = (
    ("degrade", "tiers"),
    ("degrade-room", "tiers-room"),
    ("cache", "tiers"),
    ("cache-room", "tiers-room"),
    ("tiers-room", "tiers"),
    ("degrade-room", "degrade"),
    ("cache-room", "cache"),
    ("degrade", "fifo"),
    ("tiers-need", "tiers-room"),
    ("degrade-need", "degrade-room"),
    ("degrade-need", "tiers-need"),
    ("tiers-need", "fifo"),
    ("narrow-room", "tiers-room"),
)
# The variants that degrade: fewer steps (degrade), a step cache for the steps left (cache).
DEGRADING = ("degrade", ROOM_DEGRADE, "cache", "cache-room", "degrade-need")
# Each, with the variant that degrades nothing on its model.
PLAIN = {
    "degrade": "tiers",
    "cache": "tiers",
    ROOM_DEGRADE: ROOM,
    "cache-room": ROOM,
    "degrade-need": "tiers-need",
}


def room_words(c: dict) -> str:
    """The -room model's ``deadline_room``, as a multiple of the capacity (running set and waiting room)."""
    edits = c.get("model_edits", {})
    room_models = [model for variant, model in c.get("model_of", {}).items() if variant.endswith("-room")]
    room = int(edits.get(room_models[0], {}).get("deadline_room", 0)) if room_models else 0
    room = room or 6 * c["cap"]  # an artefact from before --room: 3 x, as then
    return f"{room / (2 * c['cap']):g} x its capacity"


def models_words(c: dict) -> str:
    """Whether each variant ran on a model of its own, or which shared one (the artefacts before: the
    state a run left, the load's window among it, was the next run's start on that model)."""
    by_model: dict[str, list[str]] = {}
    for variant, model in c.get("model_of", {}).items():
        by_model.setdefault(model, []).append(variant)
    shared = [" and ".join(variants) for variants in by_model.values() if len(variants) > 1]
    if not by_model:
        return ""
    if not shared:
        return "Each variant on a model of its own. "
    each = "one model" if len(shared) == 1 else "one model each"
    return f"{'; '.join(shared)} on {each} (a run starts from the state the one before it there left). "


def capacity_words(artefact: dict) -> str:
    """How the capacity was measured: on every model, their median (or on one, the artefacts before); out
    of phase (the in-step reading beside it), or in step (the artefacts before); and whether the rounds
    had arrivals of their own (the artefacts before: one sequence for every round)."""
    cap = artefact["config"]["cap"]
    rates = artefact.get("capacity_by_model")
    arrivals = (
        "each round's arrivals a sequence of its own"
        if artefact["config"].get("arrival_seeds")
        else "the same sequence of arrivals in every round"
    )
    if not rates:
        return f"closed loop at {cap} in step; {arrivals}"
    each = ", ".join(f"{rate:.2f}" for rate in rates)
    if artefact.get("capacity_rule") != "out of phase":
        return f"closed loop at {cap} in step, the median of each model's: {each}; {arrivals}"
    in_step = ", ".join(f"{rate:.2f}" for rate in artefact["capacity_in_step_by_model"])
    return (
        f"closed loop at {cap} out of phase, the workers' first requests spread over about one request's "
        f"time, the median of each model's: {each}; in step (the workers started together): {in_step}; "
        f"{arrivals}"
    )


def warm_up(c: dict) -> int:
    """The arrivals of a run not counted (an artefact from before --warm-up: the fraction it kept)."""
    return c["warm_up"] if "warm_up" in c else int(c["requests"] * c["warm_up_fraction"])


def render(artefact: dict[str, Any]) -> str:
    c = artefact["config"]
    shares = ", ".join(f"{tier} {share:g}" for tier, share in c["tier_shares"].items())
    profile = c.get("device_profile")
    model = f"{c['arch']} at {c['size']}"
    if profile:
        model = (
            f"{c['arch']} at {c['size']} on the device profile `{profile}` (its forwards and decodes take "
            "that GPU's measured times; it computes no image, so the PSNR and equality columns do not apply)"
        )
    lines = [
        f"{model}, {c['requests']} requests a run (the first "
        f"{warm_up(c)} not counted), each asking {c['steps']} steps "
        "with a deadline of "
        f"{c['deadline_scale']:g}x one request alone ({artefact['deadline_s'] * 1000:.0f} ms), tiers drawn "
        f"({shares})"
        + (
            f", a {c['no_deadline_share']:g} share of them sending no deadline (counted against one all the "
            "same)"
            if c.get("no_deadline_share")
            else ""
        )
        + "; Poisson arrivals at each load of the step engine's capacity on this traffic "
        f"({artefact['capacity']:.2f} requests/s, {capacity_words(artefact)}); {c['rounds']} rounds, the "
        f"{len(c['variants'])} variants in rotated order. "
        + models_words(c)
        + ("fifo sends no tier or deadline; " if "fifo" in c["variants"] else "")
        + "tiers sends both"
        + (" (the share above, its tier only)" if c.get("no_deadline_share") else "")
        + " (refused or ended where late)"
        + (
            f"; degrade adds min_inference_steps {c['min_inference_steps']}"
            if "degrade" in c["variants"]
            else ""
        )
        + (
            f"; cache adds degrade_step_cache {c['degrade_step_cache']} (a started request late for its "
            "deadline runs its steps left with that cache)"
            if c.get("degrade_step_cache")
            else ""
        )
        + (
            "; the -room variants are the same on models where a request with a deadline that "
            f"finds it full goes in for the scheduler to refuse or order (`deadline_room`: {room_words(c)}; "
            "the others: `deadline_room: 0`: it waits for room in execute())"
            if ROOM in c["variants"]
            else ""
        )
        + (
            "; the -need variants are the -room ones on models with `tier_pause: deadline` (a "
            "higher tier pauses a running job, or skips the admission cohort, only where the engine's "
            "estimate of its finish, waiting, is not within 90% of its time left, or while the load is "
            "shown above capacity, and always without a deadline)"
            if any(v.endswith("-need") for v in c["variants"])
            else ""
        )
        + (
            "; narrow-room is tiers-room on a model with `narrow_forwards` on (a forward holds fewer jobs "
            "where a deadline needs it and the engine's cost line prices the smaller forward within 5% a "
            "token)"
            if "narrow-room" in c["variants"]
            else ""
        )
        + ". Goodput: requests in time per second of the arrival window (refused, expired and late ones "
        "are misses). Ratios: per round, then the median and its 90% sign-test interval (the one verdict "
        "rule).",
        "",
    ]
    pairs = [p for p in PAIRS if p[0] in c["variants"] and p[1] in c["variants"]]
    ours = [v for v in DEGRADING if v in c["variants"]]
    missing = [v for v in c["variants"] if v != "fifo"]
    which = f"{' / '.join(ours)}: " if len(ours) > 1 else ""
    # The degradation columns, where a variant degrades.
    degrading = (
        f" | {which}answered degraded | steps run | PSNR to full steps (mean, lowest) | undegraded equal "
        "to their tiers'"
        if ours
        else ""
    )
    lines += [
        "| load | goodput "
        + " / ".join(c["variants"])
        + " (req/s) | "
        + " | ".join(f"{a} / {b}" for a, b in pairs)
        + degrading
        + " | "
        + " / ".join(missing)
        + ": refused, expired (of them after starting) |",
        "|---|---|" + "---|" * len(pairs) + "---|" * (4 if ours else 0) + "---|",
    ]
    for load in artefact["loads"]:
        runs = [r for r in artefact["runs"] if r["load"] == load]
        if not runs:
            continue
        rounds = _rounds(runs)
        good = {
            v: median(r[v]["goodput"] for r in rounds if v in r) for v in c["variants"] if _has(rounds, v)
        }
        cells = " / ".join(f"{good.get(v, float('nan')):.2f}" for v in c["variants"])
        ratios = " | ".join(_ratio(rounds, a, b, load if PLAIN.get(a) == b else None) for a, b in pairs)
        per = [" / ".join(x) for x in zip(*(_degraded(rounds, v, profile) for v in ours), strict=True)]
        lines.append(
            f"| {load:g}x | {cells} | {ratios} | "
            + "".join(f"{cell} | " for cell in per)
            + " / ".join(_misses(rounds, v) for v in missing)
            + " |"
        )
    rules, queue = _rules(artefact), _queue(artefact)
    lines += (
        [
            "",
            _quiet(artefact),
            *(["", queue] if queue else []),
            *(["", rules] if rules else []),
            "",
            _tiers(artefact),
        ]
        if ours
        else [
            "",
            _tiers(artefact),
        ]
    )
    if c.get("no_deadline_share"):
        lines += ["", _plain(artefact)]
    if "narrow-room" in c["variants"]:
        lines += ["", _narrowed(artefact)]
    if not artefact.get("complete", True):
        lines.insert(
            0, "**Incomplete run** (cut short: `complete` is false); the rows below are what it measured.\n"
        )
    return "\n".join(lines)


def _narrowed(artefact: dict[str, Any]) -> str:
    """The forwards narrow-room's model narrowed, per load, summed over its runs (the server's count over
    each whole run, its warm-up arrivals included)."""
    counts = []
    for load in artefact["loads"]:
        runs = [r for r in artefact["runs"] if r["load"] == load and r["variant"] == "narrow-room"]
        counts.append(f"{sum(r.get('forwards_narrowed', 0) for r in runs):.0f} at {load:g}x")
    return (
        "Forwards narrowed by narrow-room's model (the server's `triton_diffusion_forwards_narrowed_total`, "
        "over whole runs, warm-up arrivals included, summed over rounds): " + ", ".join(counts) + "."
    )


def _plain(artefact: dict[str, Any]) -> str:
    """The requests that sent no deadline (mixed traffic), in time against the same deadline, summed over
    rounds per load and variant."""
    c = artefact["config"]
    rows = [
        f"Of them, the requests that sent no deadline (a {c['no_deadline_share']:g} share, drawn; "
        f"{c['sent_no_deadline']} of {c['requests']}), in time against the same deadline:",
        "",
        "| load | " + " | ".join(c["variants"]) + " |",
        "|---|" + "---|" * len(c["variants"]),
    ]
    for load in artefact["loads"]:
        runs = [r for r in artefact["runs"] if r["load"] == load]
        cells = []
        for variant in c["variants"]:
            mine = [r["no_deadline"] for r in runs if r["variant"] == variant]
            cells.append(f"{sum(m['met'] for m in mine)}/{sum(m['offered'] for m in mine)}" if mine else "-")
        rows.append(f"| {load:g}x | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _misses(rounds: list[dict], variant: str) -> str:
    """A variant's refused and expired requests over its rounds, with how many expired after they had
    started (a cut decided before a job starts cannot reach those)."""
    runs = [r[variant] for r in rounds if variant in r]
    if not runs or any("expired_started" not in r for r in runs):
        return "-"
    refused, expired = sum(r["refused"] for r in runs), sum(r["expired"] for r in runs)
    return f"{refused}, {expired} ({sum(r['expired_started'] for r in runs)})"


def _quiet(artefact: dict[str, Any]) -> str:
    """The target below capacity: no request degraded at loads up to 0.8x (by each degrade variant)."""
    lines = []
    for variant in DEGRADING:
        low = [r for r in artefact["runs"] if r["variant"] == variant and r["load"] <= 0.8]
        if not low:
            continue
        degraded, offered = sum(r["degraded"] for r in low), sum(r["offered"] for r in low)
        word = "met" if degraded == 0 else "missed"
        why: dict[str, int] = {}
        for run in low:
            for kind, count in run.get("degraded_why", {}).items():
                if kind in RULES:
                    why[kind] = why.get(kind, 0) + count
        by_rule = "; by the rule their BATCH names: " + ", ".join(f"{k} {v}" for k, v in sorted(why.items()))
        # By load and round: whether they came in one round (a load the engine measured above what it
        # served there) or spread over them.
        by_round = "; by round: " + "; ".join(
            f"{load:g}x " + ", ".join(str(r["degraded"]) for r in sorted(runs, key=lambda r: r["round"]))
            for load in sorted({r["load"] for r in low})
            if (runs := [r for r in low if r["load"] == load])
        )
        lines.append(
            f"Target at or below 0.8x capacity, no request degraded ({variant}): **{word}** ({degraded} of "
            f"{offered} offered requests degraded in those runs{by_rule if why else ''}"
            f"{by_round if degraded else ''})." + _needed(artefact["runs"], variant, low)
        )
    return "\n\n".join(lines) or "No run at or below 0.8x capacity."


def _queue(artefact: dict[str, Any]) -> str:
    """Whether fifo's queue grew over its runs, per load: its median latency among the first and the last
    third of the counted arrivals (``latency_thirds``, the median over rounds; an artefact from before it
    says nothing). fifo answers every request at full steps, so a latency that grows is more arriving than
    the server served: the load above its capacity, whatever its nominal multiple."""
    cells = []
    for load in artefact["loads"]:
        runs = [r for r in artefact["runs"] if r["variant"] == "fifo" and r["load"] == load]
        thirds = [r["latency_thirds"] for r in runs if "latency_thirds" in r]
        firsts = [t[0] for t in thirds if t[0] is not None]
        lasts = [t[-1] for t in thirds if t[-1] is not None]
        if firsts and lasts:
            cells.append(f"{load:g}x {median(firsts):.2f} s to {median(lasts):.2f} s")
    if not cells:
        return ""
    return (
        "fifo's queue (it answers every request at full steps): its median latency among the first and the "
        "last third of the counted arrivals, the median over rounds (a latency that grows is more arriving "
        "than the server served, whatever the nominal load): " + "; ".join(cells) + "."
    )


def _needed(runs: list[dict], variant: str, low: list[dict]) -> str:
    """Whether those loads needed a cut: how many requests the same round's run without degradation (its
    pair: :data:`PLAIN`) missed, and how many of the degraded
    requests were among them (an artefact from before ``missed_requests`` says nothing)."""
    plain = PLAIN[variant]
    pairs = [
        (run, other)
        for run in low
        for other in runs
        if other["variant"] == plain and (other["load"], other["round"]) == (run["load"], run["round"])
    ]
    if not pairs or any("missed_requests" not in other for _, other in pairs):
        return ""
    missed = sum(len(other["missed_requests"]) for _, other in pairs)
    offered = sum(other["offered"] for _, other in pairs)
    late = sum(len(set(run["degraded_requests"]) & set(other["missed_requests"])) for run, other in pairs)
    degraded = sum(run["degraded"] for run, _ in pairs)
    return f" In the same rounds {plain}, which degrades nothing, missed {missed} of {offered}" + (
        f"; {late} of the {degraded} degraded requests were among them." if degraded else "."
    )


# The rules BATCH ``degraded`` names (``rules``), by the words their reasons begin with: an artefact counts
# them under the words (benchmarks/goodput.py), as it did when they were read from the reasons; a count
# under another name in an artefact is a part of a reason that names none, which an earlier parse of the
# reasons counted (those requests are counted by their rule too).
RULE_WORDS = {"overload": "overload", "room": "deadline of another image after it", "deadline": "deadline"}
RULES = tuple(RULE_WORDS.values())


def _rules(artefact: dict[str, Any]) -> str:
    """Per load, the degraded requests by the rule their BATCH names (``degraded_why``: an artefact from
    before it has none), for each degrade variant."""
    cells = []
    for variant in DEGRADING:
        for load in artefact["loads"]:
            runs = [r for r in artefact["runs"] if r["variant"] == variant and r["load"] == load]
            why: dict[str, int] = {}
            for run in runs:
                for kind, count in run.get("degraded_why", {}).items():
                    if kind in RULES:
                        why[kind] = why.get(kind, 0) + count
            if why:
                counted = ", ".join(f"{k} {v}" for k, v in sorted(why.items()))
                cells.append(f"{variant} at {load:g}x: {counted}")
    return ("Degraded, by the rule their BATCH names: " + "; ".join(cells) + ".") if cells else ""


def _rounds(runs: list[dict]) -> list[dict[str, dict]]:
    by_round: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["variant"]] = run
    return [by_round[k] for k in sorted(by_round)]


def _has(rounds: list[dict], variant: str) -> bool:
    return any(variant in r for r in rounds)


def _degraded(rounds: list[dict], variant: str, profile: object) -> tuple[str, str, str, str]:
    """A degrade variant's answered-degraded count, steps run, PSNR and undegraded-equal cells."""
    ours = [r[variant] for r in rounds if variant in r]
    offered = sum(r["offered"] for r in ours)
    degraded = sum(r["degraded"] for r in ours)
    steps = [s for r in ours for s in r["steps_run"]]
    psnrs = sorted(p for r in ours for p in r.get("psnr_degraded", []))
    same = [r["same_as_tiers"] for r in ours if "same_as_tiers" in r]
    equal = f"{sum(s['equal'] for s in same)}/{sum(s['compared'] for s in same)}" if same else "-"
    cached = [s for r in ours for s in r.get("cached_from", [])]
    return f"{degraded}/{offered}", _steps(steps, cached), "-" if profile else _psnr(psnrs), equal


def goodput_ratios(rounds: list[dict], ours: str, other: str) -> list[float]:
    """Each round's goodput of ``ours`` over ``other`` (a round where the other met nothing reads as an
    infinite gain: kept, the sign test orders rounds)."""
    return [
        r[ours]["goodput"] / r[other]["goodput"] if r[other]["goodput"] > 0 else float("inf")
        for r in rounds
        if ours in r and other in r
    ]


def at_load(artefact: dict[str, Any], load: float) -> list[dict[str, dict]]:
    """The rounds of one load: each round's runs by variant."""
    return _rounds([r for r in artefact.get("runs", []) if r["load"] == load])


def _ratio(rounds: list[dict], ours: str, other: str, load: float | None) -> str:
    values = goodput_ratios(rounds, ours, other)
    if not values:
        return "-"
    target = TARGET_AT_1_5 if load == 1.5 and ours in DEGRADING else None
    found = verdict(values, target)
    return f"**{found.median:.2f}** {found}"


def _steps(steps: list[int], cached_from: list[int] | None = None) -> str:
    if cached_from:  # given a step cache for their steps left, from these steps
        return f"a cache from step {min(cached_from)}-{max(cached_from)} (mean {mean(cached_from):.1f})"
    return "-" if not steps else f"{min(steps)}-{max(steps)} (mean {mean(steps):.1f})"


def _psnr(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{mean(values):.1f} dB, {min(values):.1f} dB (n {len(values)})"


def _tiers(artefact: dict[str, Any]) -> str:
    """Attainment per tier at each load, summed over rounds; and the share of each tier the degrade variant
    degraded (an artefact from before that count: "-")."""
    variants = artefact["config"]["variants"]
    degrading = next((v for v in DEGRADING if v in variants), None)
    rows = [
        "| load | tier | "
        + " | ".join(f"{v} in time" for v in variants)
        + (f" | {degrading}: answered degraded |" if degrading else " |"),
        "|---|---|" + "---|" * (len(variants) + (1 if degrading else 0)),
    ]
    for load in artefact["loads"]:
        runs = [r for r in artefact["runs"] if r["load"] == load]
        for tier in artefact["config"]["tier_shares"]:
            cells = []
            for variant in variants:
                mine = [r["by_tier"].get(tier) for r in runs if r["variant"] == variant]
                offered = sum(t["offered"] for t in mine if t)
                met = sum(t["met"] for t in mine if t)
                cells.append(f"{met}/{offered}" if offered else "-")
            # A round that drew none of this tier counts nothing; one from before the count shows "-".
            drawn = [t for r in runs if r["variant"] == degrading and (t := r["by_tier"].get(tier))]
            counted = [t for t in drawn if "degraded" in t]
            offered = sum(t["offered"] for t in counted)
            shown = (
                f"{sum(t['degraded'] for t in counted)}/{offered}"
                if counted and len(counted) == len(drawn)
                else "-"
            )
            rows.append(
                f"| {load:g}x | {tier} | " + " | ".join([*cells, shown] if degrading else cells) + " |"
            )
    return "\n".join(rows)
