"""The typed model config: every parameter declared once, parsed and checked at load."""

import json

import pytest

from triton_diffusion.settings import IMAGE, IMAGE_SOURCE, LM, ModelConfig, ModelSettings

FIELDS = ["prompt", "height", "num_inference_steps", "image", "scheduler"]


def settings(params: dict[str, str], kinds=(IMAGE,)) -> ModelSettings:
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}, "max_batch_size": 32}
    args = {"model_config": json.dumps(config), "model_name": "m", "model_repository": "/tmp"}
    return ModelSettings.from_triton_args(args, kinds, FIELDS)


def test_parameters_are_typed_once_and_field_limits_pass_through():
    loaded = settings(
        {"max_rows_per_call": "4", "cancel_poll_ms": "10", "trust_remote_code": "yes", "max_height": "256"}
    )
    assert loaded.config.max_rows_per_call == 4 and loaded.config.cancel_poll_ms == 10.0
    assert loaded.config.trust_remote_code is True and loaded.config.engine == "auto"
    assert loaded.field_params == {"max_height": "256"} and loaded.max_rows_per_call() == 4
    assert settings({}).max_rows_per_call() == 32  # max_batch_size when not set
    assert settings({"engine": "STEP"}).config.engine == "step"
    # A parameter of its own although it has a field's form (the request field ``scheduler``).
    choices = settings({"scheduler_choices": "EulerDiscreteScheduler"}, kinds=(IMAGE,))
    assert choices.config.scheduler_choices == ("EulerDiscreteScheduler",)


def test_an_unknown_key_is_a_load_error_with_a_did_you_mean():
    with pytest.raises(ValueError, match=r"'max_rows_per_cal'.*did you mean 'max_rows_per_call'"):
        settings({"max_rows_per_cal": "4"})
    with pytest.raises(ValueError, match="not a known parameter"):
        settings({"colour": "blue"})


def test_a_key_another_kind_reads_is_refused_naming_why():
    with pytest.raises(ValueError, match="'max_prompt_tokens' is not read by this kind of model"):
        settings({"max_prompt_tokens": "10"}, kinds=(IMAGE,))
    with pytest.raises(ValueError, match="resize_buckets"):
        settings({"resize_buckets": "64x64"}, kinds=(IMAGE,))
    buckets = settings({"resize_buckets": "64x64, 96X64"}, kinds=(IMAGE, IMAGE_SOURCE)).config.resize_buckets
    assert buckets == ((64, 64), (96, 64))
    assert settings({"max_prompt_tokens": "10"}, kinds=(LM,)).config.max_prompt_tokens == 10


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_rows_per_call": "four"}, "max_rows_per_call"),
        ({"trust_remote_code": "maybe"}, "trust_remote_code"),
        ({"engine": "turbo"}, "engine' must be one of auto, step, request"),
        ({"waiting_room": "-1"}, "waiting_room' must be >= 0"),
        ({"engine_stall_s": "0"}, "engine_stall_s' must be > 0"),
        # Values that are not a plain number, flag or word are parsed here too, once (item 6).
        ({"max_rows_by_resolution": '{"big": 2}'}, "'max_rows_by_resolution': row cap 'big'"),
        ({"max_rows_by_resolution": "{"}, "'max_rows_by_resolution': not JSON"),
        ({"loras": '["x"]'}, "'loras': expected a JSON object"),
        ({"loras": '{"a,b": "x"}'}, "'loras': LoRA name 'a,b'"),
        ({"resize_buckets": "64by64"}, "'resize_buckets': expected WIDTHxHEIGHT"),
        ({"cuda_graph_sizes": "64x"}, "'cuda_graph_sizes': expected WIDTHxHEIGHT"),
        ({"fault_injection": '{"explode": 1}'}, "'fault_injection': fault_injection: unknown keys"),
        ({"fault_injection": "{"}, "'fault_injection'"),
        ({"eos_token_ids": "1,two"}, "'eos_token_ids': expected comma-separated integers"),
        ({"service_tiers": "gold,gold"}, "'service_tiers': expected distinct tier names"),
        ({"default_service_tier": "gold"}, "'default_service_tier' must be one of priority, default, flex"),
        ({"deadline_policy": "maybe"}, "'deadline_policy' must be one of refuse, best_effort"),
        ({"step_cache": "fbc:2"}, "'step_cache': step_cache: threshold 2 is outside"),
        ({"step_cache": "teacache:1"}, "'step_cache': step_cache: unknown method 'teacache'"),
    ],
)
def test_a_bad_value_names_the_key_and_what_is_allowed(params, message):
    kinds = (IMAGE, IMAGE_SOURCE, LM)
    with pytest.raises(ValueError, match=message):
        settings(params, kinds=kinds)


def test_structured_values_are_typed_at_load():
    loaded = settings(
        {
            "max_rows_by_resolution": '{"1024X768": 2, "832x480x81": 1}',
            "loras": '{"ink": "a/b"}',
            "fault_injection": '{"step_delay_ms": 5}',
            "service_tiers": "gold,silver",
            "default_service_tier": "silver",
            "step_cache": "taylorseer:4",
            "image_formats": "png,webp",
        },
        kinds=(IMAGE, IMAGE_SOURCE),
    ).config
    assert loaded.max_rows_by_resolution == {"1024x768": 2, "832x480x81": 1}
    assert loaded.loras == {"ink": "a/b"} and loaded.fault_injection.step_delay_ms == 5
    assert loaded.service_tiers == ("gold", "silver") and loaded.default_service_tier == "silver"
    assert loaded.step_cache.text == "taylorseer:4:3" and loaded.image_formats == ("PNG", "WEBP")


def test_old_names_of_the_running_set_size_still_load():
    assert settings({"max_running_rows": "16"}).config.max_running == 16
    assert settings({"max_running_requests": "2"}, kinds=(LM,)).config.max_running == 2


def test_the_config_is_frozen():
    with pytest.raises(AttributeError):
        ModelConfig().engine = "step"  # type: ignore[misc]
