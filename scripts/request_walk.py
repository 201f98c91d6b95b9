"""Measure one text-to-image request's walk through the package on the step engine: the modules whose code
runs for it, in order, on each thread, and any call from a lower layer into a higher one (the walk's table
of docs/design/engine.md is rendered from the artefact it writes, ``docs/design/request_walk.json``).

The model is the shipped ``text_to_image`` model class on the tiny SD weights, initialised and executed as
Triton does it; Triton's ``triton_python_backend_utils`` is replaced by a minimal stand-in (a request with
a PROMPT tensor and parameters, a response sender that records), so this runs anywhere. Calls are recorded
with ``sys.setprofile`` on every thread while the one request runs, after a warm-up request.

    .venv/bin/python scripts/request_walk.py [--out docs/design/request_walk.json]
"""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "src" / "triton_diffusion"
# The layers in import order, highest first (models import serving, serving imports engine, the engine
# imports nothing of either): a call from a module of a lower layer into a higher one runs back up, unless
# it goes through a contract the lower layer declares (a Protocol method, or a hook of its own base class
# that the higher layer's class overrides): that is the lower layer calling what it defined.
LAYERS = ("models", "serving", "engine", "adapters")


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def as_numpy(self) -> np.ndarray:
        return self._array


class _Sender:
    def __init__(self) -> None:
        self.finals: list = []
        self.done = threading.Event()

    def send(self, response, flags=0):
        if flags:
            self.finals.append(response)
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class _Request:
    def __init__(self, prompt: str, parameters: dict) -> None:
        self.tensors = {"PROMPT": _Tensor("PROMPT", np.array([[prompt.encode()]], dtype=object))}
        self._parameters, self.sender = parameters, _Sender()

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def request_id(self) -> str:
        return "walk"

    def timeout(self) -> int:
        return 0

    def get_response_sender(self) -> _Sender:
        return self.sender


def _stand_in() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.output_tensors, self.error = output_tensors or [], error

    class TritonError:
        INVALID_ARG = INTERNAL = UNAVAILABLE = CANCELLED = 0

        def __init__(self, message, code=0):
            self.message = message

    class Logger:
        log_info = log_warn = log_error = staticmethod(lambda message: None)

    module.InferenceResponse, module.TritonError, module.Logger = InferenceResponse, TritonError, Logger
    module.Tensor = _Tensor
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 2
    module.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)

    class MetricFamily:
        HISTOGRAM = COUNTER = GAUGE = 0

        def __init__(self, name, description, kind):
            pass

        def Metric(self, labels=None, buckets=None):  # noqa: N802  (Triton's name)
            return types.SimpleNamespace(observe=lambda v: None, increment=lambda v: None, set=lambda v: None)

    module.MetricFamily = MetricFamily
    return module


def contract_methods(layer: str, callee_module: str, qualname: str) -> set[str]:
    """The methods ``layer`` declares for a higher layer to implement: those of the Protocols defined in its
    modules, and those of its classes that the callee's class (``qualname`` in ``callee_module``) inherits
    and overrides."""
    import importlib
    import inspect
    from typing import Protocol

    names: set[str] = set()
    for path in sorted((PACKAGE / layer).glob("*.py")):
        module = importlib.import_module(f"triton_diffusion.{layer}.{path.stem}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and Protocol in getattr(cls, "__mro__", ()):
                names |= {name for name in vars(cls) if not name.startswith("_")}
    owner_name = qualname.rsplit(".", 1)[0]
    callee = importlib.import_module(
        "triton_diffusion." + callee_module.removesuffix(".py").replace("/", ".")
    )
    owner = getattr(callee, owner_name, None)
    for base in getattr(owner, "__mro__", ())[1:]:
        if base.__module__.startswith(f"triton_diffusion.{layer}."):
            names |= {name for name in vars(base) if not name.startswith("_")}
    return names


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "design" / "request_walk.json"))
    args = parser.parse_args(argv)
    sys.modules["triton_python_backend_utils"] = _stand_in()
    sys.path.insert(0, str(REPO_ROOT / "src"))
    from triton_diffusion.models.text_to_image import TextToImageModel
    from triton_diffusion.serving.server_process import WEIGHTS
    from triton_diffusion.serving.triton_model import TritonModel
    from triton_diffusion.tiny_models import build_missing

    build_missing(WEIGHTS, only=["tiny-sd"])
    walk: dict[str, list[tuple[str, str]]] = {}
    lock = threading.Lock()
    recording = threading.Event()

    def profile(frame, event, arg):
        if event != "call" or not recording.is_set():
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)):
            return
        module = str(Path(path).relative_to(PACKAGE))
        caller = frame.f_back
        caller_module = None
        if caller is not None and caller.f_code.co_filename.startswith(str(PACKAGE)):
            caller_module = str(Path(caller.f_code.co_filename).relative_to(PACKAGE))
        with lock:
            walk.setdefault(threading.current_thread().name, []).append(
                (
                    module,
                    f"{frame.f_code.co_qualname}<-{caller_module}<-{caller.f_code.co_name if caller else ''}",
                )
            )

    threading.setprofile(profile)  # before the model starts its threads, so theirs are recorded too
    sys.setprofile(profile)
    config = {"max_batch_size": 8, "parameters": {"model": {"string_value": str(WEIGHTS / "tiny-sd")}}}
    model = TritonModel(TextToImageModel())
    repository = str(REPO_ROOT)
    model.initialize(
        {"model_config": json.dumps(config), "model_name": "text_to_image", "model_repository": repository}
    )

    def send(prompt: str) -> _Request:
        request = _Request(prompt, {"seed": 1, "num_inference_steps": 2, "height": 64, "width": 64})
        model.execute([request])
        assert request.sender.done.wait(60), "no FINAL response"
        return request

    send("warm-up")
    time.sleep(0.5)  # the warm-up's last responses and metrics are out
    recording.set()
    request = send("a red cat")
    time.sleep(0.5)
    recording.clear()
    sys.setprofile(None)
    threading.setprofile(None)
    model.finalize()
    assert request.sender.finals and request.sender.finals[0].error is None

    modules: list[str] = []
    threads: dict[str, list[str]] = {}
    print("One text-to-image request on the step engine (tiny SD, 2 steps), modules in order of first call:")
    for thread, calls in walk.items():
        seen: list[str] = []
        for module, _ in calls:
            if module not in seen:
                seen.append(module)
        modules += [m for m in seen if m not in modules]
        threads[thread] = seen
        print(f"\n{thread}:")
        for module in seen:
            print(f"  {module}")
    upward, through_contracts = set(), set()
    for calls in walk.values():
        for module, call in calls:
            qualname, caller, caller_function = call.split("<-")
            function = qualname.rsplit(".", 1)[-1]
            if caller == "None" or "/" not in module or "/" not in caller or function == caller_function:
                continue  # the same method up its class hierarchy (super()) is not a layer crossing
            callee_layer, caller_layer = module.split("/")[0], caller.split("/")[0]
            if callee_layer in LAYERS and caller_layer in LAYERS:
                if LAYERS.index(callee_layer) < LAYERS.index(caller_layer):
                    crossing = f"{caller} -> {module} ({function})"
                    if function in contract_methods(caller_layer, module, qualname):
                        through_contracts.add(crossing)
                    else:
                        upward.add(crossing)
    print(f"\n{len(modules)} modules in all; calls back up a layer: {sorted(upward) or 'none'}")
    print(f"through the lower layer's own contracts: {sorted(through_contracts)}")
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from artefacts import write

    walk_artefact = {
        "layers": list(LAYERS),
        "threads": threads,
        "modules": len(modules),
        "upward": sorted(upward),
        "through_contracts": sorted(through_contracts),
    }
    print(f"written: {write(args.out, walk_artefact)}")


if __name__ == "__main__":
    main()
