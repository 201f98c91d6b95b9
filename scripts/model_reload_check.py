"""Can Triton's model control reload one model whose Python backend stub died, instead of restarting the
whole server (issue 43, point 5)? A measurement on the bundled Triton (nvidia-pytriton's ``tritonserver``).

It starts ``tritonserver --model-control-mode=explicit`` on a temporary model repository holding two toy
decoupled Python models written here: ``inline`` answers from ``execute()``, ``threaded`` from a background
thread (as the engine host does); each sends a few responses over ~2 s, then a FINAL. A trickle of
requests (one at a time, a stream each) goes to both models the whole time. Each cycle, per victim model:
a request of its own in flight, its stub SIGKILLed (found with ``list_stubs``), what that request gets
(an error, or nothing within ``--hang-s``: a hang), then ``load`` (touching its ``model.py`` when a load
of an unchanged model does not restart the stub), the time to ready, a new request, the repository index,
the server's RSS, the stubs and the Python backend shared-memory regions before and after. Finally
SIGTERM, timed against ``--exit-timeout-secs`` (SIGKILL past a margin), and no process of the run left.

    python scripts/model_reload_check.py            # writes docs/cpu/model_reload.json

The artefact's ``verdict``: reload is safe only with no hang, no old copy left unloading, every request of
the bystander model answered, the reloaded model answering, server RSS growth per reload under
``--rss-mib-per-cycle`` and a shutdown within the exit timeout. Rendered by scripts/tables/model_reload.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import artefacts  # noqa: E402
from reload_toys import write_repository  # noqa: E402
from triton_diffusion_client.streams import stop_cancelling  # noqa: E402

OUT = REPO_ROOT / "docs" / "cpu" / "model_reload.json"
MODELS = ("threaded", "inline")
SHM_PREFIX = "triton_python_backend_shm_region_"


# ---- requests ---------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.start, 3)


def send(
    url: str,
    model: str,
    request_id: str,
    hang_s: float,
    clock: Clock,
    first: threading.Event | None = None,
    late_s: float = 0.0,
) -> dict[str, Any]:
    """One request on a stream of its own: ``answered`` (a FINAL), ``error`` (its text) or ``hang``
    (neither within ``hang_s``). With ``late_s``, keeps listening that much longer after a hang and
    records what still came (``late``)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    record: dict[str, Any] = {"model": model, "id": request_id, "sent": clock.now(), "responses": 0}
    done = threading.Event()
    lock = threading.Lock()

    def callback(result: Any, error: Any) -> None:
        with lock:
            if error is not None:
                record.setdefault("error", str(error)[:300])
                record.setdefault("error_at", clock.now())
                done.set()
                return
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if response.outputs:
                record["responses"] += 1
                if first is not None:
                    first.set()
            if final is not None and final.bool_param:
                record.setdefault("final_at", clock.now())
                done.set()

    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=callback)
        tensor = grpcclient.InferInput("X", [1], "INT32")
        tensor.set_data_from_numpy(np.array([int(request_id.rsplit("-", 1)[-1])], dtype=np.int32))
        client.async_stream_infer(model, [tensor], request_id=request_id, enable_empty_final_response=True)
        answered_in_time = done.wait(hang_s)
        if not answered_in_time and late_s > 0:
            done.wait(late_s)
        with lock:
            if "final_at" in record:
                record["outcome"] = "answered" if answered_in_time else "late final"
            elif "error" in record:
                record["outcome"] = "error" if answered_in_time else "late error"
            else:
                record["outcome"] = "hang"
    except Exception as exc:  # noqa: BLE001  (the server went away: that is an outcome too)
        record.setdefault("error", f"{type(exc).__name__}: {exc}"[:300])
        record["outcome"] = "error"
    finally:
        with contextlib.suppress(Exception):
            stop_cancelling(client)  # leaves no thread behind (triton_diffusion_client.streams)
        with contextlib.suppress(Exception):
            client.close()
    record["done"] = clock.now()
    return record


class Trickle(threading.Thread):
    """Requests to one model, one after another (``interval_s`` apart), until stopped; every outcome kept."""

    def __init__(self, url: str, model: str, hang_s: float, clock: Clock, interval_s: float) -> None:
        super().__init__(daemon=True, name=f"trickle-{model}")
        self.url, self.model, self.hang_s, self.clock, self.interval_s = url, model, hang_s, clock, interval_s
        self.records: list[dict[str, Any]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            self.records.append(
                send(self.url, self.model, f"trickle-{self.model}-{n}", self.hang_s, self.clock)
            )
            self.stopping.wait(self.interval_s)

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        """The requests sent in [start, end)."""
        return [r for r in list(self.records) if start <= r["sent"] < end]


def tally(records: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    return counts


# ---- the server -------------------------------------------------------------------------------------------
def start_server(repo: Path, work: Path, exit_timeout_s: int) -> tuple[subprocess.Popen, int, int, Path]:
    from triton_diffusion.serving.launcher import server_command
    from triton_diffusion.serving.server_process import free_ports

    http, grpc, metrics = free_ports(3)
    args = [
        "--model-control-mode=explicit",
        *(f"--load-model={name}" for name in MODELS),
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        f"--exit-timeout-secs={exit_timeout_s}",
    ]
    command = server_command(repo, args, work / "backends")
    log_path = work / "server.log"
    log_file = open(log_path, "w")  # noqa: SIM115  (kept open for the server's lifetime)
    print("+ " + " ".join(command.argv), file=sys.stderr, flush=True)
    process = subprocess.Popen(
        command.argv, env=command.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    return process, http, grpc, log_path


def wait_ready(client: Any, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise SystemExit(f"tritonserver exited with {process.returncode}")
        with contextlib.suppress(Exception):
            if all(client.is_model_ready(name) for name in MODELS):
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"models not ready in {timeout_s} s")
        time.sleep(0.3)


def shm_mapped(pid: int) -> set[str]:
    """The Python backend shared-memory regions the server has mapped."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return set(re.findall(rf"/dev/shm/({SHM_PREFIX}[\w-]+)", maps))


def snapshot(
    process: subprocess.Popen, client: Any, seen_regions: set[str], log_path: Path
) -> dict[str, Any]:
    """The server's RSS, its stubs, the shared-memory regions and the repository index, now."""
    import psutil

    from triton_diffusion.serving.supervisor import list_stubs

    stubs = list_stubs(process.pid)
    seen_regions.update(s.shm_region for s in stubs)
    mapped = shm_mapped(process.pid)
    seen_regions.update(mapped)
    existing = [name for name in sorted(seen_regions) if (Path("/dev/shm") / name).exists()]
    try:
        index = [
            {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
            for m in client.get_model_repository_index().models
        ]
    except Exception as exc:  # noqa: BLE001
        index = [{"error": str(exc)[:200]}]
    log = log_path.read_text(errors="replace")
    return {
        "server_rss_mib": round(psutil.Process(process.pid).memory_info().rss / 2**20, 1),
        "stubs": {name: sum(1 for s in stubs if s.model == name) for name in MODELS},
        "stub_pids": {name: [s.pid for s in stubs if s.model == name] for name in MODELS},
        "shm_regions_mapped": len(mapped),
        "shm_regions_on_disk": len(existing),
        "shm_mib_on_disk": round(sum((Path("/dev/shm") / n).stat().st_size for n in existing) / 2**20, 1),
        "index": index,
        "unloaded_in_log": {name: log.count(f"successfully unloaded '{name}'") for name in MODELS},
    }


# ---- one kill and reload ----------------------------------------------------------------------------------
def kill_and_reload(
    victim: str,
    cycle: int,
    url: str,
    client: Any,
    process: subprocess.Popen,
    repo: Path,
    args: argparse.Namespace,
    clock: Clock,
    seen_regions: set[str],
    log_path: Path,
) -> dict[str, Any]:
    from triton_diffusion.serving.supervisor import list_stubs

    row: dict[str, Any] = {"cycle": cycle, "victim": victim, "start": clock.now()}
    row["before"] = snapshot(process, client, seen_regions, log_path)
    old_pids = set(row["before"]["stub_pids"][victim])

    # A request of its own in flight (its first response came), then SIGKILL to its stub.
    first = threading.Event()
    probe: dict[str, Any] = {}

    def run_probe() -> None:
        probe.update(send(url, victim, f"probe-{cycle}{len(victim)}", args.hang_s, clock, first, args.late_s))

    probe_thread = threading.Thread(target=run_probe, daemon=True)
    probe_thread.start()
    if not first.wait(10):
        row["note"] = "the probe had no first response within 10 s"
    (stub,) = [s for s in list_stubs(process.pid) if s.model == victim]
    os.kill(stub.pid, signal.SIGKILL)
    row["killed"] = clock.now()
    probe_thread.join(args.hang_s + 2)  # its outcome first (the late wait runs on after the reload)
    row["in_flight"] = (
        dict(probe) if probe else {"outcome": "hang", "note": f"nothing within {args.hang_s} s"}
    )
    row["index_before_load"] = [m for m in snapshot(process, client, seen_regions, log_path)["index"]]

    # Reload: an unchanged model first; touch its model.py only if that did not start a new stub.
    loads = []
    load_started = clock.now()
    for touch in (False, True):
        if touch:
            os.utime(repo / victim / "1" / "model.py")
        started = time.monotonic()
        try:
            client.load_model(victim, client_timeout=args.load_timeout_s)
            error = None
        except Exception as exc:  # noqa: BLE001
            error = str(exc)[:300]
        seconds = round(time.monotonic() - started, 3)
        new = [s.pid for s in list_stubs(process.pid) if s.model == victim and s.pid not in old_pids]
        loads.append({"touched": touch, "seconds": seconds, "error": error, "new_stub": bool(new)})
        if new:
            break
    row["loads"] = loads
    ready_at = None
    deadline = time.monotonic() + args.load_timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if client.is_model_ready(victim):
                ready_at = clock.now()
                break
        time.sleep(0.1)
    row["ready"] = ready_at
    row["ready_after_load_s"] = round(ready_at - load_started, 3) if ready_at is not None else None
    row["after_reload"] = send(url, victim, f"after-{cycle}{len(victim)}", args.hang_s, clock)
    probe_thread.join(args.late_s + 5)
    row["in_flight_finally"] = {k: probe.get(k) for k in ("outcome", "error", "error_at", "final_at")}
    time.sleep(args.settle_s)
    row["after"] = snapshot(process, client, seen_regions, log_path)
    row["end"] = clock.now()
    return row


def stop_server(process: subprocess.Popen, exit_timeout_s: int, margin_s: float, log_path: Path) -> dict:
    import psutil

    from triton_diffusion.serving.supervisor import descendants

    stubs_before = sorted(descendants(process.pid))
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    killed = False
    try:
        process.wait(timeout=exit_timeout_s + margin_s)
    except subprocess.TimeoutExpired:
        killed = True
        process.kill()
        process.wait()
    seconds = round(time.monotonic() - started, 2)
    log = log_path.read_text(errors="replace")
    expired = "Exit timeout expired" in log
    live = re.findall(r"Timeout \d+: Found (\d+) live models", log)
    left = [pid for pid in stubs_before if psutil.pid_exists(pid)]
    for pid in left:  # this run's stubs, by their ids
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {
        "exit_timeout_s": exit_timeout_s,
        "seconds": seconds,
        # exited cleanly before its timeout expired (no "Exit timeout expired. Exiting immediately")
        "within_timeout": not killed and not expired and process.returncode == 0,
        "exit_timeout_expired": expired,
        "live_models_at_shutdown": int(live[0]) if live else None,
        "sigkilled": killed,
        "returncode": process.returncode,
        "timeout_lines": len(re.findall(r"Timeout \d+: Found \d+ live models", log)),
        "last_timeout_line": (re.findall(r"Timeout \d+: Found [^\n]*", log) or [None])[-1],
        "processes_left": len(left),
    }


def strays(work: Path) -> list[int]:
    """Processes still naming this run's temporary directory (a tritonserver or a stub)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(work) in part for part in proc.info["cmdline"] or []):
                found.append(proc.info["pid"])
    return found


# ---- the verdict ------------------------------------------------------------------------------------------
def stuck_copies(row: dict[str, Any]) -> int:
    """Old copies of the victim whose unload did not complete by the cycle's end: reloads that did not
    log their unload, plus index entries of the victim that are not READY."""
    victim = row["victim"]
    unloaded = row["after"]["unloaded_in_log"][victim] - row["before"]["unloaded_in_log"][victim]
    reloaded = 1 if any(load["new_stub"] for load in row["loads"]) else 0
    not_ready = sum(
        1 for m in row["after"]["index"] if m.get("name") == victim and m.get("state") not in (None, "READY")
    )
    return max(reloaded - unloaded, 0) + not_ready


def summarize(rows: list[dict[str, Any]], trickles: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cycle, the figures the verdict reads."""
    out = []
    for row in rows:
        bystander = next(m for m in MODELS if m != row["victim"])
        window = [r for r in trickles[bystander] if row["start"] <= r["sent"] < row["end"]]
        victim_window = [r for r in trickles[row["victim"]] if row["start"] <= r["sent"] < row["end"]]
        out.append(
            {
                "cycle": row["cycle"],
                "victim": row["victim"],
                "in_flight": row["in_flight"].get("outcome"),
                "in_flight_error": row["in_flight"].get("error"),
                "in_flight_finally": row["in_flight_finally"].get("outcome"),
                "load_needed_touch": not row["loads"][0]["new_stub"],
                "load_s": row["loads"][-1]["seconds"],
                "ready_after_load_s": row["ready_after_load_s"],
                "reloaded_answered": row["after_reload"].get("outcome") == "answered",
                "stuck_copies": stuck_copies(row),
                "bystander": bystander,
                "bystander_requests": tally(window),
                "victim_trickle": tally(victim_window),
                "server_rss_mib": [row["before"]["server_rss_mib"], row["after"]["server_rss_mib"]],
                "stubs": [sum(row["before"]["stubs"].values()), sum(row["after"]["stubs"].values())],
                "shm_regions_on_disk": [
                    row["before"]["shm_regions_on_disk"],
                    row["after"]["shm_regions_on_disk"],
                ],
                "shm_regions_mapped": [
                    row["before"]["shm_regions_mapped"],
                    row["after"]["shm_regions_mapped"],
                ],
            }
        )
    return out


def verdict(
    cycles: list[dict[str, Any]],
    shutdown: dict[str, Any],
    trickles: dict[str, dict[str, int]],
    rss_mib_per_cycle: float,
) -> dict[str, Any]:
    """Safe only if nothing hung, no old copy was left unloading, the bystander answered every request,
    every reloaded model answered, server RSS grew less than ``rss_mib_per_cycle`` a reload and the
    server shut down within its exit timeout. ``trickles``: each model's outcomes over the whole run."""
    failures = []
    hangs = [c for c in cycles if c["in_flight"] == "hang"]
    hangs_total = len(hangs) + sum(t.get("hang", 0) for t in trickles.values())
    if hangs_total:
        failures.append(
            f"{hangs_total} request(s) hung (no error, no FINAL), "
            f"{len(hangs)} of them in flight on a killed stub "
            f"({', '.join(sorted({c['victim'] for c in hangs}))})"
        )
    stuck = sum(c["stuck_copies"] for c in cycles)
    if stuck:
        failures.append(f"{stuck} old model copy(ies) never finished unloading")
    unanswered = sum(n for c in cycles for k, n in c["bystander_requests"].items() if k != "answered")
    if unanswered:
        failures.append(f"{unanswered} request(s) of the other model not answered")
    if not all(c["reloaded_answered"] for c in cycles):
        failures.append("a reloaded model did not answer")
    growth = None
    if cycles:
        growth = (cycles[-1]["server_rss_mib"][1] - cycles[0]["server_rss_mib"][0]) / len(cycles)
        if growth >= rss_mib_per_cycle:
            failures.append(f"server RSS grew {growth:.1f} MiB a reload (limit {rss_mib_per_cycle})")
    if not shutdown.get("within_timeout"):
        failures.append(
            f"shutdown took {shutdown.get('seconds')} s against an exit timeout of "
            f"{shutdown.get('exit_timeout_s')} s" + (" (SIGKILLed)" if shutdown.get("sigkilled") else "")
        )
    if shutdown.get("processes_left"):
        failures.append(f"{shutdown['processes_left']} process(es) left after the server exited")
    return {
        "safe": not failures,
        "failures": failures,
        "rss_mib_per_cycle": None if growth is None else round(growth, 2),
        "rss_limit_mib_per_cycle": rss_mib_per_cycle,
        "keep": "reload the one model" if not failures else "restart the whole server",
    }


# ---- main -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3, help="kill+reload cycles per model (default 3)")
    parser.add_argument(
        "--victims", default=",".join(MODELS), help="the models killed in turn each cycle (default: both)"
    )
    parser.add_argument("--hang-s", type=float, default=15.0, help="no FINAL within this: a hang")
    parser.add_argument("--late-s", type=float, default=10.0, help="listen this long past a hang")
    parser.add_argument("--exit-timeout-secs", type=int, default=10, help="tritonserver's exit timeout")
    parser.add_argument("--kill-margin-s", type=float, default=10.0, help="SIGKILL this long past it")
    parser.add_argument("--load-timeout-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait before the after-snapshot")
    parser.add_argument("--trickle-interval-s", type=float, default=0.5)
    parser.add_argument("--rss-mib-per-cycle", type=float, default=8.0, help="the verdict's RSS limit")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    victims = [v for v in args.victims.split(",") if v]
    if not set(victims) <= set(MODELS):
        parser.error(f"--victims: models are {', '.join(MODELS)}")

    import tritonclient.grpc as grpcclient

    clock = Clock()
    work = Path(tempfile.mkdtemp(prefix="model-reload-"))
    repo = write_repository(work)
    process, _http, grpc_port, log_path = start_server(repo, work, args.exit_timeout_secs)
    url = f"127.0.0.1:{grpc_port}"
    client = grpcclient.InferenceServerClient(url)
    seen_regions: set[str] = set()
    rows: list[dict[str, Any]] = []
    trickles: dict[str, Trickle] = {}
    shutdown: dict[str, Any] = {}
    try:
        wait_ready(client, process)
        started = snapshot(process, client, seen_regions, log_path)
        print(
            f"ready at {clock.now()} s: {started['stubs']}, RSS {started['server_rss_mib']} MiB", flush=True
        )
        for model in MODELS:
            trickles[model] = Trickle(url, model, args.hang_s, clock, args.trickle_interval_s)
            trickles[model].start()
        time.sleep(3)  # a few answered requests of each before the first kill
        for cycle in range(1, args.cycles + 1):
            for victim in victims:
                row = kill_and_reload(
                    victim, cycle, url, client, process, repo, args, clock, seen_regions, log_path
                )
                rows.append(row)
                print(
                    f"cycle {cycle} {victim}: in flight {row['in_flight'].get('outcome')} "
                    f"({(row['in_flight'].get('error') or '')[:80]}), loads {row['loads']}, "
                    f"reload {row['ready_after_load_s']} s, after {row['after_reload'].get('outcome')}, "
                    f"RSS {row['before']['server_rss_mib']}->{row['after']['server_rss_mib']} MiB, "
                    f"stubs {row['after']['stubs']}, shm {row['after']['shm_regions_on_disk']}",
                    flush=True,
                )
        time.sleep(2)
        for trickle in trickles.values():
            trickle.stopping.set()
        for trickle in trickles.values():
            trickle.join(args.hang_s + 5)
        final = snapshot(process, client, seen_regions, log_path)
        client.close()
        shutdown = stop_server(process, args.exit_timeout_secs, args.kill_margin_s, log_path)
        print(f"shutdown: {shutdown}", flush=True)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        left = strays(work)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shm_left = [n for n in sorted(seen_regions) if (Path("/dev/shm") / n).exists()]
        for name in shm_left:  # this run's regions only
            with contextlib.suppress(OSError):
                (Path("/dev/shm") / name).unlink()
    shutdown["strays_after_exit"] = len(left)
    shutdown["shm_regions_left_after_exit"] = len(shm_left)

    trickle_records = {m: t.records for m, t in trickles.items()}
    cycles = summarize(rows, trickle_records)
    whole = {m: tally(r) for m, r in trickle_records.items()}
    result = verdict(cycles, shutdown, whole, args.rss_mib_per_cycle)
    server_version = None
    with contextlib.suppress(Exception):
        server_version = re.search(r"server_version\s*\|\s*(\S+)", log_path.read_text()).group(1)
    artefacts.write(
        args.out,
        {
            "settings": {
                "server_version": server_version,
                "models": {
                    "inline": "answers from execute()",
                    "threaded": "answers from a background thread",
                },
                "responses_per_request": 4,
                "response_pause_s": 0.5,
                "cycles": args.cycles,
                "victims": victims,
                "hang_s": args.hang_s,
                "late_s": args.late_s,
                "exit_timeout_s": args.exit_timeout_secs,
                "kill_margin_s": args.kill_margin_s,
                "trickle_interval_s": args.trickle_interval_s,
            },
            "started": started,
            "final": final,
            "cycles": cycles,
            "trickle": whole,
            "shutdown": shutdown,
            "verdict": result,
            "rows": rows,
            "trickle_records": trickle_records,
            "log_tail": log_path.read_text(errors="replace")[-4000:],
        },
    )
    print(f"verdict: {result}", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
