"""The only module that talks to ``triton_python_backend_utils``: reading requests, sending responses.

A field may arrive as an input tensor (``HEIGHT``) or as a request parameter (``height``). Parameters do
not split Triton batches, differing sets of optional inputs do, so clients should send one uniform set.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_diffusion.errors import RequestError, invalid_field
from triton_diffusion.fields import REQUIRED, FieldSet
from triton_diffusion.serving.metrics import FAMILIES, BatchingMetrics


def read_raw_fields(request: Any, fields: FieldSet) -> dict[str, Any]:
    """Collect what the request sent, as Python scalars, before validation."""
    raw: dict[str, Any] = {}
    for field in fields:
        tensor = pb_utils.get_input_tensor_by_name(request, field.input_name)
        if tensor is not None:
            raw[field.name] = _scalar(field.name, tensor.as_numpy(), keep_bytes=field.type is bytes)
    text = request.parameters()
    parameters = json.loads(text) if text else {}
    for name, value in parameters.items():
        canonical = name.lower()
        if canonical in raw:
            raise invalid_field(canonical, "sent both as an input tensor and as a request parameter")
        raw[canonical] = value
    return raw


def _scalar(name: str, array: np.ndarray, keep_bytes: bool = False) -> Any:
    if array.size != 1:
        raise invalid_field(name, f"expected one value (shape [1, 1]), got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes) and not keep_bytes:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise invalid_field(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if isinstance(value, np.generic):
        return value.item()
    return value


def _sender(target: Any) -> Any:
    """A request's response sender. Work that outlives ``execute()`` keeps the sender, not the request."""
    return target.get_response_sender() if hasattr(target, "get_response_sender") else target


def send_final(target: Any, outputs: Mapping[str, np.ndarray]) -> None:
    """The FINAL response with ``outputs``; ``target`` is a request or its response sender."""
    tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
    _sender(target).send(
        pb_utils.InferenceResponse(output_tensors=tensors),
        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )


def send_partial(target: Any, outputs: Mapping[str, np.ndarray]) -> None:
    """A non-final response (a streamed block of text)."""
    tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
    _sender(target).send(pb_utils.InferenceResponse(output_tensors=tensors), flags=0)


def send_progress(request: Any, step: int, total: int, preview: bytes | None) -> None:
    """A non-final response between two denoising steps."""
    outputs = {
        "STEP": np.array([[step]], dtype=np.int32),
        "TOTAL_STEPS": np.array([[total]], dtype=np.int32),
    }
    if preview is not None:
        outputs["PREVIEW"] = np.array([[preview]], dtype=object)
    send_partial(request, outputs)


def send_error(target: Any, error: RequestError) -> None:
    code = getattr(pb_utils.TritonError, error.code.value)
    _sender(target).send(
        pb_utils.InferenceResponse(error=pb_utils.TritonError(error.message, code)),
        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )


def add_io_to_config(
    auto_complete_model_config: Any, fields: FieldSet, outputs: list[tuple[str, str, list[int]]]
) -> Any:
    """Declare every field as an optional input tensor (required ones not optional) and the outputs."""
    for field in fields:
        auto_complete_model_config.add_input(
            {
                "name": field.input_name,
                "data_type": field.triton_data_type,
                "dims": [1],
                "optional": field.default is not REQUIRED,
            }
        )
    for name, data_type, dims in outputs:
        auto_complete_model_config.add_output({"name": name, "data_type": data_type, "dims": dims})
    auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
    return auto_complete_model_config


def batching_metrics(model: str, families: dict[str, tuple[str, str]] = FAMILIES) -> BatchingMetrics:
    return BatchingMetrics(pb_utils, model, families)


class TritonLogHandler(logging.Handler):
    """Forward the package's log records to Triton's log, so they follow its format and verbosity."""

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


def install_log_handler() -> None:
    logger = logging.getLogger("triton_diffusion")
    if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
        logger.addHandler(TritonLogHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False
