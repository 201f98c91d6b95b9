"""diffusers' private names, all behind one door.

The adapters reproduce diffusers' own calls step by step, and a few of the pieces they must reuse to equal
them have no public form (a pipeline's latent packing, SDXL's time ids, a scheduler's step index). Every
such name is used here and nowhere else, and :data:`PRIVATE_NAMES` lists each with the class that has it:
``tests/unit/test_diffusers_compat.py`` checks each against the installed diffusers and fails by name on
an upgrade that moves one, and fails if a private name is used outside this module. ``pyproject.toml``
bounds diffusers above at the newest minor the suite passed with.

It also names the state a noise scheduler changes while it steps (:data:`SCHEDULER_STEP_STATE`): what a
job checkpoint saves and restores (adapters/job_checkpoints.py). The test steps each scheduler and fails
naming any other attribute that changes.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from diffusers.configuration_utils import FrozenDict

# (the class that has it, the private name): each is read below, and only here.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("DiffusionPipeline", "_execution_device"),
    ("DiffusionPipeline", "_get_signature_keys"),
    ("FluxPipeline", "_pack_latents"),
    ("FluxPipeline", "_unpack_latents"),
    ("FluxPipeline", "_prepare_latent_image_ids"),
    ("QwenImagePipeline", "_pack_latents"),
    ("QwenImagePipeline", "_unpack_latents"),
    ("ZImagePipeline", "_encode_prompt"),
    ("StableDiffusionXLPipeline", "_get_add_time_ids"),
    ("StableDiffusionXLImg2ImgPipeline", "_get_add_time_ids"),
    ("StableDiffusionPipeline", "_num_timesteps"),
    ("StableDiffusionPipeline", "_lora_loadable_modules"),
    ("models.transformers.transformer_flux:FluxAttnProcessor", "_attention_backend"),
    ("EulerDiscreteScheduler", "_init_step_index"),
    ("FlowMatchEulerDiscreteScheduler", "_init_step_index"),
    ("DPMSolverMultistepScheduler", "_init_step_index"),
    ("EulerDiscreteScheduler", "_step_index"),
    ("FlowMatchEulerDiscreteScheduler", "_step_index"),
    ("DPMSolverMultistepScheduler", "_step_index"),
    ("DPMSolverMultistepScheduler", "_sigma_to_alpha_sigma_t"),
    ("DDIMScheduler", "_get_variance"),
    ("hooks._helpers", "TransformerBlockRegistry"),
    ("ConfigMixin", "_internal_dict"),
)

# What each scheduler changes while it steps (read off diffusers 0.42 by stepping each): a checkpoint
# holds these and nothing else; the rest (its tables, its begin index) a fresh start of the same request
# makes again from its config. A scheduler not named here is not checkpointed (its job restarts on resume).
SCHEDULER_STEP_STATE: dict[str, tuple[str, ...]] = {
    "DDIMScheduler": (),
    "DDPMScheduler": (),
    "PNDMScheduler": ("counter", "cur_model_output", "cur_sample", "ets"),
    "EulerDiscreteScheduler": ("_step_index", "is_scale_input_called"),
    "EulerAncestralDiscreteScheduler": ("_step_index", "is_scale_input_called"),
    "HeunDiscreteScheduler": ("_step_index", "dt", "prev_derivative", "sample"),
    "KDPM2DiscreteScheduler": ("_step_index", "sample"),
    "KDPM2AncestralDiscreteScheduler": ("_step_index", "sample", "dt"),
    "DPMSolverMultistepScheduler": ("_step_index", "lower_order_nums", "model_outputs"),
    "DPMSolverSinglestepScheduler": ("_step_index", "model_outputs", "sample"),
    "DEISMultistepScheduler": ("_step_index", "lower_order_nums", "model_outputs"),
    "UniPCMultistepScheduler": (
        "_step_index",
        "last_sample",
        "lower_order_nums",
        "model_outputs",
        "timestep_list",
        "this_order",
    ),
    "EDMEulerScheduler": ("_step_index", "is_scale_input_called"),
    "EDMDPMSolverMultistepScheduler": (
        "_step_index",
        "lower_order_nums",
        "model_outputs",
        "is_scale_input_called",
    ),
    "FlowMatchEulerDiscreteScheduler": ("_step_index",),
    "FlowMatchHeunDiscreteScheduler": ("_step_index", "dt", "prev_derivative", "sample"),
    "LCMScheduler": ("_step_index", "sigma_data"),
    "TCDScheduler": ("_step_index",),
}


# ---- pipelines --------------------------------------------------------------------------------------
def execution_device(pipe: Any) -> torch.device:
    """Where the pipeline runs its models (diffusers' own rule, offloading included)."""
    return pipe._execution_device


def signature_keys(pipeline_class: type) -> tuple[set[str], set[str]]:
    """A pipeline class's component names and its optional config names."""
    modules, options = pipeline_class._get_signature_keys(pipeline_class)  # type: ignore[attr-defined]
    return set(modules), set(options)


def pack_latents(pipe: Any, latents: torch.Tensor, count: int, channels: int, height: int, width: int) -> Any:
    """FLUX.1's and Qwen-Image's 2x2 latent patches packed into tokens."""
    return pipe._pack_latents(latents, count, channels, height, width)


def unpack_latents(pipe: Any, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The tokens of :func:`pack_latents` back to latents of an image ``height`` x ``width``."""
    return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)


def latent_image_ids(pipe: Any, height: int, width: int, device: torch.device, dtype: torch.dtype) -> Any:
    """FLUX.1's position ids of a packed latent grid ``height`` x ``width`` (in tokens)."""
    return pipe._prepare_latent_image_ids(1, height, width, device, dtype)


def encode_prompt_features(
    pipe: Any, prompts: list[str], device: torch.device, max_length: int | None
) -> Any:
    """Z-Image's text features per prompt (its chat template applied), before any guidance pairing."""
    return pipe._encode_prompt(prompt=prompts, device=device, max_sequence_length=max_length)


def add_time_ids(pipe: Any, *arguments: Any) -> Any:
    """SDXL's micro-conditioning ids, as its pipeline (text or image) makes them."""
    return pipe._get_add_time_ids(*arguments)


def steps_planned(pipe: Any) -> int | None:
    """The steps a running pipeline call takes (its own count, set as it starts; None before)."""
    return getattr(pipe, "_num_timesteps", None)


def lora_loadable_modules(pipe: Any) -> list[str]:
    """The pipeline's components that take LoRA adapters."""
    return list(pipe._lora_loadable_modules)


def attention_backend(processor: Any) -> str | None:
    """The attention backend a processor was set to (None: the default). A processor class that has no
    such attribute is refused by name: reading it as the default would pack sizes under a backend that
    may ignore the key mask."""
    if not hasattr(type(processor), "_attention_backend") and not hasattr(processor, "_attention_backend"):
        raise RuntimeError(
            f"diffusers' {type(processor).__name__} has no _attention_backend: "
            "diffusers_compat.attention_backend must learn where the backend is kept"
        )
    return processor._attention_backend


# ---- schedulers -------------------------------------------------------------------------------------
def init_step_index(scheduler: Any, timestep: Any) -> None:
    """The scheduler's own first-step initialisation of its step index."""
    scheduler._init_step_index(timestep)


def advance_step_index(scheduler: Any) -> None:
    """One step done, as the scheduler's own ``step`` counts it."""
    scheduler._step_index += 1


def sigma_to_alpha_sigma_t(scheduler: Any, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scheduler._sigma_to_alpha_sigma_t(sigma)


def ddim_variance(scheduler: Any, timestep: Any, prev_timestep: Any) -> torch.Tensor:
    return scheduler._get_variance(timestep, prev_timestep)


def step_state_names(scheduler: Any) -> tuple[str, ...] | None:
    """What ``scheduler`` changes while it steps (:data:`SCHEDULER_STEP_STATE`); None: not named."""
    return SCHEDULER_STEP_STATE.get(type(scheduler).__name__)


def job_scheduler(template: Any) -> Any:
    """A job's own scheduler from a loaded template, as ``copy.deepcopy`` would make it for all the job
    changes, at a small part of its cost (a deep copy copies every table of the schedule for every job).
    For a scheduler whose stepping state is named (:data:`SCHEDULER_STEP_STATE`) the copy has its own
    attributes, its own lists and dicts (what stepping appends to) and its own config (``set_timesteps``
    with ``mu`` writes the shift into the config object: DPM-Solver's, DEIS'), and shares the template's
    tensors, which ``set_timesteps`` and stepping replace and never write into
    (tests/unit/test_diffusers_compat.py steps two such copies of every named scheduler against a deep
    copy and checks the template after). Any other scheduler is deep-copied."""
    if step_state_names(template) is None:
        return copy.deepcopy(template)
    clone = copy.copy(template)
    for name, value in vars(template).items():
        if type(value) in (list, dict):
            setattr(clone, name, copy.copy(value))
    clone._internal_dict = FrozenDict(template._internal_dict)
    return clone


# ---- hooks ------------------------------------------------------------------------------------------
class BlockLayout(NamedTuple):
    """Where a block takes its hidden (encoder) states and returns them in its tuple (None: it does not),
    as diffusers' First Block Cache reads it."""

    hidden_index: int
    encoder_index: int | None
    hidden_argument: str
    encoder_argument: str


def registered_block_layout(block_class: type) -> BlockLayout | None:
    """``block_class``'s layout from diffusers' registry (None: a class it has none of). It has no public
    form, and a per-row First Block Cache must read what diffusers' reads to equal it."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        meta = TransformerBlockRegistry.get(block_class)
        return BlockLayout(
            meta.return_hidden_states_index,
            meta.return_encoder_hidden_states_index,
            meta.hidden_states_argument_name,
            meta.encoder_hidden_states_argument_name,
        )
    except ValueError:  # "Model class ... not registered"
        return None
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"diffusers moved or changed hooks._helpers.TransformerBlockRegistry ({exc}): "
            "diffusers_compat.registered_block_layout must learn where it now keeps the blocks' layouts"
        ) from exc
