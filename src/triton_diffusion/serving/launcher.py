"""Start a real ``tritonserver`` on the project's model repository.

Uses a ``tritonserver`` found on PATH (the NGC container) or else the one bundled in the
``nvidia-pytriton`` wheel. The bundled server needs a private backend directory holding the Python
backend library, its utils module and the stub built for the running Python, and it needs this
interpreter's ``bin`` first on PATH: the stub finds its interpreter and site-packages through
``python3``.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from triton_diffusion.recovery import drain

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"


# tritonserver's exit timeout under the supervisor (Triton's own default is 30 s). On SIGTERM the drain has
# already let what can finish finish and answered the rest, so what is left is unloading the models; a model
# Triton still counts as live then (a dead stub, a request not yet released) would hold every stop and every
# crash restart for the whole timeout.
EXIT_TIMEOUT_S = 5.0

# Triton loads 4 models at a time (--model-load-thread-count); in a repository of more, the rest wait for a
# free thread at every start and every crash restart (the shipped one: its fifth model loaded alone after
# the others). One thread a model, at most 8: each load holds its weights in host memory on the way to its
# device, so loads at once add up (a --model-load-thread-count of the user's own wins).
LOAD_THREADS = (4, 8)


def load_threads(model_repository: Path) -> int:
    """Model loads at once: one per model of the repository (a folder with a config.pbtxt; one that cannot
    be read counts as none), within LOAD_THREADS."""
    models = 0
    try:
        entries = list(model_repository.iterdir())
    except OSError:  # tritonserver says what is wrong with the repository
        entries = []
    for entry in entries:
        try:
            models += (entry / "config.pbtxt").is_file()
        except OSError:  # e.g. a folder this user may not read (lost+found)
            continue
    least, most = LOAD_THREADS
    return min(max(models, least), most)


class LauncherError(RuntimeError):
    """A problem that stops the server from starting, with a message meant for the user."""


@dataclass(frozen=True)
class ServerCommand:
    argv: list[str]
    env: dict[str, str]


def bundled_server_root() -> Path:
    try:
        import pytriton  # noqa: PLC0415  (optional: only needed without a tritonserver on PATH)
    except ImportError as exc:
        raise LauncherError(
            "no tritonserver on PATH and nvidia-pytriton is not installed: "
            "`pip install nvidia-pytriton==0.7.0` or run inside the NGC Triton container"
        ) from exc
    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def python_version_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def make_backend_directory(server_root: Path, target: Path) -> Path:
    """Build ``target/python`` from symlinks: the backend library, its utils and this Python's stub."""
    stubs = server_root / "python_backend_stubs"
    stub = stubs / python_version_tag() / "triton_python_backend_stub"
    if not stub.is_file():
        available = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
        raise LauncherError(
            f"the bundled Triton has no Python backend stub for Python {python_version_tag()} "
            f"(available: {', '.join(available) or 'none'}); create the venv with one of those versions"
        )
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    sources = {
        "libtriton_python.so": server_root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": server_root
        / "backends"
        / "python"
        / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    for name, source in sources.items():
        link = python_dir / name
        if link.is_symlink() and os.readlink(link) == str(source):
            continue
        # Made under a name of its own, then renamed over the old one (atomic): servers started at once
        # (test workers, a supervisor's restart) never see the link missing or race to create it.
        fresh = python_dir / f".{name}.{secrets.token_hex(8)}"
        fresh.symlink_to(source)
        try:
            os.replace(fresh, link)
        finally:
            fresh.unlink(missing_ok=True)  # gone once renamed; left only where the rename failed
    return target


def server_command(model_repository: Path, extra_args: list[str], backend_cache: Path) -> ServerCommand:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    # The stub embeds libpython; make sure the dynamic loader finds this interpreter's copy.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = libdir + os.pathsep + env.get("LD_LIBRARY_PATH", "")

    args = ["--model-repository", str(model_repository), *extra_args]
    on_path = shutil.which("tritonserver", path=os.environ.get("PATH", ""))
    if on_path:
        return ServerCommand([on_path, *args], env)

    root = bundled_server_root()
    backends = make_backend_directory(root, backend_cache)
    if not any(a.startswith("--backend-directory") for a in extra_args):
        args = ["--backend-directory", str(backends), *args]
    return ServerCommand([str(root / "bin" / "tritonserver"), *args], env)


def _option(args: list[str], name: str, default: str) -> str:
    """The value of ``--name=value`` or ``--name value`` among tritonserver's arguments: the last one, as
    tritonserver takes it (scripts/serve.sh puts its defaults first, a user's arguments after)."""
    found = default
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            found = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(args):
            found = args[i + 1]
    return found


def openai_front_address(address: str | None, api_key_file: Path | None) -> str:
    """Where the OpenAI front listens: the address given, else every interface when it requires API keys
    and only this machine (127.0.0.1) when it is open to anyone who reaches it."""
    if address:
        return address
    return "0.0.0.0" if api_key_file is not None else "127.0.0.1"


def open_front_warning(address: str, api_key_file: Path | None) -> str | None:
    """The startup warning for a front that serves anyone on a reachable address, or None."""
    if api_key_file is not None or address in ("127.0.0.1", "localhost", "::1", "[::1]"):
        return None
    return (
        f"the OpenAI front listens on {address} without an API key file: anyone who reaches its port can "
        "generate (pass --openai-api-key-file, or --openai-address=127.0.0.1)"
    )


def openai_front_command(extra: list[str], port: int, address: str, api_key_file: Path | None) -> list[str]:
    """The OpenAI front's command line: it reaches Triton over gRPC on this machine."""
    grpc_address = _option(extra, "grpc-address", "127.0.0.1")
    if grpc_address in ("0.0.0.0", "::", "[::]"):
        grpc_address = "127.0.0.1"
    argv = [
        sys.executable,
        "-m",
        "triton_diffusion.openai_front",
        "--host",
        address,
        "--port",
        str(port),
        "--triton-grpc",
        f"{grpc_address}:{_option(extra, 'grpc-port', '8001')}",
    ]
    if api_key_file is not None:
        argv += ["--api-key-file", str(api_key_file)]
    return argv


def ready_line(
    extra: list[str], models: list[str], health_port: int, front: tuple[str, int] | None = None
) -> str:
    """The one line that says every model is ready, with where to reach the server."""
    http, grpc = _option(extra, "http-port", "8000"), _option(extra, "grpc-port", "8001")
    metrics = _option(extra, "metrics-port", "8002")
    parts = [
        f"HTTP http://localhost:{http}",
        f"gRPC localhost:{grpc}",
        f"metrics http://localhost:{metrics}/metrics",
    ]
    if health_port:
        parts.append(f"health http://localhost:{health_port}/readyz")
    if front is not None:
        host = "localhost" if front[0] in ("0.0.0.0", "127.0.0.1", "::") else front[0]
        host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
        parts.append(f"OpenAI front http://{host}:{front[1]}/v1 (playground http://{host}:{front[1]}/)")
    count = f"{len(models)} model{'s' * (len(models) != 1)}"
    return f"triton-diffusion: READY, {count} ({', '.join(models) or '-'}): " + "; ".join(parts)


def with_drain_file(command: ServerCommand, extra: list[str]) -> tuple[ServerCommand, Path]:
    """The server command with the drain file's path in its environment (its Python backend stubs inherit
    it: recovery/drain.py), and that path, cleared of what an earlier run left there."""
    path = drain.drain_path(_option(extra, "http-port", "8000"), command.env)
    drain.clear(path)
    return ServerCommand(command.argv, {**command.env, drain.ENV: str(path)}), path


def exit_code(status: int) -> int:
    """The launcher's exit code for the server's status: a server ended by a signal (Popen's negative
    status) gives 128 + the signal, as a shell reports it (``sys.exit(-9)`` would give 247)."""
    return 128 - status if status < 0 else status


def supervise(
    command: ServerCommand,
    extra: list[str],
    health_port: int,
    front_argv: list[str] | None = None,
    drain_s: float = 30.0,
    front_at: tuple[str, int] | None = None,
) -> int:
    """Run tritonserver as a child with the supervisor beside it, which restarts it when one of its
    Python backend processes (or the server itself) dies; with ``front_argv``, the OpenAI front as a
    second child, started again if it exits. SIGTERM drains the models first (at most ``drain_s``; 0: no
    drain), then goes to the server; SIGINT goes at once. Returns the server's status (0 where the
    models' finalized marks ended it: supervisor.py)."""
    from triton_diffusion.serving.companion import CompanionProcess
    from triton_diffusion.serving.supervisor import Supervisor

    command, drain_file = with_drain_file(command, extra)

    def start() -> subprocess.Popen:
        print("+ " + " ".join(command.argv), file=sys.stderr, flush=True)
        return subprocess.Popen(command.argv, env=command.env)

    http = f"http://127.0.0.1:{_option(extra, 'http-port', '8000')}"
    front = CompanionProcess(front_argv, "the OpenAI front") if front_argv else None
    supervisor = Supervisor(
        start,
        http,
        exit_timeout_s=float(_option(extra, "exit-timeout-secs", "30")),
        drain_file=drain_file,
        drain_s=drain_s,
        announce=lambda models: print(
            ready_line(extra, models, health_port, front_at), file=sys.stderr, flush=True
        ),
        front_restarts=(lambda: front.restarts) if front is not None else None,
    )

    def stop(signum: int, _frame: object) -> None:
        if front is not None:
            front.stopping()  # a signal to the whole process group ends the front too: no restart
        supervisor.stop(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if health_port:
        supervisor.serve_health(health_port)
    if front is not None:
        front.start()
    try:
        return supervisor.run()
    finally:
        if front is not None:
            front.stop()
        drain.clear(drain_file)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Run tritonserver on a triton-diffusion model repository, with a supervisor that "
        "restarts it when one of its Python backend processes (or the server itself) dies. "
        "Arguments after the known ones go to tritonserver unchanged (e.g. --log-verbose=1).",
    )
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument(
        "--backend-cache",
        type=Path,
        default=Path(sys.prefix) / "triton-backends",
        help="where the private backend directory for the bundled server is written",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=8003,
        help="the supervisor's /healthz, /readyz and /metrics (0: none)",
    )
    parser.add_argument(
        "--no-supervise", action="store_true", help="exec tritonserver directly (nothing restarts it)"
    )
    parser.add_argument(
        "--openai-port",
        type=int,
        default=0,
        help="serve the OpenAI-compatible front (images, videos, chat) on this port (0: off)",
    )
    parser.add_argument(
        "--openai-address",
        default=None,
        help="the OpenAI front's listen address (default: 0.0.0.0 with --openai-api-key-file, else "
        "127.0.0.1: an open front is reachable from this machine only unless this is given)",
    )
    parser.add_argument(
        "--openai-api-key-file",
        type=Path,
        help="bearer tokens for the OpenAI front, one per line (none: open to anyone)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, first let the models drain for at most this long: they refuse new requests, "
        "finish what can finish and checkpoint the rest, so clients resend it elsewhere or after the "
        "restart (0: no drain; SIGINT never drains). Needs the supervisor",
    )
    known, extra = parser.parse_known_args(argv)
    # Defaults first: a user's own comes later and wins.
    extra = [f"--model-load-thread-count={load_threads(known.model_repository)}", *extra]
    if not known.no_supervise:
        extra = [f"--exit-timeout-secs={EXIT_TIMEOUT_S:g}", *extra]
    if known.drain_s < 0:
        parser.error("--drain-s must be 0 or more")
    # tritonserver takes any unique prefix of an option's name (getopt_long) and the mode in any case.
    modes = [
        value.lower()
        for i, arg in enumerate(extra)
        if len(name := arg.split("=", 1)[0]) >= len("--model-cont")
        and "--model-control-mode".startswith(name)
        for value in ([arg.split("=", 1)[1]] if "=" in arg else extra[i + 1 : i + 2])
    ]
    mode = modes[-1] if modes else "none"
    if mode != "none" and not known.no_supervise:
        # Triton 2.51 never says a stub died, so the supervisor takes a stub gone for a crash and restarts
        # the server: an unload through the model-control API would restart it, and every other model.
        sys.exit(
            f"triton-diffusion-serve: --model-control-mode={mode} needs --no-supervise (the supervisor "
            "restarts the server when a model's process goes away, as an unload makes it)"
        )
    front_argv, front_at = None, None
    if known.openai_port:
        if known.no_supervise:
            sys.exit("triton-diffusion-serve: --openai-port needs the supervisor (drop --no-supervise)")
        key_file = known.openai_api_key_file
        if key_file is not None and not key_file.is_file():
            sys.exit(f"triton-diffusion-serve: the API key file {key_file} does not exist")
        address = openai_front_address(known.openai_address, key_file)
        if known.openai_address is None and key_file is None:
            print(
                "triton-diffusion-serve: no --openai-api-key-file: the OpenAI front listens on 127.0.0.1 "
                "only (pass a key file, or --openai-address=0.0.0.0 to open it to everyone)",
                file=sys.stderr,
                flush=True,
            )
        warning = open_front_warning(address, key_file)
        if warning is not None:
            print(f"triton-diffusion-serve: WARNING: {warning}", file=sys.stderr, flush=True)
        front_argv = openai_front_command(
            extra, known.openai_port, address, key_file.resolve() if key_file else None
        )
        front_at = (address, known.openai_port)
    try:
        command = server_command(known.model_repository.resolve(), extra, known.backend_cache)
    except LauncherError as exc:
        sys.exit(f"triton-diffusion-serve: {exc}")
    if known.no_supervise:
        print("+ " + " ".join(command.argv), file=sys.stderr, flush=True)
        os.execvpe(command.argv[0], command.argv, command.env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    sys.exit(exit_code(supervise(command, extra, known.health_port, front_argv, known.drain_s, front_at)))


if __name__ == "__main__":
    main()
