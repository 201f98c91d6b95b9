"""What the diffusion LM streams per block (models/diffusion_lm.py): a client appends each block's TEXT, so
the blocks' texts put together must always be a prefix of the whole text the FINAL response carries, even
where a later token changes how earlier ones decode (a tokenizer's clean-up joins " '" and "s" as "'s"),
and all of it once the last block is sent."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from triton_diffusion.models.diffusion_lm import DiffusionLMModel

PIECES = {0: "it", 1: " '", 2: "s", 3: " fine", 4: ".", 5: " '", 6: "m", 7: " here"}


SPECIAL = 99  # a special token (not an end of text): it decodes to nothing


class CleaningTokenizer:
    """Decodes as transformers' clean_up_tokenization does: " 's" and " 'm" lose their space."""

    all_special_ids = [SPECIAL]

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(PIECES[t] for t in tokens if t != SPECIAL)
        return text.replace(" 's", "'s").replace(" 'm", "'m")


def streamed(blocks: list[list[int]]) -> list[str]:
    """Each block's TEXT as the model sends it, the tokens so far growing block by block."""
    model = object.__new__(DiffusionLMModel)  # progress_outputs reads nothing but the tokenizer
    model.lm = SimpleNamespace(tokenizer=CleaningTokenizer())
    record, texts, tokens = SimpleNamespace(state=None), [], []
    for index, block in enumerate(blocks):
        tokens = tokens + block
        last = index == len(blocks) - 1
        outputs = model.progress_outputs(record, SimpleNamespace(snapshot=(tokens, index, last)))
        texts.append(bytes(np.asarray(outputs["TEXT"]).reshape(-1)[0]).decode())
    return texts


@pytest.mark.parametrize(
    "blocks, expected",
    [
        # "it '" then "s": the clean-up reaches back across the block boundary
        ([[0, 1], [2, 3], [4]], ["it", "'s", " fine."]),
        ([[0], [1], [2], [3, 5], [6, 7]], ["", "it", "", "'s fine", "'m here"]),
        ([[0, 1, 2, 3], [4, 5, 6, 7]], ["it's", " fine.'m here"]),
        # a special token after " '": " '" still waits, for the "s" that joins it
        ([[0, 1, SPECIAL], [2, 3], [4]], ["it", "'s", " fine."]),
    ],
)
def test_the_blocks_put_together_are_always_a_prefix_of_the_whole_text(blocks, expected):
    texts = streamed(blocks)
    whole = CleaningTokenizer().decode([t for block in blocks for t in block])
    for k in range(1, len(texts) + 1):
        assert whole.startswith("".join(texts[:k])), (texts, whole)
    # What the last token leaves as it was goes at once, the rest with the next block; the last block
    # sends the rest, so the blocks put together are the whole text.
    assert texts == expected and "".join(texts) == whole
