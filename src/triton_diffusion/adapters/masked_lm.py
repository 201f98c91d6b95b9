"""Loading a masked diffusion LM and calling it on a padded batch.

The tiny default is a transformers ``EuroBertForMaskedLM`` (bidirectional, rotary positions, takes
``position_ids``). Real dLLM checkpoints such as LLaDA or Dream ship their modelling code with the
weights; they load only when the model config sets ``trust_remote_code``. Weights load from safetensors
only, from the path or hub id in the config.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from triton_diffusion.adapters.devices import instance_device, instance_dtype
from triton_diffusion.settings import ModelSettings

MODEL_CLASSES = ("AutoModelForMaskedLM", "AutoModel", "AutoModelForCausalLM")

# Classes whose logits are a linear head over their base model's last hidden state: (base, head). For
# these the head runs on the positions a step needs only, not on the whole sequence.
HEAD_ON_HIDDEN_STATE = {"EuroBertForMaskedLM": ("model", "lm_head")}


class MaskedLMForward:
    """``(input_ids, attention_mask, position_ids, keep) -> logits`` at the ``keep`` positions
    ([rows, k] -> [rows, k, vocab]), for any masked LM.

    Models whose forward takes ``position_ids`` get left padding with explicit positions. Others (LLaDA's
    remote code takes none) get right padding: with bidirectional attention and a key mask, real tokens
    then keep positions 0..n-1 without being told. ``shift_logits`` is for models adapted from an
    autoregressive one (Dream), whose logits at i predict token i + 1. ``mask_format`` "4d" passes the
    padding mask as a [rows, 1, length, length] boolean matrix (Dream's modelling code wants that; a 2-D
    mask is what transformers' own models take).
    """

    def __init__(self, model: Any, shift_logits: bool = False, mask_format: str = "2d") -> None:
        if mask_format not in ("2d", "4d"):
            raise ValueError(f"attention_mask_format must be 2d or 4d, got {mask_format!r}")
        self.model = model
        self.shift_logits = shift_logits
        self.mask_format = mask_format
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.padding_side = "left" if self.takes_positions else "right"
        split = HEAD_ON_HIDDEN_STATE.get(type(model).__name__)
        self.base_and_head = (
            None if split is None or shift_logits else tuple(getattr(model, n) for n in split)
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        if self.mask_format == "4d":
            real = attention_mask.bool()
            # A padding query attends to itself only, so no row of the matrix is empty (NaN in softmax).
            itself = torch.eye(real.shape[1], dtype=torch.bool, device=real.device)
            attention_mask = (real[:, None, :, None] & real[:, None, None, :]) | itself
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        if self.base_and_head is not None:
            base, head = self.base_and_head
            hidden = base(input_ids=input_ids, **kwargs).last_hidden_state
            return head(_gather_positions(hidden, keep))
        logits = self.model(input_ids=input_ids, **kwargs).logits
        if self.shift_logits:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return _gather_positions(logits, keep)

    def unpadded(self, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Rows of equal length with no padding (the one-request reference)."""
        ones = torch.ones_like(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self(input_ids, ones, positions, keep)


def _gather_positions(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values[i, keep[i, j]]`` for [rows, length, d] values and [rows, k] positions."""
    index = keep.to(values.device).unsqueeze(-1).expand(-1, -1, values.shape[-1])
    return values.gather(1, index)


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids; with ``chat``, as one user turn of the tokenizer's chat template, followed
    by the assistant's turn marker (the generated tokens are the answer)."""
    if chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(prompt, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


@dataclass(frozen=True)
class LoadedMaskedLM:
    forward: MaskedLMForward
    tokenizer: Any
    mask_id: int
    pad_id: int
    eos_ids: tuple[int, ...]
    device: str
    vocab_size: int


def load_masked_lm(settings: ModelSettings) -> LoadedMaskedLM:
    """The model and tokenizer named by the config's ``model``. ``model_class`` picks the transformers
    auto class, ``mask_token_id`` / ``eos_token_ids`` override what the tokenizer and config say."""
    import transformers

    config = settings.config
    class_name = config.model_class
    if class_name not in MODEL_CLASSES:
        raise ValueError(
            f"model {settings.name}: model_class must be one of {MODEL_CLASSES}, got {class_name}"
        )
    source = settings.model_source()
    remote_code = config.trust_remote_code
    device = instance_device(settings)
    model = getattr(transformers, class_name).from_pretrained(
        source,
        dtype=instance_dtype(settings, device),
        use_safetensors=True,
        trust_remote_code=remote_code,
    )
    model.to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=remote_code)

    mask_id = config.mask_token_id
    if mask_id is None:
        mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise ValueError(f"model {settings.name}: no mask token id; set the mask_token_id parameter")
    if config.eos_token_ids is not None:
        eos_ids = config.eos_token_ids
    else:
        eos_ids = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or (mask_id,))[0]
    return LoadedMaskedLM(
        forward=MaskedLMForward(
            model,
            shift_logits=config.shift_logits,
            mask_format=config.attention_mask_format,
        ),
        tokenizer=tokenizer,
        mask_id=int(mask_id),
        pad_id=int(pad_id),
        eos_ids=eos_ids,
        device=device,
        vocab_size=int(getattr(model.config, "vocab_size", None) or len(tokenizer)),
    )
