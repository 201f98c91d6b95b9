"""What a model reads from its ``config.pbtxt``: every parameter declared once here, parsed and checked once
at load into a typed, frozen :class:`ModelConfig`, plus the model's device and dtype.

A parameter is declared with its type, default and meaning, and with the model kinds that read it; a key
no kind of this model reads is a load error with a did-you-mean (as an unknown request field is a request
error). Request-field parameters (``default_<field>``, ``min_<field>``, ``max_<field>``, ...) are passed on
to the field declarations (fields.py). README's "Configuration" table is generated from :data:`PARAMETERS`.
This is the only module that reads config parameters. Model and LoRA paths come from here, never from a
request.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# Which models read a parameter.
IMAGE = "image"  # text_to_image, image_to_image, text_to_video
IMAGE_SOURCE = "image_source"  # text_to_image, image_to_image: models that take a source image
LM = "lm"  # diffusion_lm
ALL = (IMAGE, IMAGE_SOURCE, LM)
ENGINES = ("auto", "step", "request")
# Prefixes and suffixes of the request-field parameters fields.py applies (Field.configured).
FIELD_PARAMETER_FORMS = ("default_{}", "min_{}", "max_{}", "{}_choices", "{}_multiple_of", "max_{}_length")
# Old names still accepted for one meaning: the running set's size in jobs (images, or LM requests).
RENAMED = {"max_running_rows": "max_running", "max_running_requests": "max_running"}


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _parameter(default: Any, doc: str, kinds: tuple[str, ...] = ALL, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"doc": doc, "kinds": kinds, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    """The model's parameters, typed. ``None`` means "derived at load" where the doc says so."""

    # ---- the model --------------------------------------------------------------------------------
    model: str | None = _parameter(
        None, "a local diffusers/transformers folder (relative to the model's folder) or a hub id; required"
    )
    dtype: str = _parameter(
        "auto",
        "auto (bf16 on GPU, fp32 on CPU), float32, float16, bfloat16 or float64",
        choices=("auto", "float32", "float16", "bfloat16", "float64"),
    )
    trust_remote_code: bool = _parameter(False, "allow the model folder's own Python code (off: safer)")
    pipeline_class: str | None = _parameter(
        None,
        "diffusers class to load with; default: DiffusionPipeline (AutoPipelineForImage2Image for img2img)",
        (IMAGE, IMAGE_SOURCE),
    )
    scheduler_choices: str | None = _parameter(
        None,
        "comma-separated scheduler classes a request may pick besides the pipeline's own",
        (IMAGE, IMAGE_SOURCE),
    )
    max_sequence_length: int | None = _parameter(
        None, "text-encoder tokens (Flux, SD3); default: the pipeline's", (IMAGE, IMAGE_SOURCE)
    )
    model_class: str = _parameter(
        "AutoModelForMaskedLM", "transformers auto class of the diffusion LM", (LM,)
    )
    mask_token_id: int | None = _parameter(
        None, "mask token id; default: the model config's or tokenizer's", (LM,)
    )
    eos_token_ids: str | None = _parameter(
        None, "comma-separated EOS token ids; default: the tokenizer's", (LM,)
    )
    shift_logits: bool = _parameter(False, "the model predicts token i at position i-1 (Dream)", (LM,))
    attention_mask_format: str = _parameter(
        "2d", "2d: [rows, length] mask; 4d: [rows, 1, length, length] boolean (Dream)", (LM,), ("2d", "4d")
    )
    intra_op_threads: int | None = _parameter(
        None, "torch threads in this model's process; default: torch's", (LM,)
    )
    max_prompt_tokens: int = _parameter(1024, "longest prompt after tokenization", (LM,))
    # ---- source images (text_to_image, image_to_image) ---------------------------------------------
    max_image_pixels: int = _parameter(
        4096 * 4096, "largest decoded source image, in pixels", (IMAGE_SOURCE,)
    )
    image_formats: str = _parameter(
        "PNG,JPEG,WEBP", "source image formats the decoder accepts", (IMAGE_SOURCE,)
    )
    resize_buckets: str | None = _parameter(
        None, "WIDTHxHEIGHT,...: snap each source to the nearest size by aspect ratio", (IMAGE_SOURCE,)
    )
    # ---- LoRA adapters (text_to_image, image_to_image) -----------------------------------------------
    loras: str | None = _parameter(
        None,
        'LoRA adapters a request may name in its lora field, JSON {"name": "path"}: each path (relative to '
        "the model's folder) a .safetensors file or a folder holding one (diffusers' save_lora_weights, "
        "kohya); all loaded at model load, unmerged",
        (IMAGE_SOURCE,),
    )
    max_lora_scale: float = _parameter(2.0, "largest |scale| a request may give an adapter", (IMAGE_SOURCE,))
    max_loras_per_request: int = _parameter(4, "most adapters one request may name", (IMAGE_SOURCE,))
    # ---- the engine -------------------------------------------------------------------------------
    engine: str = _parameter(
        "auto",
        "auto (the step engine where the family has a step adapter), step or request",
        (IMAGE, IMAGE_SOURCE),
        ENGINES,
    )
    max_rows_per_call: int | None = _parameter(
        None,
        "images per fused call (request engine) or per forward (step engine); default: max_batch_size",
        (IMAGE, IMAGE_SOURCE),
    )
    max_rows_by_resolution: str | None = _parameter(
        None,
        'lower caps for some sizes, JSON {"WIDTHxHEIGHT": images}; a video\'s "WIDTHxHEIGHTxFRAMES" wins',
        (IMAGE, IMAGE_SOURCE),
    )
    max_running: int | None = _parameter(
        None,
        "jobs in the step engine's running set (images, or LM requests); default: max_rows_per_call; LM: 8",
    )
    waiting_room: int | None = _parameter(
        None,
        "jobs held beyond the running set before execute() blocks; default: max_rows_per_call (step), "
        "max_batch_size (request), 4 (LM)",
    )
    max_admission_wait_s: float = _parameter(120.0, "longest a request waits for room before UNAVAILABLE")
    cancel_poll_ms: float = _parameter(50.0, "ask a running request about cancellation at most this often")
    scheduling_policy: str = _parameter(
        "oldest",
        "which jobs step next (engine/policies.py)",
        (IMAGE, IMAGE_SOURCE),
        ("oldest", "round_robin", "fewest_remaining", "largest", "first_step_first"),
    )
    starvation_steps: int = _parameter(
        16, "a job not stepped for this many engine steps goes next", (IMAGE, IMAGE_SOURCE)
    )
    admission_cohort: int | None = _parameter(
        None,
        "a busy step engine admits newcomers once this many places are free, so they are encoded, and "
        "later decoded, together (engine/policies.py AdmissionPacing); 1: whenever there is room; "
        "default: half the forward's cap (images), 1 (LM); at most half of max_running",
    )
    admission_max_wait_steps: int = _parameter(
        8, "... or once the oldest waiting job has waited this many engine steps"
    )
    cuda_graphs: bool = _parameter(
        False,
        "step engine on a GPU: each forward replays a CUDA graph captured at load per size and row bucket "
        "(1, 2, 4, 8, then every 4; rows padded to the bucket); other sizes run eagerly; ignored on a CPU, "
        "not with loras; off by default until measured on a GPU (adapters/captured_forwards.py)",
        (IMAGE, IMAGE_SOURCE),
    )
    cuda_graph_sizes: str | None = _parameter(
        None,
        "WIDTHxHEIGHT,...: the sizes cuda_graphs captures; default: the default width and height",
        (IMAGE, IMAGE_SOURCE),
    )
    engine_stall_s: float = _parameter(
        120.0,
        "an engine with work that reports nothing for this long (or 5x its slowest step, if longer) is "
        "stuck: what it holds is answered UNAVAILABLE and the process exits for a restart",
    )
    fault_injection: str | None = _parameter(None, "tests only: JSON of faults to inject (faults.py)")

    @classmethod
    def parse(
        cls, params: Mapping[str, str], kinds: Iterable[str], request_fields: Iterable[str], model: str
    ) -> ModelConfig:
        """Typed values from config.pbtxt's string parameters. Raises ValueError naming the key."""
        kinds = set(kinds)
        declared = {f.name: f for f in fields(cls)}
        readable = {name for name, f in declared.items() if kinds & set(f.metadata["kinds"])}
        field_keys = {form.format(name) for name in request_fields for form in FIELD_PARAMETER_FORMS}
        values: dict[str, Any] = {}
        for key, text in params.items():
            if key in field_keys and key not in declared:  # scheduler_choices is a parameter of its own
                continue
            key = RENAMED.get(key, key)
            if key not in readable:
                known = sorted(readable | field_keys)
                hint = difflib.get_close_matches(key, known, n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
                what = "is not read by this kind of model" if key in declared else "is not a known parameter"
                raise ValueError(
                    f"model {model}: config parameter {key!r} {what}{suggestion} (README: Configuration)"
                )
            if text == "":
                continue  # an empty value keeps the default
            values[key] = _typed(declared[key], text, model)
        if values.get("engine_stall_s", 1.0) <= 0:
            raise ValueError(f"model {model}: config parameter 'engine_stall_s' must be > 0")
        for key, least in (("admission_cohort", 1), ("admission_max_wait_steps", 0)):
            if values.get(key) is not None and values[key] < least:
                raise ValueError(f"model {model}: config parameter {key!r} must be >= {least}")
        return cls(**values)


def _typed(spec: Any, text: str, model: str) -> Any:
    kind = str(spec.type)
    try:
        if "bool" in kind:
            value: Any = _flag(text)
        elif "int" in kind:
            value = int(text)
        elif "float" in kind:
            value = float(text)
        else:
            value = text
    except ValueError as exc:
        raise ValueError(f"model {model}: config parameter {spec.name!r}: {exc}") from None
    choices = spec.metadata["choices"]
    if choices and str(value).lower() not in choices:
        raise ValueError(
            f"model {model}: config parameter {spec.name!r} must be one of {', '.join(choices)}, got {text!r}"
        )
    if choices:
        value = str(value).lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"model {model}: config parameter {spec.name!r} must be >= 0, got {text!r}")
    return value


def config_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: "k" value: { string_value: "v" } }`` as a plain dict."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def parameters_markdown() -> str:
    """README's configuration table, straight from the declarations."""
    names = {IMAGE: "image and video models", IMAGE_SOURCE: "image models", LM: "diffusion_lm"}
    lines = ["| parameter | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for f in fields(ModelConfig):
        kinds = f.metadata["kinds"]
        read_by = (
            "all"
            if set(kinds) == set(ALL)
            else ", ".join(names[k] for k in kinds if k != IMAGE_SOURCE or len(kinds) == 1)
        )
        kind = str(f.type).replace(" | None", "")
        allowed = f" (one of {', '.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
        if f.default is not None:
            default = f"`{f.default}`"
        else:
            default = (
                "required" if f.name == "model" else "derived" if "default:" in f.metadata["doc"] else "none"
            )
        lines.append(f"| `{f.name}` | {kind} | {default} | {read_by} | {f.metadata['doc']}{allowed} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelSettings:
    name: str
    model_dir: Path  # the model's folder inside the model repository
    config: ModelConfig
    field_params: dict[str, str]  # default_<field>, max_<field>, ...: for FieldSet.configured
    max_batch_size: int
    instance_kind: str  # "CPU", "GPU" or "MODEL"
    device_id: int

    @classmethod
    def from_triton_args(
        cls, args: Mapping[str, str], kinds: Iterable[str] = ALL, request_fields: Iterable[str] = ()
    ) -> ModelSettings:
        model_config = json.loads(args["model_config"])
        name = args["model_name"]
        params = config_parameters(model_config)
        request_fields = list(request_fields)
        field_keys = {form.format(f) for f in request_fields for form in FIELD_PARAMETER_FORMS}
        return cls(
            name=name,
            model_dir=Path(args["model_repository"]),
            config=ModelConfig.parse(params, kinds, request_fields, name),
            field_params={k: v for k, v in params.items() if k in field_keys},
            max_batch_size=int(model_config.get("max_batch_size", 0)),
            instance_kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id", 0)),
        )

    def model_source(self) -> str:
        """``model``: a local diffusers folder (relative to the model's folder) or a hub id."""
        source = self.config.model
        if source is None:
            raise ValueError(f"model {self.name}: config.pbtxt needs a 'model' parameter (path or hub id)")
        path = Path(source).expanduser()
        if not path.is_absolute():
            path = self.model_dir / path
        if path.exists():
            return str(path.resolve())
        if source.startswith((".", "/", "~")):
            raise ValueError(f"model {self.name}: model path {path} does not exist (build tiny weights?)")
        return source  # a hub id

    def device(self) -> str:
        import torch

        wants_gpu = self.instance_kind in ("GPU", "MODEL")
        if wants_gpu and torch.cuda.is_available():
            return f"cuda:{self.device_id}"
        return "cpu"

    def torch_dtype(self, device: str):
        import torch

        if self.config.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, self.config.dtype)

    def max_rows_per_call(self) -> int:
        return self.config.max_rows_per_call or max(self.max_batch_size, 1)
