"""Step caches per request (adapters/step_caches.py), in process, CPU fp32: the step engine's per-row caches
and the request-level engine's diffusers cache (``call_cache``) against diffusers' own cache hooks.

The reference is diffusers' cache itself (``transformer.enable_cache``; for PixArt's transformer, which is
no CacheMixin, the hook that would apply) on a second copy of the same weights, in the request's own
pipeline call, each denoiser call under its CFG branch's cache context: the pipeline's own where its
``__call__`` names its calls (FluxPipeline, WanPipeline), else "uncond" for the call that carries true
CFG's negative prompt and "cond" for every other (named here from the call's pooled embeddings, not by the
code under test).

Every test of a cached image against diffusers' reference checks that the reference differs from the
uncached image by more than 5 uint8 levels (a cache that computed everything would fail it) and counts
what was computed itself (:class:`ComputedRows`: forward pre-hooks on the linear layers of the
transformer's blocks), apart from the cache's own counters. The test of other diffusers hooks on the same
modules compares with the same rows served without them (its images, what they reused and the rows
computed), and checks that every other hook ran.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks import (
    FirstBlockCacheConfig,
    HookRegistry,
    ModelHook,
    TaylorSeerCacheConfig,
    apply_first_block_cache,
    apply_group_offloading,
    apply_taylorseer_cache,
)
from diffusers.models.cache_utils import CacheMixin
from PIL import Image

from tests.unit.recording import RecordingChannel
from tests.unit.step_harness import load_family, pipeline_for, reference, run_engine, served
from triton_diffusion.adapters.call_caches import call_cache, names_its_calls
from triton_diffusion.adapters.diffusers_compat import registered_block_layout
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.adapters.step_caches import (
    BLOCK_LISTS,
    HOOK_PREFIX,
    TAYLOR_MODULES,
    BlockLayout,
    block_layout,
)
from triton_diffusion.engine.jobs import Job
from triton_diffusion.errors import RequestError
from triton_diffusion.models.image_to_image import ImageToImageModel
from triton_diffusion.serving.engines import RequestEngineKind
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.serving.triton_model import Urgency
from triton_diffusion.settings import ModelConfig, ModelSettings
from triton_diffusion.step_cache_spec import NO_CACHE, StepCache, parse_step_cache
from triton_diffusion.tiny_models import build_missing
from triton_diffusion.tiny_models.encoders import reinit_normal

# The pipelines whose __call__ runs each denoiser call under a cache context it names itself
# (``with self.transformer.cache_context("cond")`` / ``("uncond")``), read off diffusers 0.42's source.
NAMES_ITS_OWN_CALLS = {"FluxPipeline", "WanPipeline"}
MORE_THAN = 5  # uint8 levels by which a cache must change its reference image, or the test proves nothing


# ---- diffusers' own cache, the reference ---------------------------------------------------------------
def diffusers_config(spec: StepCache) -> Any:
    if spec.method == "fbc":
        return FirstBlockCacheConfig(threshold=spec.threshold)
    return TaylorSeerCacheConfig(cache_interval=spec.interval, disable_cache_before_step=spec.warmup)


def enable_diffusers_cache(transformer: torch.nn.Module, spec: StepCache) -> Callable[[], None]:
    """diffusers' cache on ``transformer``, fresh; returns what takes it off again."""
    config = diffusers_config(spec)
    if isinstance(transformer, CacheMixin):
        transformer.enable_cache(config)
        return transformer.disable_cache
    # PixArt's transformer is no CacheMixin: the hooks enable_cache would apply, applied directly.
    (apply_first_block_cache if spec.method == "fbc" else apply_taylorseer_cache)(transformer, config)
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.invalidate_child_registries_cache()

    def disable() -> None:
        for hook in ("fbc_leader_block_hook", "fbc_block_hook", "taylorseer_cache"):
            registry.remove_hook(hook, recurse=True)
        registry.invalidate_child_registries_cache()

    return disable


def negative_pooled(pipe: Any, request: ImageParams) -> torch.Tensor | None:
    """The pooled embeddings of the request's true-CFG negative prompt (FLUX.1), which its negative
    branch's denoiser calls carry; None without true CFG."""
    if request.negative_prompt is None or (request.true_cfg_scale or 0.0) <= 1.0:
        return None
    _, pooled, _ = pipe.encode_prompt(
        prompt=[request.negative_prompt], prompt_2=None, device=pipe.device, num_images_per_prompt=1
    )
    return pooled


@contextlib.contextmanager
def cache_on(pipe: Any, request: ImageParams) -> Iterator[None]:
    """diffusers' own cache for one call of ``pipe`` (fresh state), each denoiser call under its branch's
    context: the pipeline's own where it names its calls; else, wrapped here, "uncond" for a call with the
    negative prompt's pooled embeddings and "cond" for every other (one call a step where the pipeline
    batches its CFG branches: SD3, PixArt)."""
    spec = request.step_cache
    if not spec:
        yield
        return
    transformer = pipe.transformer
    disable = enable_diffusers_cache(transformer, spec)
    own_forward = transformer.__dict__.get("forward")
    try:
        if type(pipe).__name__ not in NAMES_ITS_OWN_CALLS:
            negative = negative_pooled(pipe, request)
            forward = transformer.forward

            def named(*args: Any, **kwargs: Any) -> Any:
                pooled = kwargs.get("pooled_projections")
                uncond = negative is not None and pooled is not None and torch.equal(pooled, negative)
                with CacheMixin.cache_context(transformer, "uncond" if uncond else "cond"):
                    return forward(*args, **kwargs)

            transformer.forward = named
        yield
    finally:
        if own_forward is None:
            transformer.__dict__.pop("forward", None)
        else:
            transformer.forward = own_forward
        disable()


class ComputedRows:
    """The batch rows the linear layers inside a transformer's blocks ran on, summed over every call
    (forward pre-hooks on torch's own modules): what was computed, whatever a cache's counters say. A
    block a cache skips, or an attention module whose output it predicts, adds nothing for those rows."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer
        self.rows = 0

    def __enter__(self) -> ComputedRows:
        self.handles = [
            module.register_forward_pre_hook(self._count)
            for name, module in self.transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and "blocks." in name and "lora_" not in name
        ]
        assert self.handles, "no linear layer in the transformer's blocks"
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def _count(self, module: torch.nn.Module, args: tuple) -> None:
        self.rows += args[0].shape[0]


# ---- families -------------------------------------------------------------------------------------------
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
            # Drawn as the tiny models are (tiny_models/): under PyTorch's fan-in init TaylorSeer's
            # predictions move the image by 1-2 levels, too little to tell predicting from computing.
            reinit_normal(self.pipe.transformer, 0.1)
            self.reference_pipe.transformer = copy.deepcopy(self.pipe.transformer)
        self.adapter = step_adapter_for(self.pipe, self.facts, self.schedulers, None)

    def request(self, i: int, cache: str, steps: int = 8, **changes) -> ImageParams:
        request = ImageParams(
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

    def diffusers_image(self, request: ImageParams) -> tuple[np.ndarray, int]:
        """The request's own diffusers pipeline call under diffusers' cache: its image and the rows its
        transformer's blocks computed."""
        pipe = pipeline_for(self.reference_pipe, request)
        with cache_on(pipe, request), ComputedRows(pipe.transformer) as rows:
            image = reference(self.reference_pipe, self.facts, self.reference_schedulers, request)
        return np.asarray(image, dtype=int), rows.rows


@pytest.fixture(scope="module")
def flux() -> Family:
    return Family("tiny-flux", deeper=True)


def run_counted(adapter: Any, arrivals: list, **options: Any) -> tuple[list[Job], int]:
    """:func:`run_engine`, and the rows the adapter's transformer blocks computed meanwhile."""
    with ComputedRows(adapter.pipe.transformer) as rows:
        jobs = run_engine(adapter, arrivals, **options)
    return jobs, rows.rows


def check(
    family: Family | None,
    requests: list[ImageParams],
    images: list[np.ndarray],
    run: Callable[[ImageParams], tuple[np.ndarray, int]] | None = None,
) -> tuple[int, int]:
    """Each image equals its request's diffusers image (``run``, by default the family's; within 1 uint8
    level), and each cached request's diffusers image differs from its uncached one by more than
    MORE_THAN, with fewer rows computed. Returns the rows diffusers computed for all of them, with their
    caches and without."""
    run = run or family.diffusers_image
    cached_rows = uncached_rows = 0
    for request, image in zip(requests, images, strict=True):
        expected, rows = run(request)
        difference = np.abs(image - expected).max()
        assert difference <= 1, (request.step_cache.text, request.steps, difference)
        plain_rows = rows
        if request.step_cache:
            uncached, plain_rows = run(replace(request, step_cache=NO_CACHE))
            changed = np.abs(expected - uncached).max()
            assert changed > MORE_THAN, (request.step_cache.text, "changes the image by", changed)
            assert rows < plain_rows, (request.step_cache.text, "diffusers computed every row", rows)
        cached_rows += rows
        uncached_rows += plain_rows
    return cached_rows, uncached_rows


def served_images(jobs: list[Job]) -> list[np.ndarray]:
    return [served(job) for job in jobs]


# ---- the step engine ------------------------------------------------------------------------------------
def test_first_block_cache_alone_equals_diffusers_and_skips_what_diffusers_skips(flux):
    request = flux.request(0, "fbc:0.9")
    (job,), rows = run_counted(flux.adapter, [(0, request)])
    assert job.stats.rows_reused >= 2 and job.stats.rows_computed >= 1, (
        job.stats.rows_reused,
        job.stats.rows_computed,
    )
    expected_rows, uncached_rows = check(flux, [request], [served(job)])
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)


def test_taylorseer_alone_equals_diffusers_and_skips_what_diffusers_skips(flux):
    request = flux.request(0, "taylorseer:3:2")
    (job,), rows = run_counted(flux.adapter, [(0, request)])
    assert job.stats.rows_reused == 4, job.stats.rows_reused  # steps 2, 3, 5, 6 predicted
    expected_rows, uncached_rows = check(flux, [request], [served(job)])
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)


def test_rows_with_their_own_caches_share_forwards_and_each_equals_its_own_call(flux):
    # Two thresholds, TaylorSeer, no cache, other step counts, late joiners, true CFG (each branch its
    # own state), and a neighbour cancelled after its second step.
    requests = [
        flux.request(0, "fbc:0.9"),
        flux.request(1, "fbc:1.0"),
        flux.request(2, "taylorseer:2"),
        flux.request(3, "none", steps=6),
        flux.request(4, "fbc:0.9", negative_prompt="blurry", true_cfg_scale=4.0),
        flux.request(5, "taylorseer:2:1", steps=5, negative_prompt="dark", true_cfg_scale=3.0),
    ]
    arrivals = list(zip([0, 0, 1, 2, 2, 4], requests, strict=True))
    victim = flux.request(9, "fbc:0.3")
    jobs, rows = run_counted(flux.adapter, arrivals, victim=victim)
    assert max(job.stats.most_shared for job in jobs) >= 5, "cached rows did not share forwards"
    assert all(job.stats.rows_reused > 0 for i, job in enumerate(jobs) if i != 3)
    assert (
        jobs[3].stats.rows_reused == 0 and jobs[4].stats.rows_computed + jobs[4].stats.rows_reused == 16
    )  # two branches
    check(flux, requests, served_images(jobs))
    plain = [(at, replace(r, step_cache=NO_CACHE)) for at, r in arrivals]
    _, uncached_rows = run_counted(flux.adapter, plain, victim=replace(victim, step_cache=NO_CACHE))
    assert rows < uncached_rows, (rows, uncached_rows)


@pytest.fixture(scope="module")
def source(flux) -> Image.Image:
    return Image.fromarray(
        served(run_engine(flux.adapter, [(0, flux.request(7, "none"))])[0]).astype(np.uint8)
    )


@pytest.fixture(scope="module")
def mask() -> Image.Image:
    return Image.fromarray((np.indices((64, 64))[1] >= 24).astype(np.uint8) * 255)


def test_an_image_conditioned_row_keeps_its_own_cache(flux, source):
    requests = [
        flux.request(0, "fbc:0.9", image=source, strength=0.75),
        flux.request(1, "taylorseer:2:1", image=source, strength=0.9),
        flux.request(2, "fbc:1.0"),
    ]
    jobs, rows = run_counted(flux.adapter, [(0, r) for r in requests])
    assert all(job.stats.rows_reused > 0 for job in jobs)
    expected_rows, uncached_rows = check(flux, requests, served_images(jobs))
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)


# ---- FLUX.1 img2img and inpaint: a state per CFG branch on both engines -----------------------------------
BRANCH_CASES = [
    pytest.param(start, cfg, cache, id=f"{start}-{'true_cfg' if cfg else 'no_cfg'}-{cache}")
    for start in ("image", "mask")
    for cfg in (False, True)
    for cache in ("fbc:0.9", "taylorseer:2:1")
]


def image_request(
    flux: Family, source: Image.Image, mask: Image.Image, start: str, cfg: bool, cache: str, i: int = 0
) -> ImageParams:
    changes: dict[str, Any] = {"image": source, "strength": 0.9}
    if start == "mask":
        changes["mask_image"] = mask
    if cfg:
        changes.update(negative_prompt="blurry", true_cfg_scale=4.0)
    return flux.request(i, cache, **changes)


@pytest.fixture(scope="module")
def request_level(flux) -> ImageToImageModel:
    """image_to_image on the request-level engine (``engine: request``), in process: its
    FluxImg2ImgPipeline called by its own run_call (models/fused_calls.py), over a third copy of the
    flux fixture's weights."""
    build_missing(WEIGHTS, only=["tiny-flux"])
    texts = {"model": str(WEIGHTS / "tiny-flux"), "engine": "request"}
    config = ModelConfig.parse(texts, ImageToImageModel.CONFIG_KINDS, [], "flux_request")
    settings = ModelSettings("flux_request", WEIGHTS, config, {}, 4, "CPU", 0)
    model = ImageToImageModel()
    model.fields, adapter = model.load(settings)
    assert adapter is None and type(model.pipe).__name__ == "FluxImg2ImgPipeline"
    model.pipe.transformer = copy.deepcopy(flux.reference_pipe.transformer)
    model.pipe.set_progress_bar_config(disable=True)
    model.settings = settings
    model.engine_kind = RequestEngineKind(model.run_call, model.row_caps(settings))
    return model


def raw_request(request: ImageParams) -> dict[str, Any]:
    """What a client sends image_to_image for this img2img request."""
    png = io.BytesIO()
    request.image.save(png, format="PNG")
    raw = {
        "prompt": request.prompt,
        "seed": request.seed,
        "num_inference_steps": request.steps,
        "image": png.getvalue(),
        "strength": request.strength,
        "guidance_scale": request.guidance_scale,
    }
    if request.step_cache:
        raw["step_cache"] = request.step_cache.text
    if request.negative_prompt is not None:
        raw.update(negative_prompt=request.negative_prompt, true_cfg_scale=request.true_cfg_scale)
    return raw


def request_level_run(
    model: ImageToImageModel, requests: list[ImageParams]
) -> tuple[list[np.ndarray], list[Job], int]:
    """The requests through one step of a request-level engine, keyed as the server keys them: their
    images, jobs and the rows the transformer's blocks computed."""
    kind = model.engine_kind
    engine = kind.build(model.settings, lambda report: None)
    jobs = []
    for i, request in enumerate(requests):
        values = model.resolve(model.fields.parse(raw_request(request)))
        spec = model.job_spec(values, 0, model.key_for(values), Urgency())  # as the model parses it
        jobs.append(Job.of(TrackedRequest(str(i), RecordingChannel()), spec))
        engine.add(jobs[-1])
    with ComputedRows(model.pipe.transformer) as rows:
        report = engine.step()
    outputs = {id(finished.job): finished.output for finished in report.finished}
    return [np.asarray(outputs[id(job)], dtype=int) for job in jobs], jobs, rows.rows


def call_cache_run(model: ImageToImageModel, flux: Family, request: ImageParams) -> tuple[np.ndarray, int]:
    """The request's own diffusers pipeline over the request-level model's modules, under ``call_cache``
    (what run_call wraps its call in): its image and the rows computed."""
    pipe = pipeline_for(model.pipe, request)
    with call_cache(pipe, request.step_cache), ComputedRows(pipe.transformer) as rows:
        image = reference(model.pipe, flux.facts, flux.reference_schedulers, request)
    return np.asarray(image, dtype=int), rows.rows


@pytest.mark.parametrize("start, cfg, cache", BRANCH_CASES)
def test_img2img_and_inpaint_alone_keep_a_cache_state_per_cfg_branch_on_both_engines(
    flux, request_level, source, mask, start, cfg, cache
):
    request = image_request(flux, source, mask, start, cfg, cache)
    (job,), step_rows = run_counted(flux.adapter, [(0, request)])
    if start == "image":  # image_to_image's request-level engine, as the server runs it
        (call_image,), _, call_rows = request_level_run(request_level, [request])
    else:  # no request-level model serves inpainting: FluxInpaintPipeline under call_cache
        call_image, call_rows = call_cache_run(request_level, flux, request)
    expected_rows, uncached_rows = check(flux, [request], [served(job)])
    expected, _ = flux.diffusers_image(request)
    assert np.abs(call_image - expected).max() <= 1, np.abs(call_image - expected).max()
    assert np.abs(call_image - served(job)).max() <= 1, "the two engines differ"
    assert step_rows == call_rows == expected_rows < uncached_rows, (step_rows, call_rows, expected_rows)
    pipe = pipeline_for(flux.reference_pipe, request)
    assert not names_its_calls(type(pipe)) and type(pipe).__name__ not in NAMES_ITS_OWN_CALLS


def test_pipelines_that_name_their_calls_are_told_apart():
    from diffusers import (
        FluxImg2ImgPipeline,
        FluxInpaintPipeline,
        FluxPipeline,
        PixArtSigmaPipeline,
        WanPipeline,
    )

    named = {cls.__name__: names_its_calls(cls) for cls in (FluxPipeline, WanPipeline, PixArtSigmaPipeline)}
    named |= {cls.__name__: names_its_calls(cls) for cls in (FluxImg2ImgPipeline, FluxInpaintPipeline)}
    assert {name for name, names in named.items() if names} == NAMES_ITS_OWN_CALLS


def test_img2img_and_inpaint_amid_other_rows_keep_a_cache_state_per_cfg_branch(flux, source, mask):
    cases = [(start, cfg, cache) for start in ("image", "mask") for cfg in (False, True) for cache in
             ("fbc:0.9", "taylorseer:2:1")]  # fmt: skip
    requests = [image_request(flux, source, mask, *case, i=k) for k, case in enumerate(cases)]
    requests += [
        flux.request(8, "fbc:1.0"),
        flux.request(9, "none", steps=6, negative_prompt="grey", true_cfg_scale=2.0),
        flux.request(10, "taylorseer:3:2", negative_prompt="grey", true_cfg_scale=2.0),
    ]
    arrivals = [(k % 3, request) for k, request in enumerate(requests)]
    jobs, rows = run_counted(flux.adapter, arrivals)
    assert max(job.stats.most_shared for job in jobs) >= 6, "the rows did not share forwards"
    expected_rows, uncached_rows = check(flux, requests, served_images(jobs))
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)


def test_the_request_level_engine_gives_each_cached_request_a_call_of_its_own(flux, request_level, source):
    # own_call (models/diffusion_model.py key_for): diffusers' cache decides per call, so a cached request
    # shares its call with nobody, even one with the same values; uncached requests of one key share a call.
    model = request_level
    requests = [
        image_request(flux, source, None, "image", True, "fbc:0.9", i=0),
        image_request(flux, source, None, "image", True, "fbc:0.9", i=1),
        image_request(flux, source, None, "image", False, "taylorseer:2:1", i=2),
        image_request(flux, source, None, "image", True, "none", i=3),
        image_request(flux, source, None, "image", True, "none", i=4),
    ]
    values = [model.resolve(model.fields.parse(raw_request(r))) for r in requests]
    same = {**values[0], "prompt": "the same", "seed": 1}
    assert model.key_for(same) != model.key_for(same)
    assert model.key_for(values[3]) == model.key_for(values[4])
    images, jobs, rows = request_level_run(model, requests)
    assert [[call["rows"] for call in job.stats.calls] for job in jobs] == [[1], [1], [1], [2], [2]]
    assert len({job.stats.calls[0]["id"] for job in jobs}) == 4
    batch = model.batch_report(values[0], jobs[:1])
    assert batch["step_cache"] == {"cache": "fbc:0.9", "own_calls": True}
    assert "own_call" not in batch["key"]
    expected_rows, uncached_rows = check(flux, requests, images)
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)
    # The step engine, the same requests sharing its forwards: the same images.
    step_jobs = run_engine(flux.adapter, [(0, r) for r in requests])
    for image, job in zip(images, step_jobs, strict=True):
        assert np.abs(image - served(job)).max() <= 1, "the two engines differ"


def test_each_image_of_a_cached_request_gets_a_request_level_call_of_its_own(flux, request_level, source):
    # RowCaps.cap_for (engine/planner.py): diffusers' cache decides over a call's whole batch, the step engine
    # per image, so each image of a cached request runs in a call of its own; each equals its image alone.
    model, kind = request_level, request_level.engine_kind
    request = image_request(flux, source, None, "image", True, "fbc:0.9")
    values = model.resolve(model.fields.parse({**raw_request(request), "num_images_per_prompt": 2}))
    key = model.key_for(values)
    engine = kind.build(model.settings, lambda report: None)  # as the server builds it
    jobs, tracked = [], TrackedRequest("r", RecordingChannel())
    for i in range(2):  # as the model parses a request into its jobs, and the host makes them
        jobs.append(Job.of(tracked, model.job_spec(values, i, key, Urgency())))
        engine.add(jobs[-1])
    with ComputedRows(model.pipe.transformer) as rows:
        report = engine.step()
    outputs = {id(finished.job): finished.output for finished in report.finished}
    images = [np.asarray(outputs[id(job)], dtype=int) for job in jobs]
    # The request's two fused calls (recorded on each of its jobs), one image each.
    assert [[call["rows"] for call in job.stats.calls] for job in jobs] == [[1, 1], [1, 1]]
    assert len({call["id"] for call in jobs[0].stats.calls}) == 2
    requests = [replace(request, image_index=i) for i in range(2)]
    expected_rows, uncached_rows = check(flux, requests, images)
    assert rows.rows == expected_rows < uncached_rows, (rows.rows, expected_rows, uncached_rows)
    step_jobs = run_engine(flux.adapter, [(0, r) for r in requests])
    for image, job in zip(images, step_jobs, strict=True):
        assert np.abs(image - served(job)).max() <= 1, "the two engines differ"


# ---- a forward that raises ------------------------------------------------------------------------------
def cache_contents(cache: Any) -> list[Any]:
    """Everything a job's cache state holds, flattened: the objects themselves (compared by identity)."""
    contents: list[Any] = []
    for branch in cache.branches:
        if hasattr(branch, "head_residual"):  # First Block Cache
            contents += [branch.head_residual, *(branch.tail_residuals or (None, None))]
        else:  # TaylorSeer: its step, and each attention module's factors
            contents += [branch.step, *branch.modules]
            for factors in branch.modules.values():
                contents += [factors, factors.last_update_step, factors.factors, factors.dtypes]
    return contents


def unchanged(before: list[Any], after: list[Any]) -> bool:
    if len(before) != len(after):
        return False
    pairs = zip(before, after, strict=True)
    return all(a is b or (isinstance(a, int) and isinstance(b, int) and a == b) for a, b in pairs)


@pytest.mark.parametrize("cache", ["fbc:0.9", "taylorseer:2:2"])
def test_a_forward_that_raises_leaves_no_cache_state_and_its_retry_decides_the_same(flux, cache):
    # Every forward first raises after the last block ran (out of memory in the output norm): nothing it
    # staged may reach the job's cache state (TaylorSeer's module state of the job's first forward
    # included: it joins at commit), so the retry decides as an unfailed forward would, and the image is
    # diffusers' own.
    request = flux.request(0, cache)
    job = Job(TrackedRequest("r", RecordingChannel()), request)
    (start,) = flux.adapter.prepare([job])
    job.state, job.run.group, job.run.total_steps = start.state, start.group, start.total_steps
    state = job.state.cache

    def out_of_memory(module: Any, args: tuple) -> None:
        raise RuntimeError("CUDA out of memory (injected after every block ran)")

    computed = ComputedRows(flux.pipe.transformer)
    while job.run.steps_done < job.run.total_steps:
        before = cache_contents(state)
        handle = flux.pipe.transformer.norm_out.register_forward_pre_hook(out_of_memory)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                flux.adapter.step([job])
        finally:
            handle.remove()
        assert unchanged(before, cache_contents(state)), (
            f"the failed forward {job.run.steps_done} changed state"
        )
        if job.run.steps_done == 0 and cache.startswith("taylorseer"):
            assert state.branches[0].modules == {} and state.branches[0].step == -1
        with computed:
            (step,) = flux.adapter.step([job]).steps
        assert step.error is None
        if step.rows_computed or cache.startswith("taylorseer"):  # (TaylorSeer counts every step)
            assert not unchanged(before, cache_contents(state)), "the forward's updates were not committed"
        job.run.steps_done = step.step
    if cache.startswith("taylorseer"):
        assert len(state.branches[0].modules) == 4  # each block's attention joined at its first commit
    (image,) = flux.adapter.finish([job])
    expected_rows, uncached_rows = check(flux, [request], [np.asarray(image, dtype=int)])
    assert computed.rows == expected_rows < uncached_rows, (computed.rows, expected_rows)


# ---- diffusers' hooks ------------------------------------------------------------------------------------
class PassThrough(ModelHook):
    """Another diffusers hook on a module: it calls the chain below it, counting the rows it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.rows += kwargs.get("hidden_states", args[0] if args else None).shape[0]
        return self.fn_ref.original_forward(*args, **kwargs)


def pass_through(modules: list[torch.nn.Module], name: str) -> list[PassThrough]:
    hooks = [PassThrough() for _ in modules]
    for module, hook in zip(modules, hooks, strict=True):
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    return hooks


def test_a_model_carrying_other_diffusers_hooks_still_caches_each_row_exactly(flux):
    # flux's weights in a transformer carrying diffusers' group offloading (CPU to CPU) and a hook of the
    # test's own below the step caches' hooks (registered before the adapter), and another above them:
    # each row's image, what it reused and the rows computed equal those on flux's own transformer.
    requests = [
        flux.request(0, "fbc:0.9"),
        flux.request(1, "taylorseer:2"),
        flux.request(2, "fbc:0.9", negative_prompt="blurry", true_cfg_scale=4.0),
        flux.request(3, "none", steps=6),
    ]
    arrivals = list(zip([0, 0, 1, 2], requests, strict=True))
    plain, plain_rows = run_counted(flux.adapter, arrivals)
    pipe, _, schedulers = load_family("tiny-flux")
    config = {k: v for k, v in flux.pipe.transformer.config.items() if not k.startswith("_")}
    pipe.transformer = FluxTransformer2DModel(**config)
    pipe.transformer.load_state_dict(flux.pipe.transformer.state_dict())
    # Every module the step caches hook: each block (FBC) and its attention module (TaylorSeer).
    named = pipe.transformer.named_modules()
    modules = [m for n, m in named if re.fullmatch(r"(single_)?transformer_blocks\.\d+(\.attn)?", n)]
    assert len(modules) == 8
    apply_group_offloading(pipe.transformer, "cpu", offload_type="block_level", num_blocks_per_group=1)
    below = pass_through(modules, "test_below")
    adapter = step_adapter_for(pipe, flux.facts, schedulers, None)
    above = pass_through(modules, "test_above")
    for module in modules:  # the registry's order is its chain's, innermost first
        names = list(HookRegistry.check_if_exists_or_initialize(module).hooks)
        (ours,) = [name for name in names if name.startswith(HOOK_PREFIX)]
        assert names.index("test_below") < names.index(ours) < names.index("test_above"), names
    offloaded = [
        m for m in modules if "group_offloading" in HookRegistry.check_if_exists_or_initialize(m).hooks
    ]
    assert len(offloaded) == 4  # diffusers' group offloading on every block

    def same_as_plain(jobs: list[Job], rows: int) -> None:
        assert [j.stats.rows_reused for j in jobs] == [j.stats.rows_reused for j in plain] and plain[
            0
        ].stats.rows_reused > 0
        for job, expected in zip(jobs, plain, strict=True):
            assert np.abs(served(job) - served(expected)).max() <= 1
        assert rows == plain_rows, (rows, plain_rows)

    same_as_plain(*run_counted(adapter, arrivals))
    assert all(hook.rows for hook in [*below, *above]), "another hook did not run"
    # Below the step caches' hooks a hook sees only the rows that compute; above them, every row.
    assert sum(h.rows for h in below) < sum(h.rows for h in above), "the caches skipped no row below"
    # Taking the hooks above off again (through the registry) leaves the step caches on.
    seen = [h.rows for h in above]
    for module in modules:
        HookRegistry.check_if_exists_or_initialize(module).remove_hook("test_above", recurse=False)
    same_as_plain(*run_counted(adapter, arrivals))
    assert [h.rows for h in above] == seen


def test_what_step_caches_spells_of_diffusers_private_pieces_is_still_diffusers_own(monkeypatch):
    # A diffusers upgrade that moves or changes what its caches keep privately fails here, by name:
    # where FBC finds blocks and TaylorSeer attention modules (spelled in step_caches.py), and the block
    # layouts step_caches.block_layout reads, the one private piece it uses.
    import importlib

    import diffusers
    from diffusers.models.attention import BasicTransformerBlock, JointTransformerBlock
    from diffusers.models.transformers.sana_transformer import SanaTransformerBlock
    from diffusers.models.transformers.transformer_flux import (
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    def private(module: str, name: str) -> Any:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"diffusers {diffusers.__version__}: no {module}.{name} ({exc}): see step_caches.py")

    blocks = private("diffusers.hooks._common", "_ALL_TRANSFORMER_BLOCK_IDENTIFIERS")
    assert set(blocks) == BLOCK_LISTS, f"diffusers' FBC finds blocks in {sorted(blocks)}: update BLOCK_LISTS"
    attention = private("diffusers.hooks.taylorseer_cache", "_TRANSFORMER_BLOCK_IDENTIFIERS")
    assert set(attention) == set(TAYLOR_MODULES), (
        f"diffusers' TaylorSeer hooks {attention}: see TAYLOR_MODULES"
    )
    names = ("hidden_states", "encoder_hidden_states")
    expected = {
        FluxTransformerBlock: BlockLayout(1, 0, *names),
        FluxSingleTransformerBlock: BlockLayout(1, 0, *names),
        BasicTransformerBlock: BlockLayout(0, None, *names),  # PixArt
        JointTransformerBlock: BlockLayout(1, 0, *names),  # SD3
        WanTransformerBlock: BlockLayout(0, None, *names),
        QwenImageTransformerBlock: BlockLayout(1, 0, *names),
        SanaTransformerBlock: None,  # diffusers' FBC refuses it
    }
    layouts = {cls: block_layout(cls) for cls in expected}
    assert layouts == expected, f"diffusers {diffusers.__version__} changed its blocks' layouts: {layouts}"
    # Without the record at all, a model load fails by name rather than serving a wrong cache.
    monkeypatch.delattr("diffusers.hooks._helpers.TransformerBlockRegistry")
    with pytest.raises(RuntimeError, match="registered_block_layout must learn"):
        registered_block_layout(FluxTransformerBlock)  # block_layout's uncached reading


# ---- other families -------------------------------------------------------------------------------------
def test_sd3_taylorseer_equals_diffusers_alone_and_amid_other_rows():
    sd3 = Family("tiny-sd3")
    assert sd3.adapter.cache_methods == ("taylorseer",)  # diffusers' FBC fails on SD3's last block
    requests = [
        sd3.request(0, "taylorseer:2"),
        sd3.request(1, "none", steps=6),
        sd3.request(2, "taylorseer:3:1", steps=7, guidance_scale=1.0),  # no CFG: one row
        sd3.request(3, "taylorseer:2:2", guidance_scale=7.0),
    ]
    (alone,), rows = run_counted(sd3.adapter, [(0, requests[0])])
    assert alone.stats.rows_reused > 0
    expected_rows, uncached_rows = check(sd3, requests[:1], [served(alone)])
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)
    arrivals = [(0, requests[0]), (1, requests[1]), (2, requests[2]), (2, requests[3])]
    jobs, rows = run_counted(sd3.adapter, arrivals)
    expected_rows, uncached_rows = check(sd3, requests, served_images(jobs))
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)


@pytest.mark.parametrize(
    "name, steps",
    # PixArt's two blocks: FBC skips one, which moves the image by 3-4 levels in 6 steps, 8-9 in 16.
    [("tiny-pixart-sigma", 16), ("tiny-pixart-alpha", 16), ("tiny-wan", 6)],
)
def test_first_block_cache_on_pixart_and_wan_equals_diffusers(name, steps):
    family = Family(name)
    assert family.adapter.cache_methods == ("fbc",)
    video = {"num_frames": 9} if name == "tiny-wan" else {}
    requests = [
        family.request(0, "fbc:0.5", steps=steps, **video),
        family.request(1, "none", steps=5, **video),
    ]
    jobs, rows = run_counted(family.adapter, [(0, r) for r in requests], host=None)
    assert jobs[0].stats.rows_reused > 0
    if video:  # a video: compared frame by frame with WanPipeline's own cached call
        images = [np.asarray(job.request.channel.finals[0]["image"], dtype=int) for job in jobs]
        expected_rows, uncached_rows = check(family, requests, images, run=lambda r: wan_frames(family, r))
    else:
        expected_rows, uncached_rows = check(family, requests, served_images(jobs))
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)


def wan_frames(family: Family, request: ImageParams) -> tuple[np.ndarray, int]:
    from triton_diffusion.adapters.diffusers_pipeline import row_generator
    from triton_diffusion.codecs.video import to_uint8

    pipe = family.reference_pipe
    with cache_on(pipe, request), ComputedRows(pipe.transformer) as rows:
        frames = pipe(
            prompt=[request.prompt],
            height=request.height,
            width=request.width,
            num_frames=request.num_frames,
            num_inference_steps=request.steps,
            guidance_scale=request.guidance_scale,
            generator=[row_generator(request.seed, 0)],
            output_type="np",
        ).frames[0]
    return np.asarray(to_uint8(frames), dtype=int), rows.rows


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

    def request(i: int, cache: str, lora: tuple) -> ImageParams:
        return ImageParams(
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
        jobs, rows = run_counted(adapter, [(0, r) for r in requests])
    # a forward that failed would be retried in halves and still be exact: it must not have failed
    assert not [r for r in caplog.records if "forward of" in r.getMessage()]
    assert all(jobs[i].stats.rows_reused > 0 for i in (0, 2, 3, 4)), [j.stats.rows_reused for j in jobs]

    def diffusers_image(req: ImageParams) -> tuple[np.ndarray, int]:
        with cache_on(reference_pipe, req), ComputedRows(reference_pipe.transformer) as computed:
            image = lora_reference(reference_pipe, facts, req)
        return image, computed.rows

    expected_rows, uncached_rows = check(None, requests, served_images(jobs), run=diffusers_image)
    assert rows == expected_rows < uncached_rows, (rows, expected_rows, uncached_rows)
