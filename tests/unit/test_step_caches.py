"""Step caches per request inside the step engine's forwards (adapters/step_caches.py), in process, CPU fp32:
each served image equals diffusers' own cache hooks on the request's own pipeline call, alone and amid rows
with other thresholds, other methods, no cache, other step counts, late joiners and a cancelled neighbour.

The reference is diffusers' hooks themselves (``apply_first_block_cache`` / ``apply_taylorseer_cache``,
what ``transformer.enable_cache`` applies) on a second copy of the same weights, with a cache context for
pipelines that set none (SD3, PixArt). Each test checks that its cache reused work (from the job's counts)
and visibly changed the image, or it would prove nothing.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks import (
    FirstBlockCacheConfig,
    HookRegistry,
    TaylorSeerCacheConfig,
    apply_first_block_cache,
    apply_taylorseer_cache,
)
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from tests.unit.step_harness import load_family, reference, run_engine, served
from triton_diffusion.adapters.image_requests import ImageRequest
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.errors import RequestError
from triton_diffusion.step_cache_spec import NO_CACHE, parse_step_cache


@contextlib.contextmanager
def cache_on(transformer: torch.nn.Module, text: str) -> Iterator[None]:
    """diffusers' own cache on ``transformer`` for one pipeline call (fresh state), with a context for
    pipelines that set none."""
    spec = parse_step_cache(text)
    if not spec:
        yield
        return
    forget_registries(transformer)  # an uncached call left one whose cached child list is stale
    if spec.method == "fbc":
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=spec.threshold))
    else:
        config = TaylorSeerCacheConfig(cache_interval=spec.interval, disable_cache_before_step=spec.warmup)
        apply_taylorseer_cache(transformer, config)
    _set_cache_context(transformer, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(transformer, None)
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        for hook in ("fbc_leader_block_hook", "fbc_block_hook", "taylorseer_cache"):
            registry.remove_hook(hook, recurse=True)
        forget_registries(transformer)


def forget_registries(transformer: torch.nn.Module) -> None:
    """diffusers keeps a hook registry per module, and the transformer's caches its children's: a registry
    made for an uncached call would hide the hooks applied later from ``_set_cache_context``."""
    for module in transformer.modules():
        module.__dict__.pop("_diffusers_hook", None)


class Family:
    """A served pipeline with its step adapter, and a second copy of the same weights for diffusers'
    own cached calls."""

    def __init__(self, name: str, deeper: bool = False) -> None:
        self.pipe, self.facts, self.schedulers = load_family(name)
        self.reference_pipe, _, self.reference_schedulers = load_family(name)
        if deeper:  # FLUX.1 with four blocks: the blocks between the first and the last are gathered too
            config = {k: v for k, v in self.pipe.transformer.config.items() if not k.startswith("_")}
            torch.manual_seed(3)
            self.pipe.transformer = FluxTransformer2DModel(
                **{**config, "num_layers": 2, "num_single_layers": 2}
            )
            self.reference_pipe.transformer = copy.deepcopy(self.pipe.transformer)
        self.adapter = step_adapter_for(self.pipe, self.facts, self.schedulers, None)

    def request(self, i: int, cache: str, steps: int = 8, **changes) -> ImageRequest:
        request = ImageRequest(
            f"a lighthouse at dusk {i}",
            None,
            100 + i,
            0,
            64,
            64,
            steps,
            self.facts.default("guidance_scale"),
            1.0 if self.facts.accepts("true_cfg_scale") else None,
            self.schedulers.default,
            step_cache=parse_step_cache(cache),
        )
        return replace(request, **changes)

    def expected(self, request: ImageRequest) -> np.ndarray:
        with cache_on(self.reference_pipe.transformer, request.step_cache.text):
            image = reference(self.reference_pipe, self.facts, self.reference_schedulers, request)
        return np.asarray(image, dtype=int)


@pytest.fixture(scope="module")
def flux() -> Family:
    return Family("tiny-flux", deeper=True)


def check(family: Family, requests: list[ImageRequest], jobs: list) -> None:
    for request, job in zip(requests, jobs, strict=True):
        difference = np.abs(served(job) - family.expected(request)).max()
        assert difference <= 1, (request.step_cache.text, request.steps, difference)


def test_first_block_cache_alone_equals_diffusers_and_reuses(flux):
    request = flux.request(0, "fbc:0.5")
    (job,) = run_engine(flux.adapter, [(0, request)])
    assert job.rows_reused >= 4 and job.rows_computed >= 1, (job.rows_reused, job.rows_computed)
    uncached = served(run_engine(flux.adapter, [(0, replace(request, step_cache=NO_CACHE))])[0])
    assert np.abs(served(job) - uncached).max() > 5, "the cache does not visibly change the image"
    check(flux, [request], [job])


def test_taylorseer_alone_equals_diffusers_and_predicts(flux):
    request = flux.request(0, "taylorseer:3:2")
    (job,) = run_engine(flux.adapter, [(0, request)])
    assert job.rows_reused == 4, job.rows_reused  # steps 2, 3, 5, 6 predicted
    check(flux, [request], [job])


def test_rows_with_their_own_caches_share_forwards_and_each_equals_its_own_call(flux):
    # Two thresholds, TaylorSeer, no cache, other step counts, late joiners, true CFG (each branch its
    # own state), and a neighbour cancelled after its second step.
    requests = [
        flux.request(0, "fbc:0.5"),
        flux.request(1, "fbc:0.2"),
        flux.request(2, "taylorseer:2"),
        flux.request(3, "none", steps=6),
        flux.request(4, "fbc:0.4", negative_prompt="blurry", true_cfg_scale=4.0),
        flux.request(5, "taylorseer:2:1", steps=5, negative_prompt="dark", true_cfg_scale=3.0),
    ]
    arrivals = [
        (0, requests[0]),
        (0, requests[1]),
        (1, requests[2]),
        (2, requests[3]),
        (2, requests[4]),
        (4, requests[5]),
    ]
    victim = flux.request(9, "fbc:0.3")
    jobs = run_engine(flux.adapter, arrivals, victim=victim)
    assert max(job.most_shared for job in jobs) >= 5, "cached rows did not share forwards"
    assert all(job.rows_reused > 0 for i, job in enumerate(jobs) if i != 3)
    assert jobs[3].rows_reused == 0 and jobs[4].rows_computed + jobs[4].rows_reused == 16  # two branches
    check(flux, requests, jobs)


def test_an_image_conditioned_row_keeps_its_own_cache(flux):
    source = served(run_engine(flux.adapter, [(0, flux.request(7, "none"))])[0]).astype(np.uint8)
    from PIL import Image

    image = Image.fromarray(source)
    requests = [
        flux.request(0, "fbc:0.3", image=image, strength=0.75),
        flux.request(1, "taylorseer:2:1", image=image, strength=0.9),
        flux.request(2, "fbc:0.5"),
    ]
    jobs = run_engine(flux.adapter, [(0, r) for r in requests])
    assert jobs[0].rows_reused > 0 and jobs[1].rows_reused > 0
    check(flux, requests, jobs)


def test_a_failed_forward_changes_no_cache_state(flux):
    # A forward that raises after the first block decided (out of memory): the retry must decide the same
    # way, so nothing of the failed forward may have reached the job's cache state.
    request = flux.request(0, "fbc:0.5")
    (job,) = run_engine(flux.adapter, [(0, request)])
    state = job.state.cache.branches[0]
    before = (state.head_residual, state.tail_residuals)
    plan = flux.adapter.cache_plan([job], [()])
    assert plan is not None and not plan.staged
    with flux.adapter.caching(plan):
        latents, timesteps, inputs, _ = flux.adapter.forward_inputs([job], [job.state.timesteps[-1]])
        flux.adapter.predict(latents, timesteps, inputs, (64, 64))
    assert plan.staged  # the forward ran and staged its updates, which nobody committed
    assert (state.head_residual, state.tail_residuals) == before


def test_sd3_taylorseer_equals_diffusers_alone_and_amid_other_rows():
    sd3 = Family("tiny-sd3")
    assert sd3.adapter.cache_methods == ("taylorseer",)  # diffusers' FBC fails on SD3's last block
    requests = [
        sd3.request(0, "taylorseer:2"),
        sd3.request(1, "none", steps=6),
        sd3.request(2, "taylorseer:3:1", steps=7, guidance_scale=1.0),  # no CFG: one row
        sd3.request(3, "taylorseer:2:2", guidance_scale=7.0),
    ]
    (alone,) = run_engine(sd3.adapter, [(0, requests[0])])
    uncached = served(run_engine(sd3.adapter, [(0, replace(requests[0], step_cache=NO_CACHE))])[0])
    assert alone.rows_reused > 0 and np.abs(served(alone) - uncached).max() > 5
    check(sd3, requests[:1], [alone])
    jobs = run_engine(sd3.adapter, [(0, requests[0]), (1, requests[1]), (2, requests[2]), (2, requests[3])])
    check(sd3, requests, jobs)


@pytest.mark.parametrize("name", ["tiny-pixart-sigma", "tiny-wan"])
def test_first_block_cache_on_pixart_and_wan_equals_diffusers(name):
    family = Family(name)
    assert family.adapter.cache_methods == ("fbc",)
    video = {"num_frames": 9} if name == "tiny-wan" else {}
    requests = [family.request(0, "fbc:0.5", steps=6, **video), family.request(1, "none", steps=5, **video)]
    jobs = run_engine(family.adapter, [(0, r) for r in requests], host=None)
    assert jobs[0].rows_reused > 0
    if video:  # a video: compared frame by frame with WanPipeline's own cached call
        for request, job in zip(requests, jobs, strict=True):
            with cache_on(family.reference_pipe.transformer, request.step_cache.text):
                expected = wan_reference(family, request)
            assert np.abs(np.asarray(job.request.channel.finals[0]["image"], dtype=int) - expected).max() <= 1
        return
    check(family, requests, jobs)


def wan_reference(family: Family, request: ImageRequest) -> np.ndarray:
    from triton_diffusion.adapters.diffusers_pipeline import row_generator
    from triton_diffusion.codecs.video import to_uint8

    frames = family.reference_pipe(
        prompt=[request.prompt],
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        generator=[row_generator(request.seed, 0)],
        output_type="np",
    ).frames[0]
    return np.asarray(to_uint8(frames), dtype=int)


@pytest.mark.parametrize(
    "text, says",
    [
        ("fbc", "malformed"),
        ("fbc:0", "outside 0 < threshold <= 1"),
        ("fbc:1.5", "outside"),
        ("fbc:nan", "outside"),
        ("fbc:x", "is not a number"),
        ("taylorseer:0", "INTERVAL 1..1000"),
        ("taylorseer:2:-1", "WARMUP 0..1000"),
        ("taylorseer:two", "integers"),
        ("taylorseer:4:0", "WARMUP 0 needs INTERVAL 1"),
        ("teacache:0.1", "unknown method 'teacache'"),
        ("none:1", "malformed"),
    ],
)
def test_a_bad_step_cache_names_the_field_and_what_is_allowed(text, says):
    with pytest.raises(RequestError) as raised:
        parse_step_cache(text)
    assert raised.value.code.value == "INVALID_ARG"
    assert raised.value.message.startswith("step_cache: ") and says in raised.value.message
    assert "fbc:THRESHOLD" in raised.value.message


def test_the_canonical_text_round_trips():
    for text in ("none", "fbc:0.08", "taylorseer:5:3"):
        assert parse_step_cache(text).text == text
    assert parse_step_cache("TaylorSeer:4").text == "taylorseer:4:3"


def test_lora_rows_keep_their_adapters_on_the_rows_that_run_gathered(caplog):
    # FLUX.1 with LoRA adapters loaded once: rows with different adapters (or none) and different caches
    # share forwards; a reusing row skips the last block, so the rows that run it are a subset whose
    # adapters must follow them. Reference: diffusers' load_lora_weights + set_adapters + its own cache.
    from diffusers import DiffusionPipeline

    from tests.unit.test_lora import reference as lora_reference
    from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices
    from triton_diffusion.adapters.lora import load_loras
    from triton_diffusion.families import PipelineFacts
    from triton_diffusion.serving.server_process import WEIGHTS
    from triton_diffusion.tiny_models import build_missing

    adapters = {"ink": "tiny-flux-lora-ink", "neon": "tiny-flux-lora-neon"}
    build_missing(WEIGHTS, only=["tiny-flux", *adapters.values()])

    def pipeline():
        pipe = DiffusionPipeline.from_pretrained(WEIGHTS / "tiny-flux", use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    served_pipe, reference_pipe = pipeline(), pipeline()
    bank = load_loras(served_pipe, WEIGHTS, adapters, "m")
    for name, folder in adapters.items():
        reference_pipe.load_lora_weights(str(WEIGHTS / folder), adapter_name=name)
    facts = PipelineFacts.of(served_pipe)
    schedulers = SchedulerChoices(served_pipe, facts, (), "m")
    adapter = step_adapter_for(served_pipe, facts, schedulers, None)
    adapter.loras = bank

    def request(i: int, cache: str, lora: tuple) -> ImageRequest:
        return ImageRequest(
            "a red house", None, 7 + i, 0, 64, 64, 8, 3.5, 1.0, schedulers.default,
            lora=lora, step_cache=parse_step_cache(cache),
        )  # fmt: skip

    requests = [
        request(0, "fbc:1.0", (("ink", 1.0),)),
        request(1, "none", (("neon", 0.7),)),
        request(2, "taylorseer:2:1", (("neon", 1.0),)),
        request(3, "fbc:1.0", (("ink", 0.5), ("neon", 1.2))),
        request(4, "taylorseer:3:1", ()),
    ]
    with caplog.at_level("WARNING", logger="triton_diffusion"):
        jobs = run_engine(adapter, [(0, r) for r in requests])
    # a forward that failed would be retried in halves and still be exact: it must not have failed
    assert not [r for r in caplog.records if "forward of" in r.getMessage()]
    assert all(jobs[i].rows_reused > 0 for i in (0, 2, 3, 4)), [j.rows_reused for j in jobs]
    for req, job in zip(requests, jobs, strict=True):
        with cache_on(reference_pipe.transformer, req.step_cache.text):
            expected = lora_reference(reference_pipe, facts, req)
        assert np.abs(served(job) - expected).max() <= 1, (req.lora, req.step_cache.text)
