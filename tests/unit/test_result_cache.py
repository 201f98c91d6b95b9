"""The result cache (serving/result_cache.py): what is in a request's key, LRU within the bound."""

from __future__ import annotations

import numpy as np
from PIL import Image

from triton_diffusion.serving.result_cache import ResultCache, result_key

VALUES = {"prompt": "a cat", "seed": 7, "height": 64, "width": 64, "step_cache": "fbc:0.1", "lora": None}


def answer(size: int) -> dict[str, np.ndarray]:
    return {"IMAGE": np.array([[b"x" * size]], dtype=object), "SEED": np.array([[7]], dtype=np.int64)}


def test_the_key_is_every_output_affecting_field_and_only_those():
    key = result_key(VALUES, seed_given=True)
    assert key is not None and key == result_key(dict(VALUES), seed_given=True)
    # How a request is served changes nothing it answers: the same key.
    served = {**VALUES, "progress": True, "previews": 2, "service_tier": "flex", "timeout": 5_000_000}
    assert result_key(served, seed_given=True) == key
    for name, other in (("seed", 8), ("step_cache", "fbc:0.2"), ("lora", "ink:1"), ("prompt", "a dog")):
        assert result_key({**VALUES, name: other}, seed_given=True) != key, name
    assert result_key(VALUES, seed_given=False) is None  # a drawn seed never hits


def test_a_source_image_is_keyed_by_its_pixels():
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    first = result_key({**VALUES, "image": red}, seed_given=True)
    assert first == result_key({**VALUES, "image": red.copy()}, seed_given=True)
    assert first != result_key({**VALUES, "image": blue}, seed_given=True)


def test_answers_come_back_byte_for_byte_and_the_least_recent_go_first():
    cache = ResultCache(max_bytes=250)
    cache.put("a", answer(100))
    cache.put("b", answer(100))
    assert cache.get("a")["IMAGE"][0, 0] == b"x" * 100  # a is now the most recent
    cache.put("c", answer(100))  # over the bound: b, the least recently used, goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes <= 250
    cache.put("huge", answer(1000))  # larger than the whole bound: never kept
    assert cache.get("huge") is None
    off = ResultCache(0)
    off.put("a", answer(1))
    assert not off and off.get("a") is None
