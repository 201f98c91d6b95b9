"""On a GPU: raise real CUDA errors and print how ``engine/failures.py`` classifies each, so the
rule "only a device that fails a probe too counts as lost" is checked against what torch really raises.

    python scripts/device_error_check.py          # writes docs/gpu/device_errors.json

Order matters: the recoverable errors first, the sticky one (a device-side assert) last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import artefacts  # noqa: E402

from triton_diffusion.engine.failures import is_device_lost, is_out_of_memory  # noqa: E402


def classify(name: str, make_error) -> dict:
    try:
        make_error()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        row = {
            "case": name,
            "type": type(exc).__name__,
            "message": str(exc).splitlines()[0][:160],
            "out_of_memory": is_out_of_memory(exc),
            "device_lost": is_device_lost(exc),
        }
    else:
        row = {"case": name, "type": None}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    assert torch.cuda.is_available(), "needs a GPU"
    rows = [
        classify("allocator out of memory", lambda: torch.empty(2**45, dtype=torch.uint8, device="cuda")),
        classify("pinned host out of memory", lambda: torch.empty(2**46, dtype=torch.uint8).pin_memory()),
        classify(
            "shape error on the device",
            lambda: torch.ones(3, 4, device="cuda") @ torch.ones(5, 6, device="cuda"),
        ),
        classify(
            "device-side assert", lambda: torch.zeros(4, device="cuda")[torch.tensor([10], device="cuda")]
        ),
    ]
    out = REPO_ROOT / "docs" / "gpu" / "device_errors.json"
    artefacts.write(out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": rows})


if __name__ == "__main__":
    main()
