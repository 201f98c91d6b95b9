import math

import pytest

from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.fields import REQUIRED, Field, FieldSet, Role, merge_parameters
from triton_diffusion.models.text_to_image import TEXT_TO_IMAGE_FIELDS

FIELDS = FieldSet(
    [
        Field("prompt", str, REQUIRED, Role.ROW, allow_empty=False, max_length=10),
        Field("seed", int, None, Role.ROW, minimum=0, maximum=2**63 - 1),
        Field("height", int, 64, minimum=64, maximum=512, multiple_of=8),
        Field("guidance_scale", float, 7.5, minimum=0.0, maximum=30.0),
        Field("scheduler", str, "DDIM", choices=("DDIM", "Euler")),
        Field("output_format", str, "png", Role.AFTER_SPLIT, choices=("png", "jpeg")),
        Field("progress", bool, False, Role.AFTER_SPLIT),
    ]
)


def error_of(raw):
    with pytest.raises(RequestError) as info:
        FIELDS.parse(raw)
    assert info.value.code is ErrorCode.INVALID_ARG
    return info.value.message


def test_defaults_fill_in_and_values_keep_their_type():
    values = FIELDS.parse({"prompt": "a cat", "guidance_scale": 3})
    assert values == {
        "prompt": "a cat",
        "seed": None,
        "height": 64,
        "guidance_scale": 3.0,
        "scheduler": "DDIM",
        "output_format": "png",
        "progress": False,
    }
    assert isinstance(values["guidance_scale"], float)


@pytest.mark.parametrize(
    "raw, field, words",
    [
        ({}, "prompt", "required"),
        ({"prompt": "   "}, "prompt", "must not be empty"),
        ({"prompt": "x" * 11}, "prompt", "at most 10 characters"),
        ({"prompt": 5}, "prompt", "must be a string"),
        ({"prompt": "a", "height": 100000}, "height", "64..512, multiple of 8"),
        ({"prompt": "a", "height": 100}, "height", "multiple of 8"),
        ({"prompt": "a", "height": 0}, "height", "64..512"),
        ({"prompt": "a", "height": -64}, "height", "64..512"),
        ({"prompt": "a", "height": 64.0}, "height", "must be an integer"),
        ({"prompt": "a", "height": True}, "height", "must be an integer"),
        ({"prompt": "a", "seed": -1}, "seed", "0..9223372036854775807"),
        ({"prompt": "a", "seed": 2**63}, "seed", "0..9223372036854775807"),
        ({"prompt": "a", "guidance_scale": math.nan}, "guidance_scale", "finite"),
        ({"prompt": "a", "guidance_scale": math.inf}, "guidance_scale", "finite"),
        ({"prompt": "a", "guidance_scale": -1.0}, "guidance_scale", "0..30"),
        ({"prompt": "a", "scheduler": "PNDM"}, "scheduler", "one of 'DDIM', 'Euler'"),
        ({"prompt": "a", "progress": "yes"}, "progress", "must be a boolean"),
    ],
)
def test_invalid_values_name_the_field_and_the_allowed_range(raw, field, words):
    message = error_of(raw)
    assert message.startswith(f"{field}: ")
    assert words in message


def test_unknown_field_suggests_the_closest_name():
    message = error_of({"prompt": "a", "heigth": 64})
    assert message.startswith("heigth: unknown field; did you mean 'height'?")


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("steps", "num_inference_steps"),
        ("stepz", "num_inference_steps"),
        ("Height", "height"),
        ("negative", "negative_prompt"),
    ],
)
def test_suggestions_match_parts_of_names(typo, meant):
    assert TEXT_TO_IMAGE_FIELDS.closest_name(typo) == meant


def test_config_parameters_override_defaults_and_limits():
    configured = FIELDS.configured(
        {
            "default_height": "128",
            "max_height": "256",
            "scheduler_choices": "Euler, DDIM",
            "default_scheduler": "Euler",
        }
    )
    assert configured["height"].default == 128 and configured["height"].maximum == 256
    assert configured.parse({"prompt": "a"})["scheduler"] == "Euler"
    with pytest.raises(RequestError, match="64..256"):
        configured.parse({"prompt": "a", "height": 512})


def test_a_default_outside_the_limits_is_a_config_error():
    with pytest.raises(RequestError, match="height"):
        FIELDS.configured({"default_height": "1000"})


def test_unsupported_fields_are_refused_only_when_sent():
    configured = FIELDS.configured({}, unsupported=["guidance_scale"])
    assert configured.parse({"prompt": "a"})["guidance_scale"] == 7.5
    with pytest.raises(RequestError, match="guidance_scale: is not supported"):
        configured.parse({"prompt": "a", "guidance_scale": 2.0})


def test_fields_are_strict_by_default():
    assert Field("new_knob", int).role is Role.KEY


def test_docs_table_is_derived_from_the_declarations():
    table = TEXT_TO_IMAGE_FIELDS.markdown_table()
    for field in TEXT_TO_IMAGE_FIELDS:
        assert f"`{field.name}` / `{field.input_name}`" in table
    assert "presence is in the key" in table


@pytest.mark.parametrize(
    "raw, position",
    [
        ({"prompt": "a\0b"}, 1),
        ({"prompt": "a\0" + "x" * 5000}, 1),  # refused for its NUL, before its length is looked at
        ({"prompt": "\0"}, 0),
        ({"prompt": "a", "scheduler": "DDIM\0"}, 4),
    ],
)
def test_a_nul_inside_any_string_field_is_refused_naming_the_field_before_its_length(raw, position):
    field = "scheduler" if "scheduler" in raw else "prompt"
    message = error_of(raw)
    assert message.startswith(f"{field}: contains a NUL character at position {position} (allowed: no NUL")
    assert "characters long" not in message


def test_parameters_join_the_tensors_by_name_without_case_and_a_field_sent_twice_is_refused():
    tensors = {"prompt": "a cat"}
    merged = merge_parameters(tensors, {"HEIGHT": 128, "seed": 3}, FIELDS)
    assert merged == {"prompt": "a cat", "height": 128, "seed": 3}
    with pytest.raises(RequestError) as both:
        merge_parameters(tensors, {"height": 64, "HEIGHT": 128}, FIELDS)
    assert both.value.message == (
        "height: sent twice, as request parameters whose names differ only by case: 'height' and 'HEIGHT'"
    )
    with pytest.raises(RequestError) as twice:
        merge_parameters({**tensors, "height": 64}, {"Height": 64}, FIELDS)
    assert twice.value.message == "height: sent both as an input tensor and as a request parameter"
    image = FieldSet([Field("image", bytes)])
    assert merge_parameters({}, {"image": "aGk="}, image) == {"image": b"aGk="}  # base64 text: bytes
