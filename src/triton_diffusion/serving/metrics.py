"""Batching metrics exported through Triton's custom metrics API (``pb_utils.MetricFamily``).

They appear on Triton's metrics port (``:8002/metrics``) next to Triton's own, labelled by model.
Every family and metric object is kept referenced here: the Python backend drops a metric whose Python
object is collected, and later calls on it raise.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("triton_diffusion")

ROWS_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]
SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]

# name -> (kind, description); docs/reference/metrics.md is generated from these.
FAMILIES = {
    "triton_diffusion_fused_call_rows": ("HISTOGRAM", "Rows (images) per fused pipeline call"),
    "triton_diffusion_execute_requests": ("HISTOGRAM", "Requests per execute() call"),
    "triton_diffusion_fused_calls_total": ("COUNTER", "Fused pipeline calls, retries included"),
    "triton_diffusion_groups_cut_total": ("COUNTER", "Fused calls cut short, by reason"),
    "triton_diffusion_first_step_seconds": (
        "HISTOGRAM",
        "Per request: time from execute() entry to its first finished denoising step",
    ),
    "triton_diffusion_pipeline_seconds": ("HISTOGRAM", "Pipeline time per fused call"),
    "triton_diffusion_rows_cancelled_total": ("COUNTER", "Rows whose request was cancelled while running"),
    "triton_diffusion_requests_failed_total": ("COUNTER", "Requests answered with an error, by error code"),
    "triton_diffusion_bisection_retries_total": ("COUNTER", "Failed fused calls split in two and retried"),
    "triton_diffusion_oom_splits_total": ("COUNTER", "Fused calls split after running out of memory"),
    "triton_diffusion_rows_in_flight": ("GAUGE", "Images in the running fused call, or in the step engine"),
    # The step engine's own:
    "triton_diffusion_forward_images": ("HISTOGRAM", "Step engine: images per forward"),
    "triton_diffusion_forward_model_rows": (
        "HISTOGRAM",
        "Step engine: model rows per forward (an image with classifier-free guidance is 2)",
    ),
    "triton_diffusion_step_seconds": (
        "HISTOGRAM",
        "Step engine: device seconds per forward (on a GPU by CUDA events, recorded a step or more later)",
    ),
    "triton_diffusion_forward_adapters": (
        "HISTOGRAM",
        "Step engine: distinct LoRA adapters per forward (forwards with adapters only)",
    ),
    "triton_diffusion_packing_decisions_total": (
        "COUNTER",
        "Step engine: forwards whose jobs were of several sizes, run packed or by size (the packing gate's "
        "decision, by the engine's cost fit)",
    ),
    "triton_diffusion_forwards_narrowed_total": (
        "COUNTER",
        "Step engine: forwards narrowed for a deadline (fewer jobs than the caps allow: config "
        "narrow_forwards)",
    ),
    "triton_diffusion_admission_wait_seconds": (
        "HISTOGRAM",
        "Per request: time execute() waited for room in the engine (running set and waiting room)",
    ),
}

# Service tiers and deadlines (engine/ordering.py, scheduler.py): every step-engine model.
SERVICE_FAMILIES = {
    "triton_diffusion_tier_latency_seconds": (
        "HISTOGRAM",
        "Per request: execute() entry to its FINAL response, by service tier",
    ),
    "triton_diffusion_tier_first_step_seconds": (
        "HISTOGRAM",
        "Per request: execute() entry to its first denoising step, by service tier",
    ),
    "triton_diffusion_deadlines_total": (
        "COUNTER",
        "Requests with a deadline: met, missed (done late, or ended when it passed) or refused at admission",
    ),
    "triton_diffusion_preemptions_total": ("COUNTER", "Running jobs paused to make room for a higher tier"),
    "triton_diffusion_paused_jobs": ("GAUGE", "Jobs paused for a higher tier after the last engine step"),
    "triton_diffusion_forward_cost_seconds": (
        "GAUGE",
        "Step engine: the cost model a forward is priced by (MODEL_INFO cost_model), by fit (tokens: the "
        "line deadlines and the drain use; tokens_and_rows: the packing gate's plane) and part (fixed, "
        "per_token, per_row), in seconds; set at most once a second, once the fit is determined (NaN if "
        "it is not any more)",
    ),
    "triton_diffusion_packed_forward_cost_ratio": (
        "GAUGE",
        "Step engine: what forwards of several sizes run packed took over the cost plane's price for their "
        "rows and tokens (MODEL_INFO cost_model packed_over_plane: the factor the packing gate prices a "
        "packed forward by); set with the cost model, once a packed forward was measured (NaN while the "
        "plane gives no price)",
    ),
}
FAMILIES.update(SERVICE_FAMILIES)
FAMILIES.update(
    {
        "triton_diffusion_cache_rows_total": (
            "COUNTER",
            "Step engine: denoiser row-steps run in full (outcome computed) or served from a request's step "
            "cache (outcome reused), by method",
        ),
        "triton_diffusion_degraded_total": (
            "COUNTER",
            "Requests answered degraded (fewer steps than asked, or a step cache for the steps left), where "
            "their deadline needed it, by service tier",
        ),
        "triton_diffusion_degraded_steps_total": (
            "COUNTER",
            "Steps cut from degraded requests' images (num_inference_steps asked minus run), by service tier",
        ),
        "triton_diffusion_degraded_caches_total": (
            "COUNTER",
            "Images of degraded requests given their degrade_step_cache for the steps they had left, by "
            "service tier",
        ),
        "triton_diffusion_result_cache_hits_total": (
            "COUNTER",
            "Requests answered from the result cache (result_cache_mb) without running",
        ),
    }
)

# The diffusion LM (step-level continuous batching) has its own.
DIFFUSION_LM_FAMILIES = {
    "triton_diffusion_execute_requests": ("HISTOGRAM", "Requests per execute() call"),
    "triton_diffusion_lm_forward_rows": ("HISTOGRAM", "Rows per shared forward (a CFG request has two)"),
    "triton_diffusion_lm_step_seconds": (
        "HISTOGRAM",
        "Device seconds per shared forward and its commits (on a GPU by CUDA events, a step or more later)",
    ),
    "triton_diffusion_lm_forwards_total": ("COUNTER", "Shared forwards run"),
    "triton_diffusion_lm_tokens_total": ("COUNTER", "Tokens generated (up to EOS) by finished requests"),
    "triton_diffusion_lm_running_requests": ("GAUGE", "Requests in the running set after the last step"),
    "triton_diffusion_lm_admission_wait_seconds": (
        "HISTOGRAM",
        "Per request: time execute() waited for room in the running set and waiting room",
    ),
    "triton_diffusion_lm_first_block_seconds": (
        "HISTOGRAM",
        "Per request: time from execute() to its first streamed block",
    ),
    "triton_diffusion_lm_requests_cancelled_total": ("COUNTER", "Requests cancelled while generating"),
    "triton_diffusion_requests_failed_total": ("COUNTER", "Requests answered with an error, by error code"),
    **SERVICE_FAMILIES,
}


@dataclass(frozen=True)
class MetricNames:
    """Which metric the engine host records each event under, per model kind."""

    first_step: str  # per request: execute() entry to its first step (or first streamed block)
    first_step_on_snapshot: bool  # the first step counts only when it carries a snapshot (an LM block)
    admission_wait: str
    forward_model_rows: str
    step_seconds: str
    running: str
    cancelled: str
    forward_images: str | None = None
    forwards_total: str | None = None
    forward_adapters: str | None = None
    cache_rows: str | None = None  # step caches: row-steps computed and reused, by method


IMAGE_METRICS = MetricNames(
    first_step="triton_diffusion_first_step_seconds",
    first_step_on_snapshot=False,
    admission_wait="triton_diffusion_admission_wait_seconds",
    forward_model_rows="triton_diffusion_forward_model_rows",
    step_seconds="triton_diffusion_step_seconds",
    running="triton_diffusion_rows_in_flight",
    cancelled="triton_diffusion_rows_cancelled_total",
    forward_images="triton_diffusion_forward_images",
    forward_adapters="triton_diffusion_forward_adapters",
    cache_rows="triton_diffusion_cache_rows_total",
)
DIFFUSION_LM_METRICS = MetricNames(
    first_step="triton_diffusion_lm_first_block_seconds",
    first_step_on_snapshot=True,
    admission_wait="triton_diffusion_lm_admission_wait_seconds",
    forward_model_rows="triton_diffusion_lm_forward_rows",
    step_seconds="triton_diffusion_lm_step_seconds",
    running="triton_diffusion_lm_running_requests",
    cancelled="triton_diffusion_lm_requests_cancelled_total",
    forwards_total="triton_diffusion_lm_forwards_total",
)


class BatchingMetrics:
    """Labelled metrics, created on first use. Safe from any thread, and never raises: a metrics failure
    is logged once per metric and must never cost a request its answer."""

    def __init__(self, pb_utils: Any, model: str, families: dict[str, tuple[str, str]] = FAMILIES) -> None:
        self._pb = pb_utils
        self._kinds = {name: kind for name, (kind, _) in families.items()}
        self._labels = {"model": model}
        self._families = {
            name: pb_utils.MetricFamily(
                name=name, description=text, kind=getattr(pb_utils.MetricFamily, kind)
            )
            for name, (kind, text) in families.items()
        }
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._lock = threading.Lock()
        self._broken: set[str] = set()

    def _metric(self, name: str, **labels: str) -> Any:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:  # created once, even when two threads ask at the same time
            if key not in self._metrics:
                family = self._families[name]
                all_labels = {**self._labels, **labels}
                if self._kinds[name] == "HISTOGRAM":
                    buckets = SECONDS_BUCKETS if name.endswith("_seconds") else ROWS_BUCKETS
                    self._metrics[key] = family.Metric(labels=all_labels, buckets=buckets)
                else:
                    self._metrics[key] = family.Metric(labels=all_labels)
            return self._metrics[key]

    def _apply(self, name: str, action: str, value: float, labels: dict[str, str]) -> None:
        try:
            getattr(self._metric(name, **labels), action)(value)
        except Exception:  # noqa: BLE001
            if name not in self._broken:
                self._broken.add(name)
                log.exception("metric %s: %s failed (logged once)", name, action)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._apply(name, "observe", value, labels)

    def increment(self, name: str, value: float = 1, **labels: str) -> None:
        self._apply(name, "increment", value, labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._apply(name, "set", value, labels)
