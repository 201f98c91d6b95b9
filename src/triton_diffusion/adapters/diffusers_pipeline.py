"""Loading a diffusers pipeline from the model config, and the per-row pieces every family shares."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.devices import instance_device, instance_dtype
from triton_diffusion.families import PipelineFacts
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")

SEED_MODULUS = 2**63  # SEED is an INT64 output


def load_pipeline(settings: ModelSettings, loader: str = "DiffusionPipeline") -> Any:
    """``<loader>.from_pretrained`` the configured folder or hub id: safetensors only, and
    ``trust_remote_code`` only when the model config opts in. The ``pipeline_class`` parameter names
    another diffusers class to load with (e.g. StableDiffusionInstructPix2PixPipeline)."""
    import diffusers

    name = settings.config.pipeline_class or loader
    pipeline_class = getattr(diffusers, name, None)
    if pipeline_class is None or not hasattr(pipeline_class, "from_pretrained"):
        raise ValueError(f"model {settings.name}: pipeline_class {name!r} is not a diffusers pipeline class")
    device = instance_device(settings)
    pipe = pipeline_class.from_pretrained(
        settings.model_source(),
        dtype=instance_dtype(settings, device),
        use_safetensors=True,
        trust_remote_code=settings.config.trust_remote_code,
    )
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def counterpart_pipeline(pipe: Any, class_name: str) -> Any:
    """The diffusers pipeline ``class_name`` over ``pipe``'s loaded modules (the same objects: nothing is
    loaded or copied), or ``pipe`` itself when it is one. Built as ``from_pipe`` builds it (the class's
    modules and config options taken from ``pipe``), but without its closing ``.to(dtype)``, which would
    cast every shared module (to float32 unless told, and the layers transformers keeps in float32 too)."""
    import diffusers

    if type(pipe).__name__ == class_name:
        return pipe
    pipeline_class = getattr(diffusers, class_name)
    modules, options = compat.signature_keys(pipeline_class)
    kwargs = {name: value for name, value in pipe.components.items() if name in modules}
    kwargs.update((name, value) for name, value in pipe.config.items() if name in options)
    other = pipeline_class(**kwargs)
    other.set_progress_bar_config(disable=True)
    return other


def row_seed(seed: int, image_index: int) -> int:
    """Image i of a request uses seed + i, so each image can be reproduced alone."""
    return (seed + image_index) % SEED_MODULUS


def row_generator(seed: int, image_index: int) -> torch.Generator:
    # A CPU generator gives the same noise on every device; diffusers moves the noise to the device.
    return torch.Generator(device="cpu").manual_seed(row_seed(seed, image_index))


class SchedulerChoices:
    """Schedulers a request may pick by class name.

    The pipeline's own scheduler is always a choice and the default, so changing ``model`` alone loads
    any family. ``scheduler_choices`` in the config adds others; one the loaded pipeline cannot use (a
    flow-matching pipeline takes no DDIM) is a config error that names the compatible ones.
    """

    def __init__(self, pipe: Any, facts: PipelineFacts, choices: Sequence[str], model: str) -> None:
        import diffusers

        self.default = facts.scheduler
        self._schedulers: dict[str, Any] = {self.default: pipe.scheduler}
        for name in choices:
            if name in self._schedulers:
                continue
            if name not in facts.compatible_schedulers:
                raise ValueError(
                    f"model {model}: scheduler_choices entry {name} is not compatible with "
                    f"{facts.class_name} (compatible: {', '.join(sorted(facts.compatible_schedulers))})"
                )
            self._schedulers[name] = getattr(diffusers, name).from_config(pipe.scheduler.config)

    @property
    def names(self) -> list[str]:
        return list(self._schedulers)

    def __getitem__(self, name: str) -> Any:
        return self._schedulers[name]

    def with_original_sample(self) -> frozenset[str]:
        """The choices whose ``step`` also returns the predicted original sample (DDIM, Euler: a second
        output; DPM-Solver: none), found by one step of a copy on a tiny tensor at load."""
        import copy

        import torch

        found = set()
        for name, scheduler in self._schedulers.items():
            probe = copy.deepcopy(scheduler)
            probe.set_timesteps(1)
            sample = torch.zeros(1, 1, 2, 2)
            outputs = probe.step(sample, probe.timesteps[0], sample, return_dict=False)
            if len(outputs) > 1:
                found.add(name)
        return frozenset(found)


def pipeline_timesteps(
    module: Any,
    scheduler: Any,
    steps: int,
    device: torch.device | str,
    sigmas: Any = None,
    image_seq_len: int | None = None,
    max_shift: float = 1.15,
) -> torch.Tensor:
    """The pipeline ``module``'s own ``retrieve_timesteps`` on ``device``; with ``image_seq_len``, the
    flow-matching pipelines' resolution-dependent shift ``mu`` (its ``calculate_shift`` between the
    scheduler config's bounds, ``max_shift`` where the config has none)."""
    kwargs = {}
    if image_seq_len is not None:
        config = scheduler.config
        kwargs["mu"] = module.calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )
    timesteps, _ = module.retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, **kwargs)
    return timesteps
