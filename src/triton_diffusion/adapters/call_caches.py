"""Step caches on the request-level engine: diffusers' own cache (``transformer.enable_cache``) on one
fused call, with one cache state per CFG branch, the semantic ``adapters/step_caches.py`` states for both
engines. A pipeline whose ``__call__`` names its denoiser calls (``transformer.cache_context``) keeps its
names; one that names none (FluxImg2ImgPipeline, FluxInpaintPipeline) gets FluxPipeline's."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from triton_diffusion.adapters.step_caches import servable
from triton_diffusion.step_cache_spec import StepCache


def call_methods(transformer: Any) -> tuple[str, ...]:
    """The step caches a request-level call serves: diffusers' own, where the transformer has them."""
    from diffusers import CacheMixin

    if not isinstance(transformer, CacheMixin) or not isinstance(transformer, torch.nn.Module):
        return ()
    return servable(transformer, ("fbc", "taylorseer"))


# FluxPipeline's names for a step's denoiser calls: the prompt's, then true CFG's negative prompt's.
BRANCH_CONTEXTS = ("cond", "uncond")


_NAMES_ITS_CALLS: dict[type, bool] = {}


def names_its_calls(pipeline_class: type) -> bool:
    """Whether the pipeline's ``__call__`` puts its denoiser calls under cache contexts of its own
    (``transformer.cache_context(...)``, as FluxPipeline, Qwen-Image and Wan do): read once per class."""
    if pipeline_class not in _NAMES_ITS_CALLS:
        try:
            source = inspect.getsource(pipeline_class.__call__)
        except (OSError, TypeError):  # no source to read: name its calls here, as for one that names none
            source = ""
        _NAMES_ITS_CALLS[pipeline_class] = "cache_context" in source
    return _NAMES_ITS_CALLS[pipeline_class]


class StepCalls:
    """The cache contexts of a pipeline whose ``__call__`` names none (FluxImg2ImgPipeline,
    FluxInpaintPipeline, SD3's, ...), as FluxPipeline names its own: each step's first denoiser call runs
    under "cond", its second (true CFG's negative prompt) under "uncond"; a pipeline that batches its CFG
    branches makes one call a step, all "cond". Two calls are one step's when the second gets the very
    latents tensor the first got, at the same timestep (the scheduler's step makes new latents). Each
    call runs inside ``transformer.cache_context(name)``, entered by a forward pre-hook and left by a
    forward hook that runs even when the call raises."""

    def __init__(self, transformer: Any) -> None:
        self.transformer = transformer
        self.previous: tuple[Any, Any] | None = None  # the last call's latents and timestep
        self.calls = 0  # the calls of this step before this one
        self.entered: list[contextlib.AbstractContextManager] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        handles = [
            self.transformer.register_forward_pre_hook(self._enter, with_kwargs=True),
            self.transformer.register_forward_hook(self._leave, with_kwargs=True, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.previous = None

    def name(self, latents: Any, timestep: Any) -> str:
        previous = self.previous
        same_step = (
            previous is not None
            and latents is previous[0]
            and isinstance(timestep, torch.Tensor)
            and isinstance(previous[1], torch.Tensor)
            and timestep.shape == previous[1].shape
            and torch.equal(timestep, previous[1])
        )
        self.calls = self.calls + 1 if same_step else 0
        self.previous = (latents, timestep)
        return BRANCH_CONTEXTS[self.calls] if self.calls < len(BRANCH_CONTEXTS) else f"call{self.calls}"

    def _enter(self, module: Any, args: tuple, kwargs: dict) -> None:
        latents = kwargs.get("hidden_states", args[0] if args else None)
        context = self.transformer.cache_context(self.name(latents, kwargs.get("timestep")))
        context.__enter__()
        self.entered.append(context)

    def _leave(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        self.entered.pop().__exit__(None, None, None)


@contextlib.contextmanager
def call_cache(pipe: Any, spec: StepCache) -> Iterator[None]:
    """diffusers' own cache (``transformer.enable_cache``) on one request-level call, fresh for the call
    (its decision is per call: such requests run in calls of their own), with one state per CFG branch: a
    pipeline that names its denoiser calls keeps its names, one that names none gets FluxPipeline's
    (:class:`StepCalls`)."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if not spec:
        yield
        return
    transformer = pipe.transformer
    if spec.method == "fbc":
        config: Any = FirstBlockCacheConfig(threshold=spec.threshold)
    else:
        config = TaylorSeerCacheConfig(cache_interval=spec.interval, disable_cache_before_step=spec.warmup)
    transformer.enable_cache(config)
    try:
        if names_its_calls(type(pipe)):
            yield
        else:
            with StepCalls(transformer).installed():
                yield
    finally:
        transformer.disable_cache()
