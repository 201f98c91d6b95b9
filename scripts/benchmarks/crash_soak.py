"""Crash soak (issue 43, "a crash loses no work"): a model's Python backend process killed every
--crash-every seconds under Poisson traffic, with the launcher's supervisor bringing the server back and the
project client resending each lost request with its resume key. How much work does a crash cost, with job
checkpoints and without?

Variants (each on a server of its own: the launcher with its supervisor, one tiny-sd ``text_to_image``):
  checkpoints  ``checkpoint_every_steps`` --checkpoint-every (2) and a ``checkpoint_dir`` in a temporary
               folder: a request resent with the same resume key resumes from its last checkpoint
  none         no checkpoints: a resent request runs again from step 0
A server whose settings do not read the ``checkpoint_*`` parameters (a tree before them: an unknown
parameter is a load error) cannot run ``checkpoints``: it is skipped, with the reason in the artefact.

Each of --rounds rounds runs every variant back to back, in rotated order (checkpoints, none; none,
checkpoints; ...), and reads scripts/verdicts.py's verdict over the rounds: the goodput ratio checkpoints /
none and the steps recomputed per crash that checkpoints saved. A run:
Poisson arrivals at --rate requests/s for --duration seconds (default: --load of the rate one request at a
time can be served, measured on the first server before any run: one request of --steps steps alone takes
``s`` seconds, the rate is ``load / s``, so the server is busy about that share of the time); every run has
the same requests (prompt and seed by index) and the same arrivals (--arrival-seed), or with
--arrivals-per-round a round's own (seed --arrival-seed + the round: both variants of a round see the same,
and the rounds are independent draws for the verdict's interval). Every request goes through the
project client (triton_diffusion_client.ImageSession) with retry (--retries resends within --timeout) and
progress on, so the client sees the last step each attempt reached. The model's stub is killed (SIGKILL)
every --crash-every seconds from the start (before the end of --duration), each time once the server is
ready again (the supervisor restarts it; readiness is polled) and, with --mid-job N, once a request in
flight has computed N steps (or after 60 s without one): a kill that hits work. A kill held back by either
moves the next: kills are at least --crash-every apart, and one that could not be made before the end of
--duration is not made.

Per run: requests offered, completed (an answer within --timeout of the arrival), lost (offered minus
completed: a miss), goodput (completed images per second from the first arrival to the end of the run or the
last answer, the later), crashes, mean and p95 latency of the completed ones (from the scheduled arrival),
and steps recomputed per crash: for each request sent more than once, the step each failed attempt had
reached minus the step the next attempt resumed from (the final attempt's ``resumed_from_step`` in its BATCH
output, 0 where absent; an earlier resumed attempt's first progress step minus one), summed over the run,
divided by its crashes. Every run is kept in --out/crash_soak.json (written after each run), with its
per-request records; its summary gives the median over rounds with min and max.

With --device-profile NAME the model's denoiser and decode take the time a GPU took (adapters/
device_profiles.py; --size becomes the profile's): a crash's recomputed steps cost what they would there,
while the restart is this machine's.

Defaults: 2 rounds of 2 variants of 240 s with a crash every 60 s: about 20 minutes on this project's 2-core
CPU host (each run adds a server start and the requests still in flight at its end):

    .venv/bin/python scripts/bench.py crash-soak --out docs/cpu
    .venv/bin/python scripts/bench.py crash-soak --variants none --rounds 1 --duration 40 --crash-every 20 \\
        --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import artefacts
from tables.crash_soak import render
from triton_diffusion_client import ImageSession
from triton_diffusion_client.retry import unknown_resume_key
from triton_diffusion_client.streams import ResponseError
from verdicts import rotated_orders

from benchmarks.arrivals import poisson_arrivals
from benchmarks.common import PROMPTS, REPO_ROOT, benchmark_parser
from benchmarks.crash_figures import paired_verdicts, run_figures, summarise
from triton_diffusion.adapters.device_profiles import PROFILES, load_costs, profiles_for
from triton_diffusion.serving.server_process import WEIGHTS, copy_model, start_server
from triton_diffusion.serving.supervisor import list_stubs
from triton_diffusion.settings import IMAGE, IMAGE_SOURCE, ModelConfig
from triton_diffusion.tiny_models import build_missing

MODEL = "text_to_image"
CONFIG_KINDS = (IMAGE, IMAGE_SOURCE)  # what text_to_image reads (models/text_to_image.py CONFIG_KINDS)
VARIANTS = ("checkpoints", "none")
READY_WAIT_S = 180.0  # a server that is not ready again within this is a failure of the run, not a wait
# How long a --mid-job kill waits for a request in flight to reach its step before killing anyway.
MID_JOB_WAIT_S = 60.0


# ---- the client: every attempt's steps -------------------------------------------------------------------


@dataclass(eq=False)
class Attempt:
    start: int | None = None  # its first progress step minus one
    reached: int | None = None  # the highest progress step it reported
    error: str | None = None


# The attempts under way (their answer not in): what a crash would hit (Crasher's --mid-job).
IN_FLIGHT: set[Attempt] = set()
IN_FLIGHT_LOCK = threading.Lock()


class AttemptSession(ImageSession):
    """The project's image session, noting each attempt (each ``responses`` call the retry loop makes) and
    the steps it reported. An attempt refused for its resume key by a server from before resume keys (the
    client resends it at once without one) is no attempt of the request's: it is dropped."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(url, model)
        self.attempts: list[Attempt] = []

    def responses(self, tensors, parameters, request_id, timeout_s=300.0):  # type: ignore[override]
        attempt = Attempt()
        self.attempts.append(attempt)
        with IN_FLIGHT_LOCK:
            IN_FLIGHT.add(attempt)
        try:
            with closing(super().responses(tensors, parameters, request_id, timeout_s)) as inner:
                for response in inner:
                    step = response.scalar("STEP")
                    if step is not None:
                        step = int(step)
                        attempt.start = step - 1 if attempt.start is None else attempt.start
                        attempt.reached = max(step, attempt.reached or 0)
                    yield response
        except ResponseError as error:
            if unknown_resume_key(error.message):
                self.attempts.remove(attempt)
            else:
                attempt.error = str(error)[:200]
            raise
        except TimeoutError as error:
            attempt.error = str(error)[:200]
            raise
        finally:
            with IN_FLIGHT_LOCK:
                IN_FLIGHT.discard(attempt)


def request_for(index: int, steps: int, size: int) -> dict[str, Any]:
    return {
        "prompt": PROMPTS[index % len(PROMPTS)],
        "seed": index,
        "height": size,
        "width": size,
        "num_inference_steps": steps,
    }


def send(url: str, index: int, args: argparse.Namespace, arrival: float) -> dict[str, Any]:
    """Send request ``index`` (scheduled at ``arrival``, a perf_counter time) with retry and progress on;
    its record. Its latency runs from the scheduled arrival."""
    with AttemptSession(url, MODEL) as session:
        result = session.generate(
            request_for(index, args.steps, args.size),
            f"crash-{index}",
            args.timeout,
            on_progress=lambda progress: None,
            retries=args.retries,
        )
        attempts = list(session.attempts)
    return {
        "index": index,
        "ok": result.ok and not result.cancelled,
        "error": None if result.error is None else result.error[:200],
        "latency_s": time.perf_counter() - arrival,
        "images": len(result.images),
        "attempts": [{"start": a.start, "reached": a.reached, "error": a.error} for a in attempts],
        "resumed_from_step": (result.batch or {}).get("resumed_from_step"),
        "resume_key": result.resume_key is not None,
    }


# ---- the server: start, readiness, crashes, stop ------------------------------------------------------


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def server_ready(server) -> bool:
    """The supervisor says ready (not restarting) and Triton says the model is ready."""
    return _answers(f"{server.health_url}/readyz") and _answers(f"{server.http_url}/v2/models/{MODEL}/ready")


def wait_until(condition, timeout_s: float, stop: threading.Event | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if stop is not None and stop.is_set():
            return False
        time.sleep(0.2)
    return condition()


class Crasher(threading.Thread):
    """Kills the model's stub at each time of ``at`` (seconds from ``started``, a perf_counter time), each
    once the server is ready (polled), and times how long the server takes to be ready again. With
    ``mid_job`` steps, each kill also waits (up to ``MID_JOB_WAIT_S``, then kills anyway) until some
    attempt in flight has computed at least that many steps (counted from where it started: a resumed
    attempt's first report is past its checkpoint), so that a kill hits work where there is any (a
    kill at an idle moment recomputes nothing with or without checkpoints). Each kill records the steps
    the attempts in flight had reported and whether it waited in vain (``mid_job`` false)."""

    def __init__(
        self,
        server,
        at: list[float],
        started: float,
        mid_job: int = 0,
        min_gap_s: float = 0.0,
        end_s: float = float("inf"),
    ) -> None:
        super().__init__(daemon=True)
        self.server, self.at, self.started, self.mid_job = server, at, started, mid_job
        # A kill held back (by readiness or --mid-job) moves the next one too: kills stay this far apart,
        # and one that would come at ``end_s`` (the arrivals' end) or later is not made (both variants of
        # a round then crash only while requests arrive).
        self.min_gap_s, self.end_s = min_gap_s, end_s
        self.kills: list[dict[str, Any]] = []
        self.failure: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        last_kill = -float("inf")
        for at in self.at:
            when = max(self.started + at, last_kill + self.min_gap_s)
            if when >= self.started + self.end_s:
                return
            if self.stop.wait(max(0.0, when - time.perf_counter())):
                return
            if not wait_until(lambda: server_ready(self.server), READY_WAIT_S, self.stop):
                self.failure = self.failure or f"the server was not ready {READY_WAIT_S:.0f} s after {at} s"
                return
            hit = None
            if self.mid_job > 0:
                hit = wait_until(lambda: self._reached() >= self.mid_job, MID_JOB_WAIT_S, self.stop)
                if self.stop.is_set():
                    return  # the run is over: no kill after its traffic
            if time.perf_counter() >= self.started + self.end_s:
                return  # held back past the arrivals by the waits above
            stubs = [s for s in list_stubs(self.server.process.pid) if s.model == MODEL]
            if not stubs:
                self.failure = f"no stub of {MODEL} to kill at {at} s"
                return
            with IN_FLIGHT_LOCK:
                at_risk = sorted((a.reached or 0 for a in IN_FLIGHT), reverse=True)
            killed = last_kill = time.perf_counter()
            for stub in stubs:
                os.kill(stub.pid, signal.SIGKILL)
            # The supervisor notices within its interval (0.5 s) and reports not ready: wait for that first,
            # so the readiness that follows is the restarted server's.
            wait_until(lambda: not server_ready(self.server), 10.0, self.stop)
            back = wait_until(lambda: server_ready(self.server), READY_WAIT_S, self.stop)
            self.kills.append(
                {
                    "at_s": round(killed - self.started, 2),
                    "recovery_s": round(time.perf_counter() - killed, 2) if back else None,
                    "steps_in_flight": at_risk,  # the step each attempt under way had reported
                    "mid_job": hit,  # None: kills at their scheduled times
                }
            )
            if not back:
                self.failure = (
                    f"the server was not ready again {READY_WAIT_S:.0f} s after the crash at {at} s"
                )
                return

    @staticmethod
    def _reached() -> int:
        with IN_FLIGHT_LOCK:
            # Steps this attempt computed (a resumed attempt's first report is past its checkpoint).
            return max(((a.reached or 0) - (a.start or 0) for a in IN_FLIGHT), default=0)


def checkpoint_edits(variant: str, folder: Path, every: int) -> dict[str, str]:
    if variant == "none":
        return {}
    return {"checkpoint_every_steps": str(every), "checkpoint_dir": str(folder / "checkpoints")}


def unreadable(edits: dict[str, str]) -> str | None:
    """Why this tree's server would refuse these config parameters at load (settings.py reads them as the
    model does), or None. A variant the server cannot load is skipped: its server would never be ready."""
    try:
        ModelConfig.parse(edits, CONFIG_KINDS, (), MODEL)
    except ValueError as exc:
        return str(exc)
    return None


def ended(server) -> bool:
    """Nothing is left of the server's process group (the launcher, tritonserver, its stubs)."""
    try:
        os.killpg(server.process.pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextmanager
def running_server(edits: dict[str, str], folder: Path, steps: int, profile: str | None) -> Iterator[Any]:
    """A launcher (its supervisor in charge) serving one tiny-sd text_to_image with ``edits``; stopped on the
    way out, its whole process group gone (polled, then SIGKILL) whatever happened."""
    repo = folder / "repo"
    repo.mkdir()
    # The shipped config allows 50 steps; a soak of long jobs asks for more (the field allows 150).
    allowed = {"max_num_inference_steps": str(steps)} if steps > 50 else {}
    profiled = {"device_profile": profile} if profile else {}
    copy_model(MODEL, repo, MODEL, {"model": str(WEIGHTS / "tiny-sd"), **allowed, **profiled, **edits})
    # --drain-s=0: the run is over when it stops, nothing to hand over.
    server = start_server(repo, folder / "tritonserver.log", [MODEL], extra_args=["--drain-s=0"])
    try:
        yield server
    finally:
        server.stop()
        if not wait_until(lambda: ended(server), 30.0):
            try:
                os.killpg(server.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_until(lambda: ended(server), 10.0)


def solo_latency(server, args: argparse.Namespace, count: int = 3) -> float:
    """Seconds one request takes alone (the median of ``count``, one after another, after a warm one)."""
    latencies = []
    for i in range(count + 1):
        arrival = time.perf_counter()
        record = send(server.grpc_url, 1_000_000 + i, args, arrival)
        if not record["ok"]:
            raise RuntimeError(f"a request alone failed: {record['error']}")
        if i:
            latencies.append(record["latency_s"])
    return statistics.median(latencies)


def measure(
    server, args: argparse.Namespace, arrivals: list[float]
) -> tuple[list[dict], int, Crasher, float]:
    """The traffic and the crashes on a ready server: the requests' records, the hung ones, the crasher,
    and the run's wall time (the last thread's end)."""
    with IN_FLIGHT_LOCK:
        IN_FLIGHT.clear()  # a client thread of an earlier run still retrying is not this run's work
    send(server.grpc_url, 2_000_000, args, time.perf_counter())  # warm: the first request loads everything
    records: list[dict | None] = [None] * len(arrivals)
    started = time.perf_counter()
    crash_times = [k * args.crash_every for k in range(1, int(args.duration / args.crash_every) + 1)]
    crasher = Crasher(
        server, crash_times, started, args.mid_job, min_gap_s=args.crash_every, end_s=args.duration
    )

    def one(index: int, at: float) -> None:
        time.sleep(max(0.0, started + at - time.perf_counter()))
        record = send(server.grpc_url, index, args, started + at)
        records[index] = {**record, "arrival_s": round(at, 3)}

    threads = [threading.Thread(target=one, args=(i, at), daemon=True) for i, at in enumerate(arrivals)]
    crasher.start()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + args.duration + args.timeout + 30
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    crasher.stop.set()
    crasher.join(timeout=READY_WAIT_S + 20)
    wall = time.perf_counter() - started
    done = [r for r in records if r is not None]
    return done, len(records) - len(done), crasher, wall


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, "crash-soak")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of checkpoints, none")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (each runs every variant)")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of arrivals per run")
    parser.add_argument("--crash-every", type=float, default=60.0, help="kill the model's stub this often")
    parser.add_argument("--steps", type=int, default=16, help="num_inference_steps of every request")
    parser.add_argument(
        "--mid-job",
        type=int,
        default=0,
        help="each kill waits (up to 60 s) until a request in flight has computed this many steps (0: kill "
        "at the scheduled time, busy or not)",
    )
    parser.add_argument("--size", type=int, default=64, help="height and width of every request")
    parser.add_argument("--load", type=float, default=0.5, help="the rate as a share of one-at-a-time")
    parser.add_argument("--rate", type=float, help="requests/s (instead of --load's measured rate)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="client deadline per request, resends in"
    )
    parser.add_argument("--retries", type=int, default=3, help="resends per request (the client's default)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=2, help="checkpoint_every_steps (checkpoints)"
    )
    parser.add_argument("--arrival-seed", type=int, default=1)
    parser.add_argument(
        "--arrivals-per-round",
        action="store_true",
        help="draw each round's arrivals (seed --arrival-seed + the round) rather than one draw for all",
    )
    parser.add_argument(
        "--device-profile",
        choices=profiles_for("StableDiffusionPipeline"),
        help="a GPU's forward and decode times",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose from {list(VARIANTS)}")
    if args.rounds < 1 or args.duration <= 0 or args.crash_every <= 0 or args.steps < 1:
        parser.error("--rounds, --duration, --crash-every and --steps must be positive")
    if args.mid_job >= args.steps:
        parser.error("--mid-job must be below --steps (a request reports no step past its last)")

    if args.device_profile:
        args.size = load_costs(PROFILES[args.device_profile]).size[0]  # where its times hold
    build_missing(WEIGHTS, only=["tiny-sd"])
    report: dict[str, Any] = {
        "benchmark": "crash-soak",
        "settings": {
            "model": f"tiny-sd {MODEL}"
            + (f" at the {args.device_profile} device profile" if args.device_profile else ""),
            "device_profile": args.device_profile,
            **{
                k: getattr(args, k)
                for k in (
                    "rounds",
                    "duration",
                    "crash_every",
                    "steps",
                    "size",
                    "load",
                    "timeout",
                    "retries",
                    "checkpoint_every",
                    "arrival_seed",
                    "arrivals_per_round",
                    "mid_job",
                )
            },  # fmt: skip
            "mid_job_wait_s": MID_JOB_WAIT_S if args.mid_job else None,
            "variants": variants,
            "rate_per_s": args.rate,
            "solo_latency_s": None,
        },
        "variants": {},
        "runs": [],
        "summary": [],
        "complete": False,  # until the last run: a run cut short keeps what it measured
        "provenance": artefacts.provenance(),
    }
    path = args.out / "crash_soak.json"
    for variant in variants:
        why = unreadable(checkpoint_edits(variant, Path(tempfile.gettempdir()), args.checkpoint_every))
        report["variants"][variant] = {"skipped": why}
        if why is not None:
            print(
                f"crash-soak: variant {variant!r} skipped: this tree's server cannot load its config "
                f"({why}); it needs the checkpoint_* model parameters (issue 43)",
                file=sys.stderr,
                flush=True,
            )
    runnable = [v for v in variants if report["variants"][v]["skipped"] is None]
    if not runnable:
        artefacts.write(path, report)
        sys.exit("crash-soak: no variant can run on this tree")

    started = time.perf_counter()
    arrivals: list[float] = []
    for round_, order in enumerate(rotated_orders(runnable, args.rounds)):
        seed = args.arrival_seed + round_ if args.arrivals_per_round else args.arrival_seed
        if args.arrivals_per_round:
            arrivals = []  # drawn again below, once the rate is known
        for variant in order:
            with tempfile.TemporaryDirectory(prefix=f"crash-soak-{variant}-") as tmp:
                folder = Path(tmp)
                edits = checkpoint_edits(variant, folder, args.checkpoint_every)
                with running_server(edits, folder, args.steps, args.device_profile) as server:
                    if report["settings"]["rate_per_s"] is None:
                        solo = solo_latency(server, args)
                        report["settings"]["solo_latency_s"] = solo
                        report["settings"]["rate_per_s"] = args.load / solo
                    if not arrivals:
                        rate = report["settings"]["rate_per_s"]
                        drawn = poisson_arrivals(int(rate * args.duration * 2) + 20, rate, seed)
                        arrivals = [at for at in drawn if at < args.duration]
                    print(
                        f"[round {round_} {variant}: {len(arrivals)} requests at "
                        f"{report['settings']['rate_per_s']:.2f}/s over {args.duration:.0f} s, a crash every "
                        f"{args.crash_every:.0f} s]",
                        flush=True,
                    )
                    records, hung, crasher, wall = measure(server, args, arrivals)
                gone = ended(server)
            run = {
                "variant": variant,
                "round": round_,
                "arrival_seed": seed,
                **run_figures(records, len(crasher.kills), args.duration, hung),
                "kills": crasher.kills,
                "crash_failure": crasher.failure,
                "wall_s": wall,
                "server_ended": gone,
                "requests": sorted(records, key=lambda r: r["index"]),
            }
            report["runs"].append(run)
            report["summary"] = summarise(report["runs"])
            report["verdicts"] = paired_verdicts(report["runs"])
            artefacts.write(path, report)
            print(
                f"  offered {run['offered']}, completed {run['completed']}, lost {run['lost']}, "
                f"{run['crashes']} crashes, {run['steps_recomputed']} steps recomputed"
                + (f"; crasher: {crasher.failure}" if crasher.failure else ""),
                flush=True,
            )
    report["complete"] = True
    report["wall_s"] = time.perf_counter() - started
    artefacts.write(path, report)
    print(render(report))
    print(f"wrote {path} ({report['wall_s']:.0f} s)")
