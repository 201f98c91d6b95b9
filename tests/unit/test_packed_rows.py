"""Packed forwards (adapters/packed_rows.py): rows of different sizes in one denoiser call on FLUX.1 and SD3.

Each row of a packed forward gets what it gets alone (the model), each image equals its pipeline called alone
at its size and seed (the engine, amid rows of other sizes, a LoRA row, an img2img row and a cached row),
and the count of model calls shows the sizes shared them: counted by a hook on the transformer, not by the
engine's own report.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from tests.faults import FaultInjection, FaultyStepAdapter
from tests.unit.recording import RecordingChannel, step_as_worker
from tests.unit.step_harness import (
    Host,
    assert_each_image_equals_the_pipelines_own,
    job_of,
    load_family,
    reference,
    run_engine,
    served,
)
from tests.unit.test_degradation import allowance
from tests.unit.test_lora import reference as lora_reference
from tests.unit.test_preemption import run_with_a_late_priority_request
from tests.unit.test_step_caches import ComputedRows
from triton_diffusion.adapters.dit import DiTAdapter
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.lora import load_loras
from triton_diffusion.adapters.packed_rows import Canvas, canvas_for
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine, computed_by
from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.settings import ModelConfig, ModelSettings
from triton_diffusion.step_cache_spec import NO_CACHE, parse_step_cache
from triton_diffusion.tiny_models import build_missing

# (height, width): the three CPU sizes, 64x64, 96x64 and 64x128 (WIDTHxHEIGHT).
SIZES = [(64, 64), (64, 96), (128, 64)]


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-sd3"])
def family(request):
    return load_family(request.param)


def adapter_of(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert adapter is not None and adapter.sizes.packing.on, facts.class_name
    return adapter


class ModelCalls:
    """Calls of the transformer, counted by a forward hook (independent of the engine's bookkeeping)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, 0

    def __enter__(self) -> ModelCalls:
        self.handle = self.model.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def random_rows(adapter, sizes, seed: int = 0) -> list[torch.Tensor]:
    """A latent row per size, in the family's loop layout (FLUX.1's packed 2x2 patches)."""
    generator = torch.Generator().manual_seed(seed)
    factor = adapter.pipe.vae_scale_factor
    channels = adapter.pipe.vae.config.latent_channels
    rows = []
    for height, width in sizes:
        latents = torch.randn(1, channels, height // factor, width // factor, generator=generator)
        rows.append(adapter.pack(latents, (height, width)))
    return rows


def model_inputs(adapter, rows: int, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-row timesteps and text conditioning, drawn at random in the model's shapes."""
    generator = torch.Generator().manual_seed(seed)
    config = adapter.model.config
    text = torch.randn(rows, 16, config.joint_attention_dim, generator=generator)
    inputs = {
        "encoder_hidden_states": text,
        "pooled_projections": torch.randn(rows, config.pooled_projection_dim, generator=generator),
    }
    if adapter.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5, 2.0, 5.0][:rows])
    timesteps = adapter.timestep_rows([torch.tensor(t) for t in (900.0, 500.0, 120.0)][:rows])
    return timesteps, inputs


def test_each_row_of_a_packed_forward_gets_what_it_gets_alone_and_the_mask_matters(family, monkeypatch):
    adapter = adapter_of(family)
    rows = random_rows(adapter, SIZES)
    timesteps, inputs = model_inputs(adapter, len(rows))
    with torch.inference_mode():
        alone = [
            adapter.predict(row, timesteps[i : i + 1], {k: v[i : i + 1] for k, v in inputs.items()}, size)
            for i, (row, size) in enumerate(zip(rows, SIZES, strict=True))
        ]
        packed, padded = adapter.sizes.predict_packed(adapter.predict, rows, timesteps, inputs, SIZES)
        # Without the key mask, rows attend to padding: the comparison below would fail.
        monkeypatch.setattr(Canvas, "key_mask", lambda *args, **kwargs: None)
        unmasked, _ = adapter.sizes.predict_packed(adapter.predict, rows, timesteps, inputs, SIZES)
    tokens = [adapter.sizes.token_grid(size)[0] * adapter.sizes.token_grid(size)[1] for size in SIZES]
    assert padded == 3 * max(g[0] for g in map(adapter.sizes.token_grid, SIZES)) * max(
        g[1] for g in map(adapter.sizes.token_grid, SIZES)
    ) - sum(tokens)
    for size, own, mine, leaky in zip(SIZES, alone, packed, unmasked, strict=True):
        assert mine.shape == own.shape, size
        assert (mine - own).abs().max() <= 1e-4, (size, (mine - own).abs().max())
        assert (leaky - own).abs().max() > 1e-2, (size, "the mask changed nothing")  # every row pads


def test_sd3_rows_sit_where_their_crop_of_the_position_table_lies():
    # PatchEmbed crops its table around the centre: a 4x4 grid inside an 8x6 canvas of a 64-wide table.
    canvas = canvas_for([(4, 4), (4, 6), (8, 4)], centred_in=64)
    assert (canvas.height, canvas.width) == (8, 6)
    assert [(r.top, r.left) for r in canvas.rows] == [(2, 1), (2, 0), (0, 1)]
    assert canvas.padded_tokens == 3 * 48 - (16 + 24 + 32)
    at_origin = canvas_for([(4, 4), (4, 6), (8, 4)])
    assert [(r.top, r.left) for r in at_origin.rows] == [(0, 0)] * 3


def source_image(size: tuple[int, int]) -> Image.Image:
    height, width = size
    y, x = np.indices((height, width))
    pixels = np.stack([(x * 4) % 256, (y * 3) % 256, ((x + y) * 2) % 256], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8))


def mixed_requests(family) -> list[tuple[int, ImageParams]]:
    """Three sizes, each with its own steps, guidance and CFG, an img2img row at the middle size and a
    late joiner: (arrives at engine step, request)."""
    _, facts, schedulers = family
    default = schedulers.default

    def request(
        i: int, size: tuple[int, int], steps: int, negative: str | None = None, **more
    ) -> ImageParams:
        return ImageParams(f"mixed {i}", negative, 40 + i, 0, *size, steps, 5.0, 2.0, default, **more)

    return [
        (0, request(0, SIZES[0], 4)),
        (0, request(1, SIZES[1], 4, "blurry")),
        (0, request(2, SIZES[2], 3)),
        (1, request(3, SIZES[1], 4, image=source_image(SIZES[1]), strength=0.7)),
        (2, request(4, SIZES[0], 3, "dark")),
        (
            1,
            request(
                5, SIZES[2], 4, image=source_image(SIZES[2]), strength=0.8, mask_image=mask_image(SIZES[2])
            ),
        ),
    ]


def mask_image(size: tuple[int, int]) -> Image.Image:
    height, width = size
    mask = np.zeros((height, width), dtype=np.uint8)
    mask[height // 4 : 3 * height // 4, 5 : width // 2 + 3] = 255  # off the latent grid: resized as diffusers
    return Image.fromarray(mask).convert("RGB")


def test_images_of_three_sizes_share_forwards_and_each_equals_its_pipeline_alone(family, monkeypatch):
    pipe, facts, schedulers = family
    adapter = adapter_of(family)
    arrivals = mixed_requests(family)
    host = Host()
    # A neighbour of the middle size cancelled after its second step, and previews of the first job.
    victim = ImageParams("cancel me", None, 99, 0, *SIZES[1], 6, 5.0, 2.0, schedulers.default)
    with ModelCalls(adapter.model) as packed:
        jobs = run_engine(adapter, arrivals, host, victim, first_preview_every=1)
    factor = adapter.pipe.vae_scale_factor
    assert len(host.previews) == jobs[0].run.total_steps, "a preview after every step"
    assert all(tuple(p.shape[-2:]) == (SIZES[0][0] // factor, SIZES[0][1] // factor) for p in host.previews)
    packing = adapter.sizes.packing
    adapter.sizes.packing = replace(packing, on=False)  # one size per forward: the same images, more calls
    try:
        with ModelCalls(adapter.model) as by_shape:
            by_size = run_engine(adapter, arrivals)
    finally:
        adapter.sizes.packing = packing
    # By shape, one call per size in flight at each step: three sizes for the first three steps at least.
    assert by_shape.calls >= packed.calls + 4, (packed.calls, by_shape.calls)
    assert max(host.forwards) >= 5, "no forward held more than two sizes' jobs"  # at most three of a size
    # The control: the same packed run without the key mask (rows attend to the padding) misses the
    # pipeline's images by more than the tolerance, so the comparison below can fail.
    monkeypatch.setattr(Canvas, "key_mask", lambda *args, **kwargs: None)
    unmasked = run_engine(adapter, arrivals)
    monkeypatch.undo()
    worst_unmasked = 0
    for (_, request), job, other, leaky in zip(arrivals, jobs, by_size, unmasked, strict=True):
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        image = served(job)
        assert image.shape == (request.height, request.width, 3)
        assert np.abs(image - expected).max() <= 1, (facts.class_name, request.size, request.start)
        assert np.abs(served(other) - expected).max() <= 1, ("by shape", facts.class_name, request.size)
        worst_unmasked = max(worst_unmasked, int(np.abs(served(leaky) - expected).max()))
    assert worst_unmasked > 5, ("without the mask the images would still pass", worst_unmasked)


# A step cache and step count per family that move the tiny model's image by more than 5 levels and skip
# rows (fbc:0.2 and fbc:0.5 skip none on tiny FLUX.1; SD3's TaylorSeer moves a 4-step image by 2 levels):
# so the checks below can tell a cache applied from one ignored.
CACHES = {"FluxPipeline": ("fbc:0.9", 4), "StableDiffusion3Pipeline": ("taylorseer:2", 6)}


def test_a_cached_job_keeps_to_its_size_and_shares_with_uncached_jobs_of_it(family):
    pipe, facts, schedulers = family
    adapter = adapter_of(family)
    method, steps = CACHES[facts.class_name]
    arrivals = mixed_requests(family)[:3]
    cached = replace(
        arrivals[0][1], prompt="cached", seed=77, steps=steps, step_cache=parse_step_cache(method)
    )
    # The cached job first: its size's group goes first (the oldest job's), and the uncached job of its size
    # joins it (scheduler.py: a job of every size joins a forward of its own shape's group).
    jobs = run_engine(adapter, [(0, cached), *arrivals])
    assert jobs[0].run.group == SIZES[0] and all(job.run.group != SIZES[0] for job in jobs[1:])
    assert jobs[0].stats.most_shared == 2, "the cached job did not share with the uncached one of its size"
    assert jobs[2].stats.most_shared == 2, "the uncached jobs of the other two sizes did not share a forward"
    # Alone, with and without its cache: the rows the transformer's blocks ran on, counted by hooks on
    # torch's own modules (not by the engine's counters), and the images.
    with ComputedRows(adapter.pipe.transformer) as with_cache:
        (alone,) = run_engine(adapter, [(0, cached)])
    with ComputedRows(adapter.pipe.transformer) as without:
        (uncached,) = run_engine(adapter, [(0, replace(cached, step_cache=NO_CACHE))])
    assert np.abs(served(jobs[0]) - served(alone)).max() <= 1
    assert with_cache.rows < without.rows, ("the cache computed every row", with_cache.rows, without.rows)
    moved = np.abs(served(alone) - served(uncached)).max()
    assert moved > 5, (method, "moves the image by only", moved)


def test_a_row_that_fails_fails_alone_in_a_packed_forward(family):
    pipe, facts, schedulers = family
    adapter = adapter_of(family)
    arrivals = mixed_requests(family)[:3]
    culprit = replace(arrivals[1][1], prompt="boom here", seed=5)
    faulty = FaultyStepAdapter(
        adapter, FaultInjection(fail_on_prompt="boom"), lambda job: job.spec.params.prompt
    )
    engine = StepEngine(faulty, EngineLimits(8, 8))
    jobs = [
        job_of(adapter, str(i), RecordingChannel(), r) for i, (_, r) in enumerate([*arrivals, (0, culprit)])
    ]
    for job in jobs:
        engine.add(job)
    host = Host()
    while engine.active:
        host.render(step_as_worker(engine))
    assert jobs[3].request.channel.finals[0].code.value == "INTERNAL"
    assert min(job.stats.most_shared for job in jobs[:3]) >= 2, "the others did not go on sharing forwards"
    for (_, request), job in zip(arrivals, jobs[:3], strict=True):
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        (final,) = job.request.channel.finals
        assert np.abs(np.asarray(final["image"], dtype=int) - expected).max() <= 1, request.size


def test_a_job_paused_in_a_packed_forward_resumes_and_equals_its_pipeline():
    family = load_family("tiny-flux")
    adapter = adapter_of(family)
    _, _, schedulers = family

    def request(i: int, size: tuple[int, int], steps: int) -> ImageParams:
        return ImageParams(f"a tower {i}", None, 70 + i, 0, *size, steps, 3.5, 1.0, schedulers.default)

    background = [request(0, SIZES[0], 6), request(1, SIZES[2], 5)]
    jobs, _ = run_with_a_late_priority_request(adapter, background, request(2, SIZES[1], 3))
    assert jobs[0].queue.pauses == 1, "the flex job was not paused"
    assert jobs[1].stats.most_shared == 2 and jobs[2].stats.most_shared == 2, "sizes did not share forwards"
    assert_each_image_equals_the_pipelines_own(family, [*background, request(2, SIZES[1], 3)], jobs)


LORAS = {"ink": "tiny-flux-lora-ink", "neon": "tiny-flux-lora-neon"}


def test_rows_of_other_sizes_and_adapters_share_a_forward_each_equal_to_diffusers_set_adapters():
    build_missing(WEIGHTS, only=["tiny-flux", *LORAS.values()])
    pipe, facts, schedulers = load_family("tiny-flux")
    adapter = adapter_of((pipe, facts, schedulers))
    adapter.loras = load_loras(pipe, WEIGHTS, LORAS, "tiny-flux")
    reference_pipe = DiffusionPipeline.from_pretrained(WEIGHTS / "tiny-flux", use_safetensors=True)
    reference_pipe.set_progress_bar_config(disable=True)
    for name, folder in LORAS.items():
        reference_pipe.load_lora_weights(str(WEIGHTS / folder), adapter_name=name)
    adapters = [(), (("ink", 1.0),), (("ink", 0.5), ("neon", 1.3))]
    requests = [
        ImageParams("a red house", None, 7, 0, *size, 3, 4.0, None, schedulers.default, lora=lora)
        for size, lora in zip(SIZES, adapters, strict=True)
    ]
    with ModelCalls(adapter.model) as calls:
        jobs = run_engine(adapter, [(0, r) for r in requests])
    assert calls.calls == 3, "rows of three sizes did not share each of their 3 steps' forward"
    for request, job in zip(requests, jobs, strict=True):
        expected = lora_reference(reference_pipe, facts, request)
        assert np.abs(served(job) - expected).max() <= 1, (request.size, request.lora)


def test_a_job_cut_for_its_deadline_equals_its_pipeline_amid_other_sizes_and_a_lora_row():
    """Degradation amid packed sizes and a LoRA row (issue 50): a 64x64 job asking 8 steps with a deadline
    they miss (the estimate says its forward alone takes 0.5 s; the clock stands still) is cut, shares each
    forward it runs with a 96x64 job under a LoRA and a 64x128 job (counted by a hook on the transformer),
    and equals FluxPipeline at the steps it ran; the others equal theirs at what they asked."""
    build_missing(WEIGHTS, only=["tiny-flux", LORAS["ink"]])
    pipe, facts, schedulers = load_family("tiny-flux")
    adapter = adapter_of((pipe, facts, schedulers))
    adapter.loras = load_loras(pipe, WEIGHTS, {"ink": LORAS["ink"]}, "tiny-flux")
    reference_pipe = DiffusionPipeline.from_pretrained(WEIGHTS / "tiny-flux", use_safetensors=True)
    reference_pipe.set_progress_bar_config(disable=True)
    reference_pipe.load_lora_weights(str(WEIGHTS / LORAS["ink"]), adapter_name="ink")

    def request(size: tuple[int, int], steps: int, seed: int, **more) -> ImageParams:
        return ImageParams("a red house", None, seed, 0, *size, steps, 4.0, 1.0, schedulers.default, **more)

    cut, lora, other = (
        request(SIZES[0], 8, 3),
        request(SIZES[1], 4, 4, lora=(("ink", 1.0),)),
        request(SIZES[2], 4, 5),
    )
    times = WorkTimes()
    # The gate is off: this test is about the cut amid packed rows, not whether the fit would pack them.
    engine = StepEngine(adapter, EngineLimits(8, 8, packing_gate=False), clock=lambda: 0.0, times=times)
    jobs = [job_of(adapter, str(i), RecordingChannel(), r) for i, r in enumerate((cut, lora, other))]
    times.forward_ran(1, jobs[0].spec.tokens, 0.5)
    # 8 steps at 0.5 s a forward take 4 s: past its 2 s, so it is cut (to 3: within 90% of them).
    jobs[0].spec = replace(jobs[0].spec, deadline=2.0, steps_allowed=allowance(8, 2))
    engine.add(*jobs)
    host = Host()
    with ModelCalls(adapter.model) as calls:
        while engine.active:
            host.render(engine.step())
    given = jobs[0].queue.cut
    assert given is not None and given.steps == 3, given
    assert [job.queue.cut for job in jobs[1:]] == [None, None]
    assert calls.calls == 4, "the cut job did not share its 3 forwards with the other sizes"
    assert jobs[0].stats.packed_forwards == 3
    # The references come from a pipeline of its own (diffusers' load_lora_weights, LoRA off where a row
    # has none), not from the engine's pipeline whose layers the LoRA bank wraps.
    ran = replace(cut, steps=given.steps)
    assert np.abs(served(jobs[0]) - lora_reference(reference_pipe, facts, ran)).max() <= 1
    assert np.abs(served(jobs[0]) - lora_reference(reference_pipe, facts, cut)).max() > 5  # the cut shows
    assert np.abs(served(jobs[1]) - lora_reference(reference_pipe, facts, lora)).max() <= 1
    plain = lora_reference(reference_pipe, facts, replace(lora, lora=()))
    assert np.abs(served(jobs[1]) - plain).max() > 5  # the LoRA shows
    assert np.abs(served(jobs[2]) - lora_reference(reference_pipe, facts, other)).max() <= 1


def loaded(name: str, **config: str) -> TextToImageModel:
    build_missing(WEIGHTS, only=[name])
    texts = {"model": str(WEIGHTS / name), **config}
    settings = ModelSettings(
        "m", WEIGHTS, ModelConfig.parse(texts, ("image", "image_source"), [], "m"), {}, 4, "CPU", 0
    )
    model = TextToImageModel()
    model.fields, model.adapter = model.load(settings)
    model.settings = settings
    return model


@pytest.mark.parametrize(
    ("name", "config", "said"),
    [
        ("tiny-flux", {}, {"served": True}),
        ("tiny-sd3", {"pack_sizes": "false"}, {"served": False, "why_not": "config pack_sizes is false"}),
        ("tiny-sd", {}, {"served": False, "why_not": LatentStepAdapter.packing.why_not}),
        ("tiny-pixart-sigma", {}, {"served": False, "why_not": DiTAdapter.packing.why_not}),
    ],
)
def test_model_info_says_whether_sizes_share_forwards_and_why_not(name, config, said):
    model = loaded(name, **config)
    assert model.describe_more()["packed_sizes"] == said
    assert model.adapter.sizes.packing.on == said["served"]


def test_a_packing_adapter_counts_a_mixed_forward_by_its_canvas_and_one_size_by_its_own_tokens(family):
    """RowSizes.computed, what the scheduler's token budget and cost fit read: rows of one size
    compute their own tokens; rows of two sizes every row padded to the tallest by the widest grid."""
    adapter = adapter_of(family)
    _, _, schedulers = family

    def job(i: int, size: tuple[int, int], guidance: float) -> Job:
        params = ImageParams(f"count {i}", "dark", i, 0, *size, 2, guidance, 2.0, schedulers.default)
        return job_of(adapter, str(i), RecordingChannel(), params)

    small, also_small, tall = job(0, SIZES[0], 5.0), job(1, SIZES[0], 1.0), job(2, SIZES[2], 5.0)
    own = [j.spec.tokens for j in (small, also_small, tall)]
    grids = [adapter.sizes.grid_of(j.spec.params) for j in (small, also_small, tall)]
    assert adapter.computed([small, also_small]) == (grids[0][0] + grids[1][0], own[0] + own[1])
    rows = grids[0][0] + grids[2][0]
    canvas = max(grids[0][1], grids[2][1]) * max(grids[0][2], grids[2][2])
    assert adapter.computed([small, tall]) == (rows, rows * canvas)
    assert rows * canvas > own[0] + own[2], "a mixed forward computes its padding"
    faulty = FaultyStepAdapter(adapter, FaultInjection(), lambda job: job.spec.params.prompt)
    assert computed_by(faulty)([small, tall]) == (rows, rows * canvas)  # the test faults' wrapper too
