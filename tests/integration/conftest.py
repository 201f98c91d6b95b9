from pathlib import Path

import pytest

from tests.faults import copy_model
from triton_diffusion.serving.server_process import WEIGHTS, set_batching, start_server
from triton_diffusion.tiny_models import build_missing

# A long queue delay makes the dynamic batcher reliably collect concurrently sent requests into one
# execute() call, so the tests can see fusing; the shipped configs use a short one.
QUEUE_DELAY_US = 300_000
FAULT_INJECTION = '{"fail_on_prompt": "__explode__", "oom_above_rows": 3}'
STEP_DELAY = '{"step_delay_s": 0.08}'
# The step engine's stalled step, and its hold (faults.py): a request whose prompt carries __hold__ waits
# before its second forward until another job arrives, so a second request certainly joins it.
STEP_SLOW = '{"step_delay_s": 0.06, "hold_on_prompt": "__hold__"}'
# The hold alone (no stall): concurrently sent requests whose prompts carry it share forwards.
HOLD = '{"hold_on_prompt": "__hold__"}'
# The diffusion LM with a stalled step (so a request can join or be cancelled mid-generation) and a
# forward that fails while a prompt contains __explode__.
DLLM_FAULTS = '{"step_delay_s": 0.025, "fail_on_prompt": "__explode__"}'

# The tiny SD adapters (tiny_models/lora.py) the LoRA models serve, by adapter name.
LORA_WEIGHTS = {"ink": "tiny-sd-lora-ink", "neon": "tiny-sd-lora-neon"}
LORAS = "{" + ", ".join(f'\\"{n}\\": \\"{WEIGHTS / w}\\"' for n, w in LORA_WEIGHTS.items()) + "}"

# These models run the request-level engine (one fused diffusers call per compatible group): the tests
# of fusing, keys, bisection, OOM splits and compaction are about it. The step engine has its own models
# below and its own tests (test_step_engine.py).
FAMILIES = {
    "text_to_image": {"source": "text_to_image", "weights": "tiny-sd"},
    "text_to_image_flux": {"source": "text_to_image_flux", "weights": "tiny-flux"},
}
REQUEST_LEVEL = {"engine": "request"}
SD_SCHEDULERS = {"scheduler_choices": "EulerDiscreteScheduler,DPMSolverMultistepScheduler"}
# The step engine (the default for these families), with other schedulers to choose from for SD.
STEP_MODELS = {
    "sd_step": {"source": "text_to_image", "weights": "tiny-sd", **SD_SCHEDULERS},
    "flux_step": {"source": "text_to_image_flux", "weights": "tiny-flux"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here starts a real tritonserver (or drives scripts that do): marked ``integration``, so
    ``pytest -m "not integration"`` is the fast loop. (Which worker runs it: tests/conftest.py.)"""
    here = Path(__file__).parent
    for item in items:
        if Path(item.path).parent == here:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    build_missing(WEIGHTS)
    build_missing(WEIGHTS, only=list(LORA_WEIGHTS.values()))
    repo = tmp_path_factory.mktemp("model_repository")
    for name, spec in FAMILIES.items():
        copy_model(spec["source"], repo, name, {"model": str(WEIGHTS / spec["weights"]), **REQUEST_LEVEL})
        set_batching(repo, name, QUEUE_DELAY_US)
    # Same pipeline as text_to_image, with the test-only failure hooks switched on.
    copy_model(
        "text_to_image",
        repo,
        "text_to_image_faults",
        {"model": str(WEIGHTS / "tiny-sd"), "fault_injection": FAULT_INJECTION, **REQUEST_LEVEL},
    )
    set_batching(repo, "text_to_image_faults", QUEUE_DELAY_US)
    # Each family again with a stalled step, so a test can cancel a request in the middle of a call.
    for name, spec in FAMILIES.items():
        copy_model(
            spec["source"],
            repo,
            f"{name}_slow",
            {"model": str(WEIGHTS / spec["weights"]), "fault_injection": STEP_DELAY, **REQUEST_LEVEL},
        )
        set_batching(repo, f"{name}_slow", QUEUE_DELAY_US)
    for name, spec in STEP_MODELS.items():
        edits = {k: v for k, v in spec.items() if k not in ("source", "weights")}
        copy_model(spec["source"], repo, name, {"model": str(WEIGHTS / spec["weights"]), **edits})
        # A stalled step, so requests can join, leave and be cancelled mid-way.
        copy_model(
            spec["source"],
            repo,
            f"{name}_slow",
            {"model": str(WEIGHTS / spec["weights"]), "fault_injection": STEP_SLOW, **edits},
        )
    # The step engine with the failure hooks: a failing forward, a simulated out-of-memory above 3 rows.
    faults = {"model": str(WEIGHTS / "tiny-sd"), "fault_injection": FAULT_INJECTION}
    copy_model("text_to_image", repo, "sd_step_faults", faults)
    copy_model("image_to_image", repo, "image_to_image", {"model": str(WEIGHTS / "tiny-sd")})
    set_batching(repo, "image_to_image", QUEUE_DELAY_US)
    copy_model("text_to_video", repo, "text_to_video", {"model": str(WEIGHTS / "tiny-wan")})
    set_batching(repo, "text_to_video", QUEUE_DELAY_US)
    # LoRA adapters per request: the step engine (rows with different adapters share forwards) and the
    # request-level engine (the adapters are part of the compatibility key).
    loras = {"model": str(WEIGHTS / "tiny-sd"), "loras": LORAS}
    copy_model("text_to_image", repo, "sd_lora", {**loras, "fault_injection": HOLD})
    copy_model("text_to_image", repo, "sd_lora_request", {**loras, **REQUEST_LEVEL})
    set_batching(repo, "sd_lora_request", QUEUE_DELAY_US)
    # Step caches per request and answers to repeated requests (test_service_and_caches.py).
    copy_model(
        "text_to_image_flux",
        repo,
        "flux_cached",
        {"model": str(WEIGHTS / "tiny-flux"), "result_cache_mb": "16"},
    )
    # The same img2img request on both engines (test_service_and_caches.py): image_to_image over the tiny
    # FLUX.1 weights on the request-level engine, its prompts encoded as text_to_image_flux's.
    copy_model(
        "image_to_image",
        repo,
        "flux_img2img_request",
        {"model": str(WEIGHTS / "tiny-flux"), "max_sequence_length": "64", **REQUEST_LEVEL},
    )
    # Service tiers: one running job at a time and a stalled step, so a higher tier must pause a lower one.
    copy_model(
        "text_to_image",
        repo,
        "sd_tiers",
        {"model": str(WEIGHTS / "tiny-sd"), "max_running": "1", "fault_injection": STEP_SLOW},
    )
    # float64, so the tests can compare the served tokens with the one-request reference run here.
    copy_model(
        "diffusion_lm", repo, "diffusion_lm", {"model": str(WEIGHTS / "tiny-dllm"), "dtype": "float64"}
    )
    copy_model(
        "diffusion_lm",
        repo,
        "diffusion_lm_slow",
        {"model": str(WEIGHTS / "tiny-dllm"), "fault_injection": DLLM_FAULTS},
    )
    log_path = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    models = [
        *FAMILIES,
        "text_to_image_faults",
        *(f"{name}_slow" for name in FAMILIES),
        "image_to_image",
        "text_to_video",
        "diffusion_lm",
        "diffusion_lm_slow",
        *STEP_MODELS,
        *(f"{name}_slow" for name in STEP_MODELS),
        "sd_step_faults",
        "sd_lora",
        "sd_lora_request",
        "flux_cached",
        "flux_img2img_request",
        "sd_tiers",
    ]
    # Every model of the session loads here (a stub each, each importing torch): on 2 busy cores that took
    # more than the default 180 s, which failed every test of the session at once.
    running = start_server(repo, log_path, models, timeout_s=420)
    yield running
    running.stop()


@pytest.fixture(params=list(FAMILIES))
def family(request):
    """Each integration test runs on the UNet (tiny SD) and the flow-matching (tiny Flux) family."""
    return request.param
