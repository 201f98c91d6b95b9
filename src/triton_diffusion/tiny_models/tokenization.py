"""The tiny models' tokenizers: the real CLIP, T5, Qwen and Gemma classes over small vocabularies written or
trained here (no vocabulary can be downloaded), shared by the families that use the same text encoder.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers.pre_tokenizers import PreTokenizer
    from transformers import CLIPTokenizer, GemmaTokenizer, Qwen2Tokenizer, T5Tokenizer


# The characters the vocabularies here are written over.
CHARS = string.ascii_lowercase + string.digits + string.punctuation


# The tiny diffusion LM's words: enough for readable (if random) text; other words split into characters.
# The trained (Qwen, Gemma) vocabularies hold each of them as one token too.
WORDS = """
the a an and or but if then so of to in on at by for with from as is are was were be been it this that
these those i you he she we they me him her us them my your his its our their what which who when where
why how not no yes all any some many much more most few other such only own same than too very can will
just should now one two three four five six seven eight nine ten first last new old good great small big
long little high low right left time year day week night morning way man woman child people world life
hand part place case point home water room mother father area money story fact month lot study book eye
job word business issue side kind head house service friend power hour game line end member law car city
name team minute idea body information back parent face others level office door health person art war
history party result change reason research girl guy moment air teacher force education sun moon star sky
sea river tree flower bird cat dog horse fish light dark red blue green yellow white black color model
image text language token mask block step diffusion server batch request answer question think know make
go see come take give find tell ask work seem feel try leave call keep let begin help show hear play run
move live believe bring happen write provide sit stand lose pay meet include continue set learn lead
understand watch follow stop create speak read allow add spend grow open walk win offer remember love
consider appear buy wait serve die send expect build stay fall cut reach kill remain
""".split()


def clip_tokenizer() -> CLIPTokenizer:
    """A CLIP tokenizer over single characters (77 tokens), for every CLIP text encoder."""
    from transformers import CLIPTokenizer

    # Character-level BPE (no merges): every character, and every character ending a word.
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> T5Tokenizer:
    """A T5 (SentencePiece unigram) tokenizer over single characters, for the T5 and UMT5 text encoders."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in CHARS] + [("▁" + c, -1.5) for c in CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _train_bpe(
    corpus: list[str], pre_tokenizer: PreTokenizer, specials: list[str], alphabet: list[str]
) -> tuple[dict[str, int], list[tuple[str, ...]]]:
    """Train a BPE vocabulary on ``corpus`` until every pre-token in it is a single token; returns
    ``(vocab, merges)``. Training is deterministic, so the same corpus always gives the same tokenizer."""
    import json

    from tokenizers import Tokenizer, models, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    model = json.loads(backend.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def _corpus(*texts: str) -> list[str]:
    """The texts, then each of their words and the LM's words both alone and after a space."""
    words = [*WORDS, *CHARS, *(w for text in texts for w in text.split())]
    return [*texts, *(f"{w} {w}" for w in words)]


# Qwen's chat tokens (Qwen2.5-VL and Qwen3 share them), then the vision placeholders.
_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def qwen_tokenizer(*texts: str) -> Qwen2Tokenizer:
    """A byte-level BPE ``Qwen2Tokenizer`` (Qwen's pre-tokenizer) whose merges make every word of ``texts``
    (the prompt templates) and of the LM's word list one token, as a real Qwen vocabulary would: Qwen-Image's
    system prompt then takes 34 tokens, the number the pipeline drops."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    vocab, merges = _train_bpe(
        _corpus(*texts), pre_tokenizer, _QWEN_SPECIALS, pre_tokenizers.ByteLevel.alphabet()
    )
    # transformers annotates merges as "a b" strings and unk_token as str; its BPE takes (a, b) pairs and
    # no unknown token as well.
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]
        unk_token=None,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=_QWEN_SPECIALS[1:],
        model_max_length=32768,
    )
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    return tokenizer


def gemma_tokenizer(*texts: str) -> GemmaTokenizer:
    """A ``GemmaTokenizer`` (BPE on "▁"-joined text, byte fallback) whose merges make every word of ``texts``
    (the pipeline's instruction prompts) and of the LM's word list one token."""
    from tokenizers import normalizers, pre_tokenizers
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    specials += [f"<0x{i:02X}>" for i in range(256)]  # byte fallback for characters not in the vocabulary
    alphabet = sorted(set(string.ascii_letters + string.digits + string.punctuation + "▁\n"))
    # Gemma itself does not pre-tokenize; splitting before each "▁" while training keeps merges inside words.
    pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    normalized = [normalizers.Replace(" ", "▁").normalize_str(text) for text in _corpus(*texts)]
    vocab, merges = _train_bpe(normalized, pre_tokenizer, specials, alphabet)
    return GemmaTokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # (a, b) pairs, as for qwen_tokenizer
        add_bos_token=True,
        additional_special_tokens=specials[5:7],
        model_max_length=8192,
    )
