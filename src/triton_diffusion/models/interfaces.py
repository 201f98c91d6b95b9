"""What each model kind takes and gives, by the KIND MODEL_INFO names it: its fields (the request's inputs
and their rules; text_to_image's in models/image_fields.py) and its output tensors. Nothing here imports
torch or diffusers: a model's config stub (the stub Triton starts to ask ``auto_complete_config`` for its
inputs and outputs) reads them from here (models/model_file.py) without paying for the imports its
instances need; the kinds (models/kinds.py) take theirs from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from triton_diffusion.adapters.remasking import REMASKING
from triton_diffusion.fields import (
    DESCRIBE_FIELD,
    REQUIRED,
    RESUME_FIELD,
    SERVICE_FIELDS,
    Field,
    FieldSet,
    Role,
    seed_field,
)
from triton_diffusion.models.image_fields import TEXT_TO_IMAGE_FIELDS
from triton_diffusion.serving.progress import PROGRESS_OUTPUTS

Outputs = list[tuple[str, str, list[int]]]  # (name, Triton data type, dims) of each output tensor

# Outputs every image and video model has beside its images: the size it rendered at, and MODEL_INFO.
RENDER_OUTPUTS: Outputs = [
    ("WIDTH", "TYPE_INT32", [1]),
    ("HEIGHT", "TYPE_INT32", [1]),
    ("MODEL_INFO", "TYPE_STRING", [1]),  # the answer to a describe request (JSON)
]


TEXT_TO_IMAGE_OUTPUTS: Outputs = [
    ("IMAGE", "TYPE_STRING", [-1]),  # one encoded image per generated image
    ("SEED", "TYPE_INT64", [-1]),  # the seed of each image
    ("BATCH", "TYPE_STRING", [1]),  # JSON: the key and the fused calls this request went through
    *RENDER_OUTPUTS,
    *PROGRESS_OUTPUTS,
]


IMAGE_TO_IMAGE_FIELDS = FieldSet(
    [
        # text_to_image's fields with the source image required and no mask (an edit model, as it was).
        *(
            replace(f, default=REQUIRED) if f.name == "image" else f
            for f in TEXT_TO_IMAGE_FIELDS
            if f.name != "mask_image"
        ),
        Field(
            "image_guidance_scale",
            float,
            None,
            minimum=0.0,
            maximum=30.0,
            doc="instruction-edit pipelines (InstructPix2Pix): pull towards the source image",
        ),
    ]
)


def _image_fields(*names: str) -> list[Field]:
    return [TEXT_TO_IMAGE_FIELDS[name] for name in names]


TEXT_TO_VIDEO_FIELDS = FieldSet(
    [
        *_image_fields("prompt", "negative_prompt", "seed"),
        Field(
            "num_videos_per_prompt",
            int,
            1,
            Role.ROW,
            minimum=1,
            maximum=2,
            doc="videos for this prompt; each is one row of the fused call",
        ),
        *_image_fields(
            "height",
            "width",
            "num_inference_steps",
            "guidance_scale",
            "scheduler",
            "output_encoding",
            "step_cache",
            "progress",
            "preview_every",
            "previews",
            "service_tier",
            "timeout",
            "resume_key",
            "describe",
        ),
        Field(
            "num_frames",
            int,
            None,
            minimum=5,
            maximum=81,
            multiple_of=4,
            remainder=1,
            doc="frames per video (Wan: 4k+1)",
        ),
        Field("fps", int, 16, Role.AFTER_SPLIT, minimum=1, maximum=60, doc="frames per second of the MP4"),
        Field(
            "output_format",
            str,
            "mp4",
            Role.AFTER_SPLIT,
            choices=("mp4", "frames"),
            doc="mp4: one MP4 per video in VIDEO; frames: raw uint8 [F, H, W, 3] in FRAMES",
        ),
    ]
)


TEXT_TO_VIDEO_OUTPUTS: Outputs = [
    ("VIDEO", "TYPE_STRING", [-1]),  # one MP4 per video
    ("FRAMES", "TYPE_UINT8", [-1, -1, -1, -1, 3]),  # with output_format "frames": [videos, F, H, W, 3]
    ("SEED", "TYPE_INT64", [-1]),
    ("BATCH", "TYPE_STRING", [1]),
    *RENDER_OUTPUTS,
    *PROGRESS_OUTPUTS,
]


# Every field is per request (ROW): requests never wait for each other's settings, since each runs its
# own schedule inside the shared forward. Config parameters override defaults and limits.
DIFFUSION_LM_FIELDS = FieldSet(
    [
        Field("prompt", str, REQUIRED, Role.ROW, allow_empty=False, max_length=8000, doc="the prompt text"),
        Field(
            "apply_chat_template",
            bool,
            False,
            Role.ROW,
            doc="wrap the prompt as a user turn with the tokenizer's chat template (if it has one)",
        ),
        Field(
            "gen_length",
            int,
            64,
            Role.ROW,
            minimum=1,
            maximum=512,
            doc="tokens to generate: the mask tokens appended to the prompt",
        ),
        Field(
            "block_length",
            int,
            16,
            Role.ROW,
            minimum=1,
            maximum=512,
            doc="decode left to right in blocks of this many tokens (must divide gen_length); "
            "each finished block is streamed",
        ),
        Field(
            "steps",
            int,
            32,
            Role.ROW,
            minimum=1,
            maximum=512,
            doc="denoising steps over all blocks: a multiple of the block count, at most gen_length",
        ),
        Field("temperature", float, 0.0, Role.ROW, minimum=0.0, maximum=2.0, doc="0 = greedy"),
        Field(
            "remasking",
            str,
            "low_confidence",
            Role.ROW,
            choices=REMASKING,
            doc="which masked positions a step commits: the most confident, or random ones",
        ),
        Field(
            "threshold",
            float,
            None,
            Role.ROW,
            minimum=0.0,
            maximum=1.0,
            doc="Fast-dLLM: also commit every position more confident than this (a block may finish "
            "in fewer steps)",
        ),
        Field(
            "cfg_scale",
            float,
            0.0,
            Role.ROW,
            minimum=0.0,
            maximum=10.0,
            doc="classifier-free guidance; > 0 adds a row with the prompt masked",
        ),
        Field("stop_at_eos", bool, True, Role.ROW, doc="stop after a block that holds an EOS token"),
        Field(
            "stream",
            bool,
            True,
            Role.ROW,
            doc="send each finished block as a partial response; false: the FINAL response only "
            "(HTTP generate, which is not streaming, takes exactly one response)",
        ),
        seed_field("seed of the request's own generator; drawn and returned when absent"),
        *SERVICE_FIELDS,
        DESCRIBE_FIELD,
        # Clients send a key to any model (they resend with it after a crash). The diffusion LM takes no
        # checkpoints: a resend generates again from its first block, with the seed the key gives where the
        # request has none, so the blocks a client already has come again, the same; it drops them.
        replace(
            RESUME_FIELD,
            doc="without a seed, the seed is derived from the key, so a resend after a crash draws the same "
            "samples (the diffusion LM takes no checkpoints: it runs from its first block; the project's "
            "client and the OpenAI front drop the blocks they already delivered, and end the request with an "
            "error where one came back different, as its neighbours' rounding may make it)",
        ),
    ]
)

DIFFUSION_LM_OUTPUTS: Outputs = [
    ("TEXT", "TYPE_STRING", [1]),  # partial: the new text of one block; FINAL: the whole text
    ("BLOCK", "TYPE_INT32", [1]),  # partial: index of the block; FINAL: blocks decoded
    ("TOKENS", "TYPE_INT32", [1]),  # generated tokens so far (up to the first EOS)
    ("STEPS", "TYPE_INT32", [1]),  # FINAL: denoising steps (forwards) this request took part in
    ("SEED", "TYPE_INT64", [1]),  # FINAL: the seed used
    ("PROMPT_TOKENS", "TYPE_INT32", [1]),  # FINAL: prompt tokens (chat template included), for usage counts
    ("FINISH_REASON", "TYPE_STRING", [1]),  # FINAL: "stop" (an EOS ended it) or "length" (gen_length)
    ("MODEL_INFO", "TYPE_STRING", [1]),  # the answer to a describe request (JSON)
]


@dataclass(frozen=True)
class Interface:
    """A kind's fields and output tensors."""

    fields: FieldSet
    outputs: Outputs


INTERFACES: dict[str, Interface] = {
    "text_to_image": Interface(TEXT_TO_IMAGE_FIELDS, TEXT_TO_IMAGE_OUTPUTS),
    "image_to_image": Interface(IMAGE_TO_IMAGE_FIELDS, TEXT_TO_IMAGE_OUTPUTS),
    "text_to_video": Interface(TEXT_TO_VIDEO_FIELDS, TEXT_TO_VIDEO_OUTPUTS),
    "text_generation": Interface(DIFFUSION_LM_FIELDS, DIFFUSION_LM_OUTPUTS),
}
