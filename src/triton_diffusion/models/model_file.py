"""What a model.py names: ``TritonPythonModel = serve("text_to_image")``, a model kind by the KIND its
MODEL_INFO says.

Triton's Python backend starts a stub for each model only to ask it for its config
(``auto_complete_config``: the inputs and outputs, which no config.pbtxt lists), the config stub, and then
another for each instance. This module, and what the config stub imports through it, import neither torch
nor diffusers: the
kind's fields and outputs come from models/interfaces.py, and its module (the pipeline, the engine) is
imported when Triton makes an instance. A start and a crash restart load every model of the repository at
once on the host's cores, so each second of imports the config stub saves is saved for every model.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from triton_diffusion.fields import REQUIRED
from triton_diffusion.models.interfaces import INTERFACES, Interface

if TYPE_CHECKING:
    from triton_diffusion.serving.triton_model import ModelKind

# Each kind's class, by module and name: imported by the instance that serves it (models/kinds.py lists the
# same classes for the type checker; a test holds the two to each other).
KIND_CLASSES = {
    "text_to_image": ("triton_diffusion.models.text_to_image", "TextToImageModel"),
    "image_to_image": ("triton_diffusion.models.image_to_image", "ImageToImageModel"),
    "text_to_video": ("triton_diffusion.models.text_to_video", "TextToVideoModel"),
    "text_generation": ("triton_diffusion.models.diffusion_lm", "DiffusionLMModel"),
}


def kind_class(kind: str) -> type[ModelKind]:
    module, name = KIND_CLASSES[kind]
    return getattr(importlib.import_module(module), name)


def add_io_to_config(auto_complete_model_config: Any, interface: Interface) -> Any:
    """Declare every field as an input tensor, and the outputs. Triton needs one input in every request
    to batch it: the first required field (the prompt) stays required. Every other field is optional to
    Triton, also a required one (the image), so it can come as a request parameter; the field
    declarations refuse a missing one with a clear error."""
    fields = interface.fields
    anchor = next((f.name for f in fields if f.default is REQUIRED), None)
    for field in fields:
        auto_complete_model_config.add_input(
            {
                "name": field.input_name,
                "data_type": field.triton_data_type,
                "dims": [1],
                "optional": field.name != anchor,
            }
        )
    for name, data_type, dims in interface.outputs:
        auto_complete_model_config.add_output({"name": name, "data_type": data_type, "dims": dims})
    auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
    return auto_complete_model_config


def serve(kind: str | type[ModelKind]) -> type:
    """Triton's ``TritonPythonModel`` for a model kind, by its KIND (or a kind class, as the tests' faults
    wrap one). Each instance Triton makes is a serving/triton_model.py ``TritonModel`` over a new kind."""
    interface = INTERFACES[kind] if isinstance(kind, str) else Interface(kind.FIELDS, kind.OUTPUTS)
    named = kind if isinstance(kind, str) else kind.__name__

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config: Any) -> Any:
            return add_io_to_config(auto_complete_model_config, interface)

        def __init__(self) -> None:
            from triton_diffusion.serving.triton_model import TritonModel

            served = kind_class(kind) if isinstance(kind, str) else kind
            self.model = TritonModel(served())

        def initialize(self, args: dict[str, str]) -> None:
            self.model.initialize(args)

        def execute(self, requests: Sequence[Any]) -> None:
            return self.model.execute(requests)

        def finalize(self) -> None:
            self.model.finalize()

    TritonPythonModel.__doc__ = f"{named}, served by Triton's Python backend."
    return TritonPythonModel
