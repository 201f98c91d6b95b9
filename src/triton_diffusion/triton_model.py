"""The shared Triton Python model: parse -> plan -> fused calls -> one FINAL response per request.

A model kind (text-to-image, ...) subclasses :class:`BatchedDiffusionModel` and says which fields it
accepts, how to load its pipeline, how to run a list of rows in one call and how to answer a request.
Everything about batching lives here and in ``planner``/``executor``; all work runs inside
``execute()``, so Triton's queue statistics stay right and its dynamic batcher keeps forming batches.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from triton_diffusion.compatibility import CompatibilityKey, compatibility_key
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.executor import CallRecord, FusedCallExecutor
from triton_diffusion.fields import FieldSet
from triton_diffusion.planner import PlannedRequest, Row, RowCaps, plan_groups
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class ParsedRequest:
    index: int
    values: dict[str, Any]
    key: CompatibilityKey
    rows: int


@dataclass(frozen=True)
class RowInput:
    """One row of a fused call: the request's validated values and which of its images this row is."""

    values: dict[str, Any]
    image_index: int


class BatchedDiffusionModel:
    FIELDS: ClassVar[FieldSet]
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]]

    # ---- what a model kind provides -------------------------------------------------------------
    def load(self, settings: ModelSettings) -> FieldSet:
        """Load the pipeline; return FIELDS configured with this model's defaults and limits."""
        raise NotImplementedError

    def rows_for(self, values: dict[str, Any]) -> int:
        return 1

    def run_rows(self, key: CompatibilityKey, rows: list[RowInput]) -> list[Any]:
        """One fused pipeline call; one output per row, in row order."""
        raise NotImplementedError

    def respond(
        self, request: ParsedRequest, outputs: list[Any], calls: list[CallRecord]
    ) -> dict[str, np.ndarray]:
        raise NotImplementedError

    # ---- Triton entry points ----------------------------------------------------------------------
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        from triton_diffusion.triton_io import add_io_to_config

        return add_io_to_config(auto_complete_model_config, cls.FIELDS, cls.OUTPUTS)

    def initialize(self, args: dict[str, str]) -> None:
        from triton_diffusion.triton_io import install_log_handler

        install_log_handler()
        self.settings = ModelSettings.from_triton_args(args)
        self.fields = self.load(self.settings)
        self.caps = RowCaps.from_config(
            self.settings.max_rows_per_call(), self.settings.get("max_rows_by_resolution")
        )
        self.executor = FusedCallExecutor(self._run_planned_rows)
        self._batch: dict[int, ParsedRequest] = {}
        log.info(
            "%s ready: max_rows_per_call=%d caps_by_resolution=%s",
            self.settings.name,
            self.caps.max_rows,
            dict(self.caps.by_resolution),
        )

    def execute(self, requests: Sequence[Any]) -> None:
        from triton_diffusion.triton_io import send_error

        answered: set[int] = set()
        try:
            self._execute(requests, answered)
        except Exception as exc:  # noqa: BLE001  (every request must still get its FINAL response)
            log.exception("execute failed")
            error = RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            for index, request in enumerate(requests):
                if index not in answered:
                    send_error(request, error)
        finally:
            self._batch = {}
        return None

    def finalize(self) -> None:
        log.info("%s unloaded", self.settings.name)

    # ---- the batching path ------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any]) -> ParsedRequest:
        values = self.fields.parse(raw)
        if "seed" in values and values["seed"] is None:
            values["seed"] = random.randrange(2**32)  # drawn here so the response can return it
        return ParsedRequest(index, values, compatibility_key(self.fields, values), self.rows_for(values))

    def _execute(self, requests: Sequence[Any], answered: set[int]) -> None:
        from triton_diffusion.triton_io import read_raw_fields, send_error, send_final

        def answer_error(index: int, error: RequestError) -> None:
            answered.add(index)
            send_error(requests[index], error)

        for index, request in enumerate(requests):
            try:
                self._batch[index] = self.parse(index, read_raw_fields(request, self.fields))
            except RequestError as error:
                answer_error(index, error)

        def on_complete(index: int, outputs: list[Any], calls: list[CallRecord]) -> None:
            try:
                response = self.respond(self._batch[index], outputs, calls)
            except RequestError as error:
                answer_error(index, error)
                return
            except Exception as exc:  # noqa: BLE001  (an encoding failure fails this request only)
                answer_error(index, RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                return
            answered.add(index)
            send_final(requests[index], response)

        planned = [PlannedRequest(p.index, p.key, p.rows) for p in self._batch.values()]
        calls = plan_groups(planned, self.caps.cap_for)
        self.executor.run(calls, {p.index: p.rows for p in planned}, on_complete, answer_error)

    def _run_planned_rows(self, key: CompatibilityKey, rows: list[Row]) -> list[Any]:
        return self.run_rows(
            key, [RowInput(self._batch[r.request_index].values, r.image_index) for r in rows]
        )
