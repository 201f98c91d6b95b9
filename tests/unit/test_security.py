"""Weights load with safetensors only, remote code stays off unless the config opts in, and the model
path comes from the config only."""

import json

import pytest

from triton_diffusion.adapters import diffusers_pipeline
from triton_diffusion.settings import ModelSettings
from triton_diffusion.tiny_models import DEFAULT_WEIGHTS_DIR, build_missing


def settings(tmp_path, **params):
    config = {"max_batch_size": 8, "parameters": {k: {"string_value": v} for k, v in params.items()}}
    return ModelSettings.from_triton_args(
        {
            "model_config": json.dumps(config),
            "model_name": "m",
            "model_repository": str(tmp_path),
            "model_instance_kind": "CPU",
            "model_instance_device_id": "0",
        }
    )


def test_pickled_weights_are_refused(tmp_path):
    from diffusers import DiffusionPipeline

    build_missing(DEFAULT_WEIGHTS_DIR, only=["tiny-sd"])
    pickled = tmp_path / "pickled"
    DiffusionPipeline.from_pretrained(DEFAULT_WEIGHTS_DIR / "tiny-sd").save_pretrained(
        pickled, safe_serialization=False
    )
    # diffusers writes the UNet and VAE as pickles here (transformers 5 writes safetensors regardless).
    assert list((pickled / "unet").glob("*.bin")) and not list((pickled / "unet").glob("*.safetensors"))
    with pytest.raises(Exception, match="safetensors"):
        diffusers_pipeline.load_pipeline(settings(tmp_path, model=str(pickled)))


def test_remote_code_is_off_unless_the_config_opts_in(tmp_path, monkeypatch):
    seen = {}

    class Recorder:
        @staticmethod
        def from_pretrained(source, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("recorded")

    import diffusers

    monkeypatch.setattr(diffusers, "DiffusionPipeline", Recorder)
    for params, expected in (({}, False), ({"trust_remote_code": "true"}, True)):
        with pytest.raises(RuntimeError, match="recorded"):
            diffusers_pipeline.load_pipeline(settings(tmp_path, model="org/some-model", **params))
        assert seen["trust_remote_code"] is expected and seen["use_safetensors"] is True


def test_model_paths_resolve_against_the_model_folder_and_must_exist(tmp_path):
    (tmp_path / "weights").mkdir()
    assert settings(tmp_path, model="weights").model_source() == str((tmp_path / "weights").resolve())
    assert settings(tmp_path, model="org/hub-id").model_source() == "org/hub-id"
    with pytest.raises(ValueError, match="does not exist"):
        settings(tmp_path, model="../missing-folder").model_source()
    with pytest.raises(ValueError, match="needs a 'model' parameter"):
        settings(tmp_path).model_source()


def test_the_diffusion_lm_loads_safetensors_and_remote_code_only_when_the_config_opts_in(
    tmp_path, monkeypatch
):
    import transformers

    from triton_diffusion.adapters import masked_lm

    seen = {}

    class Recorder:
        @staticmethod
        def from_pretrained(source, **kwargs):
            seen.update(kwargs, source=source)
            raise RuntimeError("recorded")

    monkeypatch.setattr(transformers, "AutoModelForMaskedLM", Recorder)
    monkeypatch.setattr(transformers, "AutoModel", Recorder)
    for params, expected in (({}, False), ({"trust_remote_code": "true", "model_class": "AutoModel"}, True)):
        with pytest.raises(RuntimeError, match="recorded"):
            masked_lm.load_masked_lm(settings(tmp_path, model="org/some-dllm", **params))
        assert seen["trust_remote_code"] is expected and seen["use_safetensors"] is True
        assert seen["source"] == "org/some-dllm"
    # Only the transformers auto classes listed may be named in the config.
    with pytest.raises(ValueError, match="model_class must be one of"):
        masked_lm.load_masked_lm(settings(tmp_path, model="org/some-dllm", model_class="os.system"))
