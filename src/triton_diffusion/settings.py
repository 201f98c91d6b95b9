"""What a model reads from its ``config.pbtxt``: parameters, device and dtype.

Model and LoRA paths come from here, never from a request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def config_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: "k" value: { string_value: "v" } }`` as a plain dict."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ModelSettings:
    name: str
    model_dir: Path  # the model's folder inside the model repository
    params: dict[str, str]
    max_batch_size: int
    instance_kind: str  # "CPU", "GPU" or "MODEL"
    device_id: int

    @classmethod
    def from_triton_args(cls, args: Mapping[str, str]) -> ModelSettings:
        model_config = json.loads(args["model_config"])
        return cls(
            name=args["model_name"],
            model_dir=Path(args["model_repository"]),
            params=config_parameters(model_config),
            max_batch_size=int(model_config.get("max_batch_size", 0)),
            instance_kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id", 0)),
        )

    def get(self, key: str, default: str | None = None) -> str | None:
        value = self.params.get(key)
        return default if value is None or value == "" else value

    def flag(self, key: str) -> bool:
        return _flag(self.params.get(key))

    def model_source(self) -> str:
        """``model``: a local diffusers folder (relative to the model's folder) or a hub id."""
        source = self.get("model")
        if source is None:
            raise ValueError(f"model {self.name}: config.pbtxt needs a 'model' parameter (path or hub id)")
        path = Path(source).expanduser()
        if not path.is_absolute():
            path = self.model_dir / path
        if path.exists():
            return str(path.resolve())
        if source.startswith((".", "/", "~")):
            raise ValueError(f"model {self.name}: model path {path} does not exist (build tiny weights?)")
        return source  # a hub id

    def device(self) -> str:
        import torch

        wants_gpu = self.instance_kind in ("GPU", "MODEL")
        if wants_gpu and torch.cuda.is_available():
            return f"cuda:{self.device_id}"
        return "cpu"

    def torch_dtype(self, device: str):
        """``dtype``: auto (bf16 on GPU, fp32 on CPU), float32, float16, bfloat16 or float64 (exactness
        tests)."""
        import torch

        choice = (self.get("dtype", "auto") or "auto").lower()
        if choice == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        dtypes = {
            "float32": torch.float32,
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "float64": torch.float64,
        }
        if choice not in dtypes:
            raise ValueError(
                f"model {self.name}: dtype must be auto or one of {', '.join(dtypes)}, got {choice}"
            )
        return dtypes[choice]

    def max_rows_per_call(self) -> int:
        return int(self.get("max_rows_per_call", str(max(self.max_batch_size, 1))))
