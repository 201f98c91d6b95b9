"""What the shared Triton model decides per request without a server (serving/triton_model.py): the
request's service (its tier, refused by name when it names none of the model's) and the answer it gets
from the result cache (its own service, not the first request's)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.recording import tracked
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.fields import SERVICE_FIELDS, FieldSet
from triton_diffusion.models.diffusion_model import DiffusionModel, ParsedRequest, batch_output
from triton_diffusion.serving.result_cache import ResultCache
from triton_diffusion.serving.triton_model import Urgency
from triton_diffusion.settings import ModelConfig


def model() -> DiffusionModel:
    """A model with its config (tiers priority, default, flex; default ``default``), nothing loaded."""
    bare = DiffusionModel.__new__(DiffusionModel)
    bare.settings = SimpleNamespace(config=ModelConfig.parse({}, ["image"], [], "m"))
    bare.fields = FieldSet(SERVICE_FIELDS)
    bare.metrics = SimpleNamespace(increment=lambda *args, **labels: None)
    return bare


def test_a_request_without_a_tier_gets_the_default_and_a_named_tier_its_rank():
    served = model()
    assert served.service_of({}, tracked("none")) == Urgency(1, None)
    assert served.service_of({"service_tier": None}, tracked("none")) == Urgency(1, None)
    assert served.service_of({"service_tier": "flex"}, tracked("flex")).tier == 2


@pytest.mark.parametrize("tier", ["", " ", "\t", "default ", "Priority"])
def test_an_empty_blank_or_unknown_tier_is_refused_naming_the_field_and_the_tiers(tier):
    with pytest.raises(RequestError) as refused:
        model().service_of({"service_tier": tier}, tracked("bad"))
    assert refused.value.code is ErrorCode.INVALID_ARG
    assert refused.value.message == (
        f"service_tier: got {tier!r} (allowed: one of priority, default, flex)"
    ), refused.value.message


def test_a_result_cache_hit_reports_its_own_service_not_the_first_requests():
    served = model()
    served.results = ResultCache(1 << 20)
    first_service = {"tier": "flex", "paused_times": 2, "paused_s": 1.25, "deadline_ms": 300.0}
    image = np.array([[b"png bytes"]], dtype=object)
    first = {"IMAGE": image, "BATCH": batch_output({"engine": "step", "service": first_service})}
    served.results.put("key", first)
    parsed = ParsedRequest(0, {}, None, (), Urgency(tier=0), result_key="key")  # priority, no deadline
    answer = served.cached_answer(parsed)
    batch = json.loads(answer["BATCH"].reshape(-1)[0])
    assert batch["result_cache"] == "hit" and batch["engine"] == "step"
    assert batch["service"] == {"tier": "priority", "paused_times": 0, "paused_s": 0.0}
    assert answer["IMAGE"][0, 0] == b"png bytes"  # the same bytes
    # The cached answer itself is untouched: a later hit of another tier reports that tier.
    later = served.cached_answer(ParsedRequest(1, {}, None, (), Urgency(tier=1), result_key="key"))
    assert json.loads(later["BATCH"].reshape(-1)[0])["service"]["tier"] == "default"
    assert json.loads(served.results.get("key")["BATCH"].reshape(-1)[0])["service"] == first_service
