"""Rows of different sizes in one denoiser call (a *packed forward*), for the transformer families whose
positions are tokens' own (FLUX.1's rotary ids, SD3's cropped position table).

Each row is placed on a common **canvas** of latent tokens (patches), the smallest grid that holds every
row at the positions it has alone, and padded with zeros around it; an attention **key mask** hides every
slot that is not the row's own, so a row's tokens attend to its own tokens and its text only. Everything
else a transformer does is per token (linear layers, norms) or per row (timestep, guidance and text
embeddings, LoRA rows), so each row's outputs on its own slots are what it gets alone, to rounding.

- FLUX.1 numbers a size's patches from the origin (ids ``(0, y, x)``), so a row sits at the canvas's top
  left and the canvas's own ids are the row's; the canvas is (tallest) x (widest).
- SD3 crops its position table around the centre (``PatchEmbed.cropped_pos_embed``), so a row sits where
  its crop lies inside the canvas's crop; nested centred crops make the canvas (tallest) x (widest) too.

Padding is what this costs: a canvas slot a row does not use is still computed. Rows of one aspect ratio
pad to the largest; 64x64, 96x64 and 64x128 together pad a 64x64 row from 16 to 48 tokens. A forward of
one size is never packed (no padding, no mask). Chosen over true variable-length packing (tokens of every
row concatenated, block-diagonal attention) because diffusers' blocks take one timestep embedding per
batch row: rows concatenated into one sequence would need per-token modulation, a change to every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import JointAttnProcessor2_0

# The group of a job that shares forwards with jobs of every size (a family that packs sizes); such a job
# also joins its own size's forwards (JobStart.also_joins), where jobs with a step cache keep to it.
ANY_SIZE = "any size"
# An image job's denoiser rows and its latent token grid (token rows, token columns).
Grid = tuple[int, int, int]


def padded_counts(grids: Sequence[Grid | None], tokens: Sequence[int]) -> tuple[int, int]:
    """The denoiser rows and tokens a forward of jobs with these grids (and own tokens) computes: their own
    tokens where they are of one size (or any has no grid: a video); packed (sizes mixed), every row on a
    canvas of the tallest by the widest grid, padding included: what the token budget bounds and a
    forward costs."""
    rows = sum(g[0] if g is not None else 1 for g in grids)
    known = [g for g in grids if g is not None]
    if len(known) < len(grids) or len({g[1:] for g in known}) <= 1:
        return rows, sum(tokens)
    return rows, sum(g[0] for g in known) * max(g[1] for g in known) * max(g[2] for g in known)


@dataclass(frozen=True)
class Placement:
    """A row on the canvas: its top-left slot and its own grid, in tokens."""

    top: int
    left: int
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.height * self.width

    def slots(self, canvas_width: int) -> torch.Tensor:
        """The canvas indices of the row's tokens (row-major on the canvas), in the row's own order."""
        rows = torch.arange(self.top, self.top + self.height)[:, None] * canvas_width
        return (rows + torch.arange(self.left, self.left + self.width)[None, :]).reshape(-1)


@dataclass(frozen=True)
class Canvas:
    """The common grid of a packed forward (in tokens) and where each model row lies on it."""

    height: int
    width: int
    rows: tuple[Placement, ...]

    @property
    def tokens(self) -> int:
        return self.height * self.width

    @property
    def padded_tokens(self) -> int:
        """Slots computed for no row: what packing cost this forward."""
        return self.tokens * len(self.rows) - sum(row.tokens for row in self.rows)

    def key_mask(self, text_tokens: int, text_first: bool, device: torch.device | str) -> torch.Tensor:
        """[rows, canvas + text] booleans (True: attend), in the order the family's attention joins image
        and text tokens: each row's own slots and its text."""
        image = torch.zeros(len(self.rows), self.tokens, dtype=torch.bool)
        for r, row in enumerate(self.rows):
            image[r, row.slots(self.width)] = True
        text = torch.ones(len(self.rows), text_tokens, dtype=torch.bool)
        mask = torch.cat([text, image] if text_first else [image, text], dim=1)
        return mask.to(device)


def canvas_for(grids: Sequence[tuple[int, int]], centred_in: int | None = None) -> Canvas:
    """The canvas of rows with these (height, width) token grids: at the origin (FLUX.1's ids), or where
    each lies in a position table of ``centred_in`` tokens a side cropped around its centre (SD3)."""
    height, width = max(g[0] for g in grids), max(g[1] for g in grids)
    if centred_in is None:
        return Canvas(height, width, tuple(Placement(0, 0, h, w) for h, w in grids))
    top, left = (centred_in - height) // 2, (centred_in - width) // 2
    rows = tuple(Placement((centred_in - h) // 2 - top, (centred_in - w) // 2 - left, h, w) for h, w in grids)
    return Canvas(height, width, rows)


def place_tokens(rows: Sequence[torch.Tensor], canvas: Canvas) -> torch.Tensor:
    """Rows in token layout ([1, tokens, C] each) on the canvas: [rows, canvas tokens, C], zeros around."""
    first = rows[0]
    out = first.new_zeros(len(rows), canvas.tokens, first.shape[-1])
    for r, (values, row) in enumerate(zip(rows, canvas.rows, strict=True)):
        out[r, row.slots(canvas.width).to(out.device)] = values[0]
    return out


def take_tokens(output: torch.Tensor, canvas: Canvas) -> list[torch.Tensor]:
    """Each row's own tokens from a [rows, canvas tokens, C] output, [1, tokens, C] each."""
    return [output[r : r + 1, row.slots(canvas.width).to(output.device)] for r, row in enumerate(canvas.rows)]


def place_patches(rows: Sequence[torch.Tensor], canvas: Canvas, patch: int) -> torch.Tensor:
    """Rows in spatial layout ([1, C, h, w] latents, ``patch`` pixels a token) on the canvas."""
    first = rows[0]
    out = first.new_zeros(len(rows), first.shape[1], canvas.height * patch, canvas.width * patch)
    for r, (values, row) in enumerate(zip(rows, canvas.rows, strict=True)):
        top, left = row.top * patch, row.left * patch
        out[r, :, top : top + row.height * patch, left : left + row.width * patch] = values[0]
    return out


def take_patches(output: torch.Tensor, canvas: Canvas, patch: int) -> list[torch.Tensor]:
    """Each row's own region of a [rows, C, H, W] output, [1, C, h, w] each."""
    taken = []
    for r, row in enumerate(canvas.rows):
        top, left = row.top * patch, row.left * patch
        taken.append(output[r : r + 1, :, top : top + row.height * patch, left : left + row.width * patch])
    return taken


class MaskedJointAttnProcessor(JointAttnProcessor2_0):
    """SD3's joint attention (diffusers' ``JointAttnProcessor2_0``) honouring a [rows, keys] boolean
    ``attention_mask``, which diffusers' processor ignores: the one place this package restates a diffusers
    body. Without a mask it is diffusers' own. ``tests/unit/test_packed_rows.py`` checks a packed SD3
    forward against each row alone, so a diffusers change to the processor fails there."""

    def __call__(  # type: ignore[override]
        self,
        attn: Any,  # diffusers' Attention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: object,
        **kwargs: object,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, None, *args, **kwargs)  # type: ignore[arg-type]
        rows, image_tokens = hidden_states.shape[:2]
        heads = attn.heads

        def split(values: torch.Tensor) -> torch.Tensor:
            return values.view(rows, -1, heads, values.shape[-1] // heads).transpose(1, 2)

        query, key, value = (
            split(attn.to_q(hidden_states)),
            split(attn.to_k(hidden_states)),
            split(attn.to_v(hidden_states)),
        )
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            text_query = split(attn.add_q_proj(encoder_hidden_states))
            text_key = split(attn.add_k_proj(encoder_hidden_states))
            text_value = split(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            query = torch.cat([query, text_query], dim=2)
            key = torch.cat([key, text_key], dim=2)
            value = torch.cat([value, text_value], dim=2)
        mask = attention_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False
        )
        out = out.transpose(1, 2).reshape(rows, -1, out.shape[1] * out.shape[-1]).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image, text = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return attn.to_out[1](attn.to_out[0](image)), text
