"""The figure block of scripts/model_reload_check.py: per kill+reload cycle, what the request in flight on the
killed stub got, the reload, the bystander model's requests, old copies left unloading, server RSS, stubs
and shared-memory regions; then the shutdown and the verdict. A pure function of the artefact's JSON."""

from __future__ import annotations

from typing import Any

from tables.markdown import table

HEADERS = (
    "cycle",
    "killed",
    "its request in flight",
    "load (s)",
    "new request",
    "old copy left unloading",
    "other model's requests",
    "server RSS (MiB)",
    "stubs",
    "shm regions",
)


def _outcome(cycle: dict[str, Any]) -> str:
    outcome = cycle["in_flight"] or "-"
    if outcome == "hang":
        finally_ = cycle.get("in_flight_finally")
        return (
            "**hang** (nothing, even after the reload)"
            if finally_ == "hang"
            else f"**hang**, then {finally_}"
        )
    if cycle.get("in_flight_error"):
        return f"{outcome}: `{cycle['in_flight_error'][:60]}`"
    return outcome


def _counts(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    answered = counts.get("answered", 0)
    others = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if k != "answered")
    return f"{answered}/{total} answered" + (f" ({others})" if others else "")


def _pair(values: list[Any]) -> str:
    return f"{values[0]} → {values[1]}"


def sentence(artefact: dict[str, Any]) -> str:
    verdict = artefact["verdict"]
    if verdict["safe"]:
        return (
            "**Verdict: safe.** Reloading the one model left nothing hanging or unloading, the other model "
            "answered every request and the server shut down within its exit timeout: reload it instead of "
            "restarting the server."
        )
    return (
        "**Verdict: not safe; keep the whole-server restart.** "
        + "; ".join(verdict["failures"])
        + f" (server RSS {verdict['rss_mib_per_cycle']} MiB a reload, limit "
        f"{verdict['rss_limit_mib_per_cycle']})."
    )


def render(artefact: dict[str, Any]) -> str:
    settings = artefact["settings"]
    shutdown = artefact["shutdown"]
    rows = [
        [
            c["cycle"],
            f"`{c['victim']}`",
            _outcome(c),
            f"{c['load_s']:.2f}" + (" (after a touch)" if c["load_needed_touch"] else ""),
            "answered" if c["reloaded_answered"] else "**not answered**",
            f"**{c['stuck_copies']}**" if c["stuck_copies"] else "0",
            f"`{c['bystander']}`: {_counts(c['bystander_requests'])}",
            _pair(c["server_rss_mib"]),
            _pair(c["stubs"]),
            _pair(c["shm_regions_on_disk"]),
        ]
        for c in artefact["cycles"]
    ]
    models = settings["models"]
    intro = (
        f"Triton {settings.get('server_version') or '?'} (`--model-control-mode=explicit`), two decoupled "
        f"toy Python models: `inline` {models['inline']}, `threaded` {models['threaded']}; each request "
        f"gets {settings['responses_per_request']} responses {settings['response_pause_s']} s apart, then a "
        "FINAL. A trickle of requests to both models throughout; each cycle SIGKILLs one model's stub while "
        f"a request of its own is in flight (a hang: no FINAL and no error within {settings['hang_s']} s), "
        "then `load`s it (a load of the unchanged model first; when that starts no new stub, its `model.py` "
        'touched and loaded again: "after a touch"). Load: the seconds of the load that started the new '
        "stub. An old copy left unloading: a reload whose old copy never logged its unload."
    )
    live = shutdown.get("live_models_at_shutdown")
    stop = (
        f"Shutdown (SIGTERM, `--exit-timeout-secs={shutdown['exit_timeout_s']}`): {shutdown['seconds']} s, "
        + (
            "within its timeout"
            if shutdown["within_timeout"]
            else "**the exit timeout expired**"
            + (" and it was SIGKILLed" if shutdown.get("sigkilled") else "")
        )
        + (f"; {live} live models when it began (2 loaded)" if live is not None else "")
        + f"; {shutdown.get('strays_after_exit', 0)} processes of the run left after it."
    )
    return "\n\n".join([intro, table(HEADERS, rows), stop, sentence(artefact)]) + "\n"
