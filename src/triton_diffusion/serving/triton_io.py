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

from triton_diffusion.errors import RequestError, invalid_field, short_text, tagged_message
from triton_diffusion.fields import FieldSet, merge_parameters
from triton_diffusion.serving.metrics import FAMILIES, BatchingMetrics


def read_raw_fields(request: Any, fields: FieldSet) -> dict[str, Any]:
    """Collect what the request sent, as Python scalars, before validation. Anything unreadable raises a
    RequestError for this request only (naming the input or parameter when it is known)."""
    raw: dict[str, Any] = {}
    for field in fields:
        try:
            tensor = pb_utils.get_input_tensor_by_name(request, field.input_name)
            array = None if tensor is None else tensor.as_numpy()
        except Exception as exc:  # noqa: BLE001  (an unreadable tensor fails this request only)
            raise invalid_field(field.input_name, f"cannot be read ({type(exc).__name__})") from None
        if array is not None:
            raw[field.name] = _scalar(field.name, array, keep_bytes=field.type is bytes)
    return merge_parameters(raw, _parameters(request), fields)


def _parameters(request: Any) -> dict[str, Any]:
    """The request parameters. Triton hands them over as one JSON text; it raises before that text exists
    when a parameter holds invalid UTF-8 (possible over HTTP), so no single name can be blamed. A string
    parameter (name or value) with a NUL in it arrives cut at the NUL, over gRPC and HTTP alike (Triton's
    frontends pass it to its core as a C string): the text holds no trace of it, so it cannot be refused
    here; the same value as an input tensor is refused by its field (fields.py)."""
    try:
        text = request.parameters()
    except UnicodeDecodeError as exc:
        raise invalid_field(
            "parameters", f"a request parameter is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    except Exception as exc:  # noqa: BLE001
        raise invalid_field("parameters", f"cannot be read ({type(exc).__name__})") from None
    try:
        parameters = json.loads(text) if text else {}
    except ValueError:
        raise invalid_field("parameters", "are not a JSON object") from None
    if not isinstance(parameters, dict):
        raise invalid_field("parameters", "are not a JSON object")
    return parameters


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


def request_id(request: Any) -> str:
    """The request's id for logs, or "-"; an id that cannot be read never fails the request."""
    try:
        value = request.request_id() or "-"
    except Exception:  # noqa: BLE001
        return "-"
    return value if len(value) <= 64 and value.isprintable() else short_text(value, 64)


def _response(outputs: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in outputs.items()])


class TritonChannel:
    """A request's response sender and cancellation flag (the ``ResponseChannel`` of serving/requests.py).
    Work that outlives ``execute()`` keeps this, not the request."""

    def __init__(self, request: Any) -> None:
        self._sender = request.get_response_sender()
        self._request = request

    def send_partial(self, outputs: Mapping[str, np.ndarray]) -> None:
        self._sender.send(_response(outputs), flags=0)

    def send_final(self, outputs: Mapping[str, np.ndarray]) -> None:
        self._sender.send(_response(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_error(self, error: RequestError) -> None:
        code = getattr(pb_utils.TritonError, error.code.value)
        self._sender.send(
            pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged_message(error), code)),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


def progress_outputs(step: int, total: int, preview: bytes | None) -> dict[str, np.ndarray]:
    """A non-final response between two denoising steps."""
    outputs = {
        "STEP": np.array([[step]], dtype=np.int32),
        "TOTAL_STEPS": np.array([[total]], dtype=np.int32),
    }
    if preview is not None:
        outputs["PREVIEW"] = np.array([[preview]], dtype=object)
    return outputs


def batching_metrics(model: str, families: dict[str, tuple[str, str]] = FAMILIES) -> BatchingMetrics:
    return BatchingMetrics(pb_utils, model, families)


class TritonLogHandler(logging.Handler):
    """Forward the package's log records to Triton's log, so they follow its format and verbosity."""

    def emit(self, record: logging.LogRecord) -> None:
        try:  # a log line must never raise into the code that answers requests
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(message)
            else:
                pb_utils.Logger.log_info(message)
        except Exception:  # noqa: BLE001
            self.handleError(record)


def install_log_handler() -> None:
    logger = logging.getLogger("triton_diffusion")
    if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
        logger.addHandler(TritonLogHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def request_timeout_us(request: Any) -> int:
    """Triton's per-request timeout in microseconds (tritonclient's ``timeout=`` over gRPC), 0 for none."""
    try:
        return max(int(request.timeout()), 0)
    except Exception:  # noqa: BLE001  (an unreadable timeout is no timeout)
        return 0
