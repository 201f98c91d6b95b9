from dataclasses import replace

from triton_diffusion.compatibility import compatibility_key
from triton_diffusion.fields import FieldSet
from triton_diffusion.models.text_to_image import TEXT_TO_IMAGE_FIELDS

FIELDS = TEXT_TO_IMAGE_FIELDS.configured(
    {
        "default_height": "64",
        "default_width": "64",
        "default_num_inference_steps": "4",
        "default_guidance_scale": "7.5",
        "default_true_cfg_scale": "1.0",
        "default_scheduler": "DDIM",
    }
)


def key(**raw):
    return compatibility_key(FIELDS, FIELDS.parse({"prompt": "p", **raw}))


def test_row_and_after_split_fields_do_not_split_batches():
    assert key(prompt="a", seed=1, output_format="png", num_images_per_prompt=2) == key(
        prompt="b", seed=2, output_format="jpeg", num_images_per_prompt=1
    )


def test_sampling_fields_split_batches_and_the_first_difference_is_named():
    assert key(height=64) != key(height=128)
    assert key(height=128).first_difference(key(height=64)) == "height"
    assert key(num_inference_steps=8, guidance_scale=2.0).first_difference(key()) == "num_inference_steps"


def test_negative_prompt_presence_is_in_the_key_when_declared_structural():
    assert key(negative_prompt="blurry") == key(negative_prompt="ugly")
    assert key(negative_prompt="blurry") != key()
    assert key(negative_prompt="") != key()  # "" is present: SDXL/Flux treat it unlike None
    assert key(negative_prompt="x").first_difference(key()) == "has_negative_prompt"


def test_negative_prompt_presence_can_be_relaxed_per_pipeline():
    relaxed = FieldSet(
        replace(f, key_on_presence=False) if f.name == "negative_prompt" else f for f in FIELDS
    )
    values = relaxed.parse({"prompt": "p", "negative_prompt": "x"})
    assert compatibility_key(relaxed, values) == compatibility_key(relaxed, relaxed.parse({"prompt": "p"}))


def test_unsupported_fields_stay_out_of_the_key():
    fields = FIELDS.configured({}, unsupported=["true_cfg_scale"])
    assert "true_cfg_scale" not in compatibility_key(fields, fields.parse({"prompt": "p"})).as_dict()
