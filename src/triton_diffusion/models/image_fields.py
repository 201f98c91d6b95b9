"""The request fields of the image models, declared once (text_to_image; image_to_image and text_to_video
take theirs from here). Defaults and limits are fallbacks: config.pbtxt parameters override them
(``default_<field>``, ``min_<field>``, ``max_<field>``, ...), and size/step/guidance defaults are read from
the pipeline itself at load."""

from __future__ import annotations

from triton_diffusion.codecs.image import IMAGE_FORMATS, OUTPUT_ENCODINGS
from triton_diffusion.fields import (
    DESCRIBE_FIELD,
    REQUIRED,
    RESUME_FIELD,
    SERVICE_FIELDS,
    SOURCE_IMAGE_FIELDS,
    Field,
    FieldSet,
    Role,
    seed_field,
)
from triton_diffusion.serving.progress import PROGRESS_FIELDS

TEXT_TO_IMAGE_FIELDS = FieldSet(
    [
        Field("prompt", str, REQUIRED, Role.ROW, allow_empty=False, max_length=2000, doc="what to draw"),
        Field(
            "negative_prompt",
            str,
            None,
            Role.ROW,
            max_length=2000,
            # Strict by default: families.py relaxes it where the pipeline treats None as "".
            key_on_presence=True,
            doc="what to steer away from",
        ),
        seed_field("random seed of the first image; image i uses seed + i; drawn and returned when absent"),
        Field(
            "num_images_per_prompt",
            int,
            1,
            Role.ROW,
            minimum=1,
            maximum=4,
            doc="images for this prompt; each is one row of the fused call",
        ),
        Field("height", int, None, minimum=64, maximum=2048, doc="image height in pixels"),
        Field("width", int, None, minimum=64, maximum=2048, doc="image width in pixels"),
        Field("num_inference_steps", int, None, minimum=1, maximum=150, doc="denoising steps"),
        Field(
            "min_inference_steps",
            int,
            None,
            Role.ROW,
            minimum=1,
            maximum=150,
            doc="under overload, the fewest num_inference_steps the request may be run with where its "
            "deadline needs it (step engine; BATCH degraded says so; docs/usage/degradation.md); absent: "
            "the tier's degrade_tiers share, else never fewer",
        ),
        Field("guidance_scale", float, None, minimum=0.0, maximum=30.0, doc="classifier-free guidance"),
        Field(
            "true_cfg_scale",
            float,
            None,
            minimum=0.0,
            maximum=30.0,
            doc="true CFG (Flux, Qwen-Image); on when > 1 and a negative prompt is given",
        ),
        Field("scheduler", str, None, doc="scheduler class name, from scheduler_choices"),
        Field("output_format", str, "png", Role.AFTER_SPLIT, choices=IMAGE_FORMATS, doc="image file format"),
        Field(
            "output_encoding",
            str,
            "binary",
            Role.AFTER_SPLIT,
            choices=OUTPUT_ENCODINGS,
            doc="base64 keeps the image intact in HTTP generate's JSON",
        ),
        Field(
            "lora",
            str,
            None,
            max_length=512,
            doc="LoRA adapters from the model's loras: name or name:scale, comma-separated (ink:0.8,neon)",
        ),
        Field(
            "step_cache",
            str,
            None,
            max_length=64,
            doc="skip denoiser work per request on a DiT: none, fbc:THRESHOLD (First Block Cache) or "
            "taylorseer:INTERVAL[:WARMUP] (docs/usage/step-caches.md); default: the model's step_cache",
        ),
        Field(
            "degrade_step_cache",
            str,
            None,
            Role.ROW,
            max_length=64,
            doc="under overload, the step cache (as step_cache) a running request may be given for its steps "
            "left where its deadline needs it (step engine, DiT; BATCH degraded says so; "
            "docs/usage/degradation.md); none: never; absent: the tier's degrade_step_cache, else never",
        ),
        *PROGRESS_FIELDS,
        *SERVICE_FIELDS,
        RESUME_FIELD,
        *SOURCE_IMAGE_FIELDS,  # served where the step adapter can start a job from an image
        DESCRIBE_FIELD,
    ]
)
