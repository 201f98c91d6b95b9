"""Per-request LoRA adapters (adapters/lora.py), in process, CPU fp32.

Rows with different adapter sets, scales or none share the step engine's forwards; each image must equal
diffusers' own ``load_lora_weights`` + ``set_adapters(names, adapter_weights)`` + ``pipe(...)`` for the same
arguments and generator (<= 1 uint8), for SD 1.x, SDXL and FLUX.1. The tiny adapters change the image
visibly (checked), so equality proves the right adapters reached the right rows. Plus the request field's
bad inputs and the loader's refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DiffusionPipeline

from tests.unit.step_harness import call_arguments, run_engine, served
from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.lora import (
    LoraLimits,
    load_loras,
    lora_file,
    lora_set,
    lora_text,
    parse_lora,
)
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.config_values import parse_lora_paths
from triton_diffusion.errors import RequestError
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.settings import ModelConfig
from triton_diffusion.tiny_models import build_missing

LIMITS = LoraLimits(("ink", "neon"), max_scale=2.0, max_per_request=2)


# ---- the request field ----------------------------------------------------------------------------
def test_the_field_reads_names_and_scales_in_order():
    assert parse_lora(None, LIMITS) == ()
    assert parse_lora("ink", LIMITS) == (("ink", 1.0),)
    assert parse_lora(" neon:0.8 , ink:-1.5", LIMITS) == (("neon", 0.8), ("ink", -1.5))
    adapters = parse_lora("ink:0.123456789,neon:2", LIMITS)
    assert lora_set(lora_text(adapters)) == adapters  # the canonical text round-trips exactly


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("pixel", "unknown adapter 'pixel' (allowed names: ink, neon)"),
        ("ink:", "is not a number"),
        ("ink:x", "is not a number"),
        ("ink:nan", "outside -2..2"),
        ("ink:inf", "outside -2..2"),
        ("ink:2.5", "outside -2..2"),
        ("ink,ink:0.5", "names 'ink' twice"),
        ("ink,neon,ink:2", "twice"),
        ("ink,", "unknown adapter ''"),
        ("../ink.safetensors", "unknown adapter"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_what_is_allowed(text, says):
    with pytest.raises(RequestError) as raised:
        parse_lora(text, LIMITS)
    assert raised.value.code.value == "INVALID_ARG"
    assert "lora" in raised.value.message and says in raised.value.message


def test_too_many_adapters_are_refused():
    with pytest.raises(RequestError, match="at most 1"):
        parse_lora("ink,neon", LoraLimits(("ink", "neon"), 2.0, 1))


# ---- loading ------------------------------------------------------------------------------------
def test_config_paths_and_files_safetensors_only(tmp_path):
    assert parse_lora_paths('{"ink": "a/b"}') == {"ink": "a/b"}
    for bad in ('["x"]', '{"ink": 3}', "{", '{"a,b": "x"}', '{"a:b": "x"}'):
        with pytest.raises(ValueError, match="loras|LoRA name|JSON|name"):
            ModelConfig.parse({"loras": bad}, ["image_source"], [], "m")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_lora_weights.bin").write_bytes(b"\x80\x04")
    (tmp_path / "adapter.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="safetensors only"):
        lora_file(tmp_path, "pickled", "pickled")
    with pytest.raises(ValueError, match="not a .safetensors file"):
        lora_file(tmp_path, "bin", "adapter.bin")
    with pytest.raises(ValueError, match="does not exist"):
        lora_file(tmp_path, "gone", "gone.safetensors")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "style.safetensors").write_bytes(b"")
    assert lora_file(tmp_path, "ok", "ok") == tmp_path / "ok" / "style.safetensors"


def test_an_adapter_for_another_model_is_a_load_error_naming_it_and_the_layer():
    build_missing(WEIGHTS, only=["tiny-sd", "tiny-sdxl-lora-ink"])
    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / "tiny-sd", use_safetensors=True)
    with pytest.raises(ValueError) as raised:
        load_loras(pipe, WEIGHTS, {"wrong": "tiny-sdxl-lora-ink"}, "m")
    message = str(raised.value)
    assert "LoRA 'wrong'" in message and "does not fit the model" in message
    assert "size mismatch for" in message and ".lora_A.wrong.weight" in message, message


# ---- mixed adapters in one forward, exact ------------------------------------------------------
FAMILIES = ["tiny-sd", "tiny-sdxl", "tiny-flux"]
# (adapters, steps, guidance, arrives at engine step): none, one, two with other scales, a negative scale;
# the same prompt and seed for the first three, so only the adapters tell them apart.
ROWS = [
    ((), 3, 4.0, 0),
    ((("ink", 1.0),), 3, 4.0, 0),
    ((("ink", 0.5), ("neon", 1.3)), 3, 4.0, 0),
    ((("neon", -0.8),), 4, 1.0, 1),
    ((("ink", 1.0),), 2, 6.0, 2),
]


@pytest.fixture(scope="module", params=FAMILIES)
def lora_family(request):
    name = request.param
    adapters = {"ink": f"{name}-lora-ink", "neon": f"{name}-lora-neon"}
    build_missing(WEIGHTS, only=[name, *adapters.values()])

    def pipeline():
        pipe = DiffusionPipeline.from_pretrained(WEIGHTS / name, use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    served_pipe = pipeline()
    bank = load_loras(served_pipe, WEIGHTS, adapters, name)
    reference_pipe = pipeline()
    for adapter, folder in adapters.items():  # diffusers' own way, from the same files
        reference_pipe.load_lora_weights(str(WEIGHTS / folder), adapter_name=adapter)
    return served_pipe, bank, reference_pipe


def reference(pipe, facts, request: ImageParams):
    if request.lora:
        pipe.enable_lora()
        pipe.set_adapters([n for n, _ in request.lora], adapter_weights=[s for _, s in request.lora])
    else:
        pipe.disable_lora()
    kwargs = call_arguments(request)
    if facts.uses_guidance_scale:
        kwargs["guidance_scale"] = request.guidance_scale
    return np.asarray(pipe(**kwargs).images[0], dtype=int)


def test_rows_with_different_adapters_share_forwards_and_each_equals_diffusers_set_adapters(lora_family):
    pipe, bank, reference_pipe = lora_family
    facts = PipelineFacts.of(pipe)
    schedulers = SchedulerChoices(pipe, facts, (), "m")
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    adapter.loras = bank
    requests = [
        ImageParams(
            "a red house" if i < 3 else f"prompt {i}",
            None,
            7 if i < 3 else 20 + i,
            0,
            64,
            64,
            steps,
            guidance,
            None,
            schedulers.default,
            lora=adapters,
        )
        for i, (adapters, steps, guidance, _) in enumerate(ROWS)
    ]
    jobs = run_engine(adapter, [(row[3], request) for row, request in zip(ROWS, requests, strict=True)])
    assert max(job.stats.most_shared for job in jobs) >= 4, (
        "rows with different adapters did not share forwards"
    )
    images = [served(job) for job in jobs]
    assert np.abs(images[0] - images[1]).max() > 20, "the adapter does not visibly change the image"
    assert np.abs(images[1] - images[2]).max() > 20, "other scales do not visibly change the image"
    for request, image in zip(requests, images, strict=True):
        expected = reference(reference_pipe, facts, request)
        assert np.abs(image - expected).max() <= 1, (facts.class_name, request.lora)


def test_a_plan_never_outlives_its_call_and_stacked_copies_stay_bounded(lora_family):
    pipe, bank, _ = lora_family
    mixed = [(("ink", 1.0),), (("neon", 0.5), ("ink", 0.2)), ()]
    with pytest.raises(RuntimeError, match="boom"), bank.rows(mixed, lambda t: t):
        raise RuntimeError("boom")  # a forward that raises (out of memory, a lost device)
    assert bank._plan is None
    assert len(bank._stacks) <= bank.layers  # one stacked copy per layer at most, whatever the mixes
