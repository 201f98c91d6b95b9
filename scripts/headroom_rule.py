"""Read the step engine's headroom and overload rules (engine/overload.py) on simulated arrivals: how
often, at a steady Poisson load, the engine reads no headroom (the deadline rule may degrade) or an
overload shown (the load's cut acts), and after how many arrivals of a rise from a quiet spell it stops
reading headroom. The real ``OfferedLoad``, fed arrivals and full forwards on a simulated clock (no model,
no server), so this is the rule's statistics, not a measurement of serving. Writes the artefact the
headroom table of docs/design/degradation.md is rendered from.

    .venv/bin/python scripts/headroom_rule.py [--out docs/design/headroom_rule.json]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "src"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from artefacts import write  # noqa: E402

from triton_diffusion.engine.overload import Arrival, OfferedLoad  # noqa: E402

# The engine serves 20 token-steps a second (forwards of 2 every 0.1 s); every job asks 10 (0.5 s).
STEP_S, FORWARD_WORK, JOB_WORK = 0.1, 2, 10
JOB_S = JOB_WORK / (FORWARD_WORK / STEP_S)
LOADS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5)


def engine() -> OfferedLoad:
    """An ``OfferedLoad`` that has seen enough full forwards to tell (its rate: 20 token-steps a second)."""
    offered = OfferedLoad()
    for i in range(offered.forwards.maxlen or 0):
        offered.served(i * STEP_S, FORWARD_WORK, 0.0, True)
    return offered


def steady(load: float, images: int, arrivals: int, seed: int) -> dict[str, float]:
    """Poisson requests of ``images`` jobs each at ``load`` x what the engine serves: the share of
    requests (after a full window) at whose arrival it reads no headroom, and shows an overload."""
    rng, offered, now = random.Random(seed), engine(), 0.0
    window = offered.arrivals.maxlen or 0
    no_headroom = overload = counted = 0
    for request in range(arrivals // images):
        now += rng.expovariate(load / (JOB_S * images))
        for _ in range(images):
            offered.arrived(Arrival(now, f"r{request}", 2, JOB_WORK, JOB_WORK - 2))
        if request * images >= window:
            counted += 1
            if not offered.headroom(now, 0.0):  # as the engine's next step reads it (an overload: none)
                no_headroom += 1
                overload += offered.overload(now, 0.0) is not None
    return {"no_headroom": no_headroom / counted, "overload": overload / counted, "requests": counted}


def rise(load: float, quiet: float = 0.3, most: int = 400) -> int | None:
    """After a full window of evenly spaced single-image requests at ``quiet`` x, the arrival of a rise to
    ``load`` x (evenly spaced) at which the engine first reads no headroom (None: not within ``most``)."""
    offered, now = engine(), 0.0
    for i in range(offered.arrivals.maxlen or 0):
        now += JOB_S / quiet
        offered.arrived(Arrival(now, f"q{i}", 2, JOB_WORK, JOB_WORK - 2))
    for i in range(1, most + 1):
        now += JOB_S / load
        offered.arrived(Arrival(now, f"r{i}", 2, JOB_WORK, JOB_WORK - 2))
        if not offered.headroom(now, 0.0):
            return i
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "docs/design/headroom_rule.json"))
    parser.add_argument("--arrivals", type=int, default=40_000, help="simulated arrivals a load")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    artefact = {
        "benchmark": "headroom_rule",
        "config": {"window": OfferedLoad().arrivals.maxlen, "arrivals": args.arrivals, "seed": args.seed},
        "steady": [
            {"load": load, "images": images, **steady(load, images, args.arrivals, args.seed)}
            for images in (1, 4)
            for load in LOADS
        ],
        "rise": [{"from": 0.3, "to": load, "arrival": rise(load)} for load in (1.2, 1.3, 1.4, 1.5, 2.0, 4.0)],
    }
    print(write(args.out, artefact))


if __name__ == "__main__":
    main()
