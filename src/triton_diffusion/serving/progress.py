"""Fields and outputs every denoising model has for progress: STEP/TOTAL_STEPS after every denoising step
and a low-resolution PREVIEW every N steps, as non-final responses before the FINAL one."""

from __future__ import annotations

from triton_diffusion.fields import Field, Role

PROGRESS_FIELDS = [
    Field("progress", bool, False, Role.AFTER_SPLIT, doc="send STEP/TOTAL_STEPS after every denoising step"),
    Field(
        "preview_every",
        int,
        0,
        Role.AFTER_SPLIT,
        minimum=0,
        maximum=1000,
        doc="with progress: a low-resolution PREVIEW image every N steps (0 = never)",
    ),
    Field(
        "previews",
        int,
        0,
        Role.AFTER_SPLIT,
        minimum=0,
        maximum=10,
        doc="with progress: this many PREVIEW images spread evenly over the steps the request runs (the "
        "k-th past (k+1)/(previews+1) of them), before the last one; with preview_every, both",
    ),
]
PROGRESS_OUTPUTS = [
    ("STEP", "TYPE_INT32", [1]),
    ("TOTAL_STEPS", "TYPE_INT32", [1]),
    ("PREVIEW", "TYPE_STRING", [1]),
]
