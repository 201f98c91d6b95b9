"""The diffusion LM: ``tiny-dllm``, the tiny default the diffusion_lm model serves: a bidirectional masked LM
with a WordPiece tokenizer, standing in for LLaDA.
"""

from __future__ import annotations

import string
from pathlib import Path

from triton_diffusion.tiny_models.tokenization import CHARS, WORDS


def build_tiny_dllm(target: Path) -> None:
    """A bidirectional masked LM (EuroBERT classes, LLaDA-like: rotary positions, SwiGLU) with a
    WordPiece tokenizer and a chat template, as a tiny stand-in for LLaDA."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import EuroBertConfig, EuroBertForMaskedLM, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "<|mask|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    # The pre-tokenizer splits punctuation off, so only letters and digits continue a word ("##").
    continuations = ["##" + c for c in string.ascii_lowercase + string.digits]
    for piece in [*WORDS, *CHARS, *continuations]:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=64))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="<|mask|>",
        eos_token="<|eos|>",
        additional_special_tokens=specials[4:],
    )
    tokenizer.chat_template = (
        "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    torch.manual_seed(0)
    config = EuroBertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=1024,
        pad_token_id=vocab["[PAD]"],
        bos_token_id=None,
        eos_token_id=vocab["<|eos|>"],
        mask_token_id=vocab["<|mask|>"],
    )
    # Random weights are nearly uniform over the vocabulary; a wider init gives confident, varied picks.
    config.initializer_range = 0.2
    model = EuroBertForMaskedLM(config)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
