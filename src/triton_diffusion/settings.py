"""What a model reads from its ``config.pbtxt``: every parameter declared once here, parsed and checked once
at load into a typed, frozen :class:`ModelConfig`, plus the model's device and dtype.

A parameter is declared with its type, default and meaning, and with the model kinds that read it; a key
no kind of this model reads is a load error with a did-you-mean (as an unknown request field is a request
error). Request-field parameters (``default_<field>``, ``min_<field>``, ``max_<field>``, ...) are passed on
to the field declarations (fields.py). docs/reference/config.md is generated from :data:`PARAMETERS`.
This is the only module that reads config parameters. Model and LoRA paths come from here, never from a
request.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from triton_diffusion.config_values import (
    parse_degrade_step_cache,
    parse_degrade_tiers,
    parse_ints,
    parse_lora_paths,
    parse_names,
    parse_row_caps,
    parse_sizes,
    parse_step_cache_text,
    parse_tiers,
    typed_value,
)
from triton_diffusion.engine.ordering import POLICIES  # noqa: E402  (torch-free: the policies' names and docs)

# Which models read a parameter.
IMAGE = "image"  # text_to_image, image_to_image, text_to_video
IMAGE_SOURCE = "image_source"  # text_to_image, image_to_image: models that take a source image
LM = "lm"  # diffusion_lm
ALL = (IMAGE, IMAGE_SOURCE, LM)
ENGINES = ("auto", "step", "request")
# Prefixes and suffixes of the request-field parameters fields.py applies (Field.configured).
FIELD_PARAMETER_FORMS = ("default_{}", "min_{}", "max_{}", "{}_choices", "{}_multiple_of", "max_{}_length")


@dataclass(frozen=True)
class Renamed:
    """An old name still read for a parameter: its value divided by ``per`` (an old unit: ``unit``)."""

    name: str
    per: int = 1
    unit: str = ""


# Old names still read: the running set's size in jobs (images, or LM requests); durations in seconds.
RENAMED = {
    "max_running_rows": Renamed("max_running"),
    "max_running_requests": Renamed("max_running"),
    "cancel_poll_ms": Renamed("cancel_poll_s", 1000, "milliseconds"),
}
# The engines a derived default tells apart (Derived), as docs/reference/config.md names them.
DERIVED_CASES = {"step": "step engine", "request": "request engine", LM: "diffusion_lm"}


@dataclass(frozen=True)
class Derived:
    """A default computed at load from other parameters, declared beside its parameter as Python
    expressions over the resolved parameters, ``max_batch_size`` (config.pbtxt's) and ``max``/``min``:
    ``step`` for an image model's step engine, ``request`` for the request-level engine and ``lm`` for
    the diffusion LM (each as ``step`` unless given); ``at_most``: a cap on the value, configured or
    derived. :meth:`ModelSettings.resolved` evaluates these expressions and the reference's text of the
    default is made of them (:meth:`doc`), so what runs and what is documented are one text."""

    step: str
    request: str | None = None
    lm: str | None = None
    at_most: str | None = None

    def expression(self, case: str) -> str:
        """The expression for ``case``, one of :data:`DERIVED_CASES`."""
        return {"step": self.step, "request": self.request or self.step, LM: self.lm or self.step}[case]

    def doc(self) -> str:
        """``default: EXPR (where), ...; at most EXPR``, for docs/reference/config.md."""
        where: dict[str, list[str]] = {}
        for case, label in DERIVED_CASES.items():
            where.setdefault(self.expression(case), []).append(label)
        if len(where) == 1:
            text = f"default: {self.step}"
        else:
            names = {"step engine and request engine": "image and video models"}
            text = "default: " + ", ".join(
                f"{expression} ({names.get(' and '.join(cases), ' and '.join(cases))})"
                for expression, cases in where.items()
            )
        return text + (f"; at most {self.at_most}" if self.at_most else "")


def _parameter(
    default: Any,
    doc: str,
    kinds: tuple[str, ...] = ALL,
    choices: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    written: str | None = None,
    derived: Derived | None = None,
) -> Any:
    """A config parameter: its default, meaning, the model kinds that read it, its choices; a parser for
    a value that is not a plain number, flag or word (``written``: how it is written, for the reference); a
    default computed at load from other parameters (``derived``: the declared default is then None)."""
    assert derived is None or default is None, "a derived default is declared as None"
    metadata = {
        "doc": doc,
        "kinds": kinds,
        "choices": choices,
        "parse": parse,
        "written": written,
        "derived": derived,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ModelConfig:
    """The model's parameters, typed. ``None`` means "derived at load" where the doc says so: from other
    parameters where the declaration has a :class:`Derived` (read it through
    :meth:`ModelSettings.resolved`), from the model itself where the doc says whose."""

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
    scheduler_choices: tuple[str, ...] = _parameter(
        (),
        "comma-separated scheduler classes a request may pick besides the pipeline's own",
        (IMAGE, IMAGE_SOURCE),
        parse=parse_names,
        written="NAME,...",
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
    eos_token_ids: tuple[int, ...] | None = _parameter(
        None,
        "comma-separated EOS token ids; default: the tokenizer's",
        (LM,),
        parse=parse_ints,
        written="ID,...",
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
    image_formats: tuple[str, ...] = _parameter(
        ("PNG", "JPEG", "WEBP"),
        "source image formats the decoder accepts",
        (IMAGE_SOURCE,),
        parse=lambda text: tuple(name.upper() for name in parse_names(text)),
        written="NAME,...",
    )
    resize_buckets: tuple[tuple[int, int], ...] = _parameter(
        (),
        "snap each source to the nearest size by aspect ratio",
        (IMAGE_SOURCE,),
        parse=parse_sizes,
        written="WIDTHxHEIGHT,...",
    )
    # ---- LoRA adapters (text_to_image, image_to_image) -----------------------------------------------
    loras: dict[str, str] | None = _parameter(
        None,
        'LoRA adapters a request may name in its lora field, JSON {"name": "path"}: each path (relative to '
        "the model's folder) a .safetensors file or a folder holding one (diffusers' save_lora_weights, "
        "kohya); all loaded at model load, unmerged",
        (IMAGE_SOURCE,),
        parse=parse_lora_paths,
        written="JSON",
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
        "images per fused call (request engine) or per forward (step engine)",
        (IMAGE, IMAGE_SOURCE),
        derived=Derived("max(max_batch_size, 1)"),
    )
    max_rows_by_resolution: dict[str, int] | None = _parameter(
        None,
        'lower caps for some sizes, JSON {"WIDTHxHEIGHT": images}; a video\'s "WIDTHxHEIGHTxFRAMES" wins',
        (IMAGE, IMAGE_SOURCE),
        parse=parse_row_caps,
        written="JSON",
    )
    max_tokens_per_forward: int | None = _parameter(
        None,
        "step engine: denoiser tokens per forward, padding included (rows x latent tokens, frames included; "
        "a guided image has two rows), a cap beside max_rows_per_call and max_rows_by_resolution; unset, the "
        "row caps alone bound a forward, of one size or packed, and a forward that runs out of memory "
        "learns a token cap for its group",
        (IMAGE, IMAGE_SOURCE),
    )
    pack_sizes: bool = _parameter(
        True,
        "step engine: images of different sizes share one forward where the family packs them (FLUX.1, SD3: "
        "rows padded to a common grid of latent tokens, attention masked to each row's own; MODEL_INFO's "
        "packed_sizes says whether, and why not); false: one size per forward",
        (IMAGE, IMAGE_SOURCE),
    )
    packing_gate: bool = _parameter(
        True,
        "step engine, where sizes are packed: a forward of several sizes runs one size at a time where the "
        "engine's cost fit (calibrated at load) prices that cheaper by 5% and 1 ms; false: every such "
        "forward runs packed, whatever it costs (a model measured to gain from packing, or a test of it)",
        (IMAGE, IMAGE_SOURCE),
    )
    narrow_forwards: bool = _parameter(
        False,
        "step engine: where a job with a deadline would be late stepping in forwards as full as the caps "
        "allow and in time in smaller ones, a forward holds the jobs in order up to the most that keep it in "
        "time (those left out wait until starved: starvation_steps), and deadline estimates "
        "(refusals, cuts, pauses) count on it; only where the engine's cost fit prices the smaller forward "
        "within 5% per token of the full one (where a forward's time grows with its rows); false (the "
        "default: through the server on the tiny SD on a CPU the fit allowed it, and it narrowed and lost "
        "goodput at low load, docs/performance/cpu.md): every forward fills to its caps",
        (IMAGE, IMAGE_SOURCE),
    )
    max_running: int | None = _parameter(
        None,
        "jobs in the step engine's running set (images, or LM requests)",
        derived=Derived("max_rows_per_call", lm="8"),
    )
    waiting_room: int | None = _parameter(
        None,
        "jobs held beyond the running set (request engine: beyond one fused call of max_rows_per_call) "
        "before execute() blocks",
        derived=Derived("max_rows_per_call", request="max(max_batch_size, max_rows_per_call)", lm="4"),
    )
    max_admission_wait_s: float = _parameter(120.0, "longest a request waits for room before UNAVAILABLE")
    deadline_room: int | None = _parameter(
        None,
        "step engine, deadline_policy refuse: jobs beyond max_running + waiting_room that a request with a "
        "deadline joins without waiting in execute() (a wait there holds up the requests behind it; the "
        "scheduler refuses it where it cannot finish in time; a request without a deadline counts jobs with "
        "one only beyond that many); 0: it waits for room like any other (the diffusion LM's default: not "
        "measured there)",
        derived=Derived("max_running + waiting_room", request="0", lm="0"),
    )
    cancel_poll_s: float = _parameter(
        0.05,
        "step engine: ask a held request about cancellation at most this often (the request-level engine"
        " asks before each fused call and between its steps)",
    )
    scheduling_policy: str = _parameter(
        "oldest",
        "which group of running jobs steps next, and their order (engine/ordering.py): "
        + "; ".join(f"{name}: {policy.doc}" for name, policy in POLICIES.items()),
        (IMAGE, IMAGE_SOURCE),
        tuple(POLICIES),
    )
    starvation_steps: int = _parameter(
        16, "a running job not stepped for this many engine steps goes next", (IMAGE, IMAGE_SOURCE)
    )
    service_tiers: tuple[str, ...] = _parameter(
        ("priority", "default", "flex"),
        "the service tiers a request may name in its service_tier field, highest first: a higher tier is "
        "admitted first and pauses a lower one when the running set is full (step engine)",
        parse=parse_tiers,
        written="NAME,...",
    )
    default_service_tier: str = _parameter(
        "default", "the tier of a request that names none (one of service_tiers)"
    )
    deadline_policy: str = _parameter(
        "refuse",
        "a request's deadline (its Triton timeout, or the timeout parameter): refuse: refused at once when "
        "the engine's estimate says it cannot finish in time, ended when it passes; best_effort: it only "
        "orders the work",
        choices=("refuse", "best_effort"),
    )
    degrade_tiers: dict[str, float] | None = _parameter(
        None,
        "step engine: under overload, the least share of its num_inference_steps a request of a tier may be "
        'run with when it sends no min_inference_steps, JSON {"TIER": share in (0, 1]} (e.g. {"flex": 0.5}): '
        "only where its deadline needs it (docs/usage/degradation.md); unset: only a request's own "
        "min_inference_steps allows fewer steps",
        (IMAGE, IMAGE_SOURCE),
        parse=parse_degrade_tiers,
        written="JSON",
    )
    degrade_step_cache: dict[str, str] | None = _parameter(
        None,
        "step engine, DiT families: under overload, the step cache a running request of a tier may be given "
        'for its steps left when it sends no degrade_step_cache, JSON {"TIER": "fbc:THRESHOLD" or '
        '"taylorseer:INTERVAL[:WARMUP]"} (e.g. {"flex": "fbc:0.2"}): only where its deadline needs it '
        "(docs/usage/degradation.md); unset: only a request's own degrade_step_cache allows one",
        (IMAGE, IMAGE_SOURCE),
        parse=parse_degrade_step_cache,
        written="JSON",
    )
    tier_aging_s: float = _parameter(
        30.0,
        "every this many seconds a job has waited or been paused raise it one tier (no starvation: see "
        "docs/design/tiers-and-deadlines.md); 0: no aging",
    )
    max_paused: int | None = _parameter(
        None,
        "jobs held paused at once for a higher tier (their latents stay in memory)",
        derived=Derived("max_running"),
    )
    tier_pause: str = _parameter(
        "tier",
        "step engine: when a request of a higher tier pauses a running one of a lower tier (the running set "
        "full) or joins without waiting for the admission cohort: tier: always; deadline: only where the "
        "engine's estimate of its finish, waiting, is not within 90% of its time left, or while the load is "
        "shown above capacity, and always for a request without a deadline (a paused job loses its place)",
        (IMAGE, IMAGE_SOURCE),
        ("tier", "deadline"),
    )
    step_cache: Any = _parameter(
        None,
        "the step cache of requests that send no step_cache field: none, fbc:THRESHOLD or "
        "taylorseer:INTERVAL[:WARMUP] (docs/usage/step-caches.md)",
        (IMAGE, IMAGE_SOURCE),
        parse=parse_step_cache_text,
        written="METHOD[:...]",
    )
    result_cache_mb: float = _parameter(
        0.0,
        "memory for answers to repeated requests (same inputs, a seed given): answered again without "
        "running; 0: off",
        (IMAGE, IMAGE_SOURCE),
    )
    admission_cohort: int | None = _parameter(
        None,
        "a busy step engine admits newcomers once this many places are free, so they are encoded, and "
        "later decoded, together (engine/ordering.py AdmissionPacing); 1: whenever there is room (the "
        "LM's default: tokenizing costs nearly nothing)",
        # At most half the running set: a busy engine must be able to see that many places free, or every
        # newcomer would wait the whole admission_max_wait_steps.
        derived=Derived("max(1, max_rows_per_call // 2)", lm="1", at_most="max(1, max_running // 2)"),
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
    cuda_graph_sizes: tuple[tuple[int, int], ...] = _parameter(
        (),
        "the sizes cuda_graphs captures; default: the default width and height",
        (IMAGE, IMAGE_SOURCE),
        parse=parse_sizes,
        written="WIDTHxHEIGHT,...",
    )
    engine_stall_s: float = _parameter(
        120.0,
        "an engine with work that reports nothing for this long (or 5x its slowest step, if longer) is "
        "stuck: what it holds is answered UNAVAILABLE and the process exits for a restart",
    )
    # ---- checkpoints (recovery/resumes.py): a crash loses no work ----------------------------------
    checkpoint_every_steps: int = _parameter(
        0,
        "step engine: write a running job's state every this many denoising steps when its request has a "
        "resume_key, so a resend after a crash resumes from it; 0: off",
        (IMAGE,),
    )
    checkpoint_dir: str | None = _parameter(
        None,
        "where checkpoints are written (relative to the model's folder, or absolute); needed with them",
        (IMAGE,),
    )
    checkpoint_max_mb: float = _parameter(1024.0, "disk the checkpoints may take, in MB", (IMAGE,))
    checkpoint_ttl_s: float = _parameter(3600.0, "seconds a checkpoint is kept", (IMAGE,))
    device_profile: str | None = _parameter(
        None,
        "benchmarks only: the denoiser and VAE decode replaced by stand-ins that wait a measured GPU's "
        "times and compute nothing (sd15-h100: StableDiffusionPipeline at 512x512; flux1-h100: FluxPipeline, "
        "priced by each forward's arithmetic; "
        "adapters/device_profiles.py), so a forward is as long as on that GPU while the rest runs at this "
        "machine's speed; what it serves is not an image",
        (IMAGE,),
    )

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
        given: dict[str, str] = {}  # parameter -> the name config.pbtxt gave it
        for key, text in params.items():
            if key in field_keys and key not in declared:  # scheduler_choices is a parameter of its own
                continue
            renamed = RENAMED.get(key)
            written, key = key, renamed.name if renamed else key
            if key not in readable:
                known = sorted(readable | field_keys)
                hint = difflib.get_close_matches(key, known, n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
                what = "is not read by this kind of model" if key in declared else "is not a known parameter"
                raise ValueError(
                    f"model {model}: config parameter {key!r} {what}{suggestion} (docs/reference/config.md)"
                )
            if key in given:
                twice = f"given twice (as {given[key]!r} and {written!r})"
                raise ValueError(f"model {model}: config parameter {key!r} is {twice}")
            given[key] = written
            if text == "":
                continue  # an empty value keeps the default
            values[key] = typed_value(declared[key], text, model)
            if renamed and renamed.per != 1:
                values[key] /= renamed.per
        if values.get("engine_stall_s", 1.0) <= 0:
            raise ValueError(f"model {model}: config parameter 'engine_stall_s' must be > 0")
        at_least = {
            "max_rows_per_call": 1,
            "max_running": 1,
            "admission_cohort": 1,
            "admission_max_wait_steps": 0,
            "deadline_room": 0,
        }
        for key, least in at_least.items():
            if values.get(key) is not None and values[key] < least:
                raise ValueError(f"model {model}: config parameter {key!r} must be >= {least}")
        if values.get("checkpoint_every_steps") and not values.get("checkpoint_dir"):
            raise ValueError(
                f"model {model}: config parameter 'checkpoint_every_steps' needs 'checkpoint_dir'"
            )
        config = cls(**values)
        for name in ("degrade_tiers", "degrade_step_cache"):
            unknown = sorted(set(getattr(config, name) or ()) - set(config.service_tiers))
            if unknown:
                raise ValueError(
                    f"model {model}: config parameter {name!r} names {', '.join(unknown)}, not among "
                    f"service_tiers ({', '.join(config.service_tiers)})"
                )
        if config.default_service_tier not in config.service_tiers:
            raise ValueError(
                f"model {model}: config parameter 'default_service_tier' must be one of "
                f"{', '.join(config.service_tiers)} (service_tiers), got {config.default_service_tier!r}"
            )
        return config


# The Python backend's own config.pbtxt parameters (its README): read by the backend, not by us.
BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS")


def config_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: "k" value: { string_value: "v" } }`` as a plain dict, without the Python
    backend's own (BACKEND_PARAMETERS)."""
    parameters = model_config.get("parameters", {})
    forced = parameters.get("FORCE_CPU_ONLY_INPUT_TENSORS", {}).get("string_value", "yes")
    if forced.lower() != "yes":  # inputs on a GPU: our parsing reads every input as numpy
        raise ValueError(f"config parameter FORCE_CPU_ONLY_INPUT_TENSORS: got {forced!r} (allowed: yes)")
    return {k: v["string_value"] for k, v in parameters.items() if k not in BACKEND_PARAMETERS}


@dataclass(frozen=True)
class ModelSettings:
    name: str
    model_dir: Path  # the model's folder inside the model repository
    config: ModelConfig
    field_params: dict[str, str]  # default_<field>, max_<field>, ...: for FieldSet.configured
    max_batch_size: int
    instance_kind: str  # "CPU", "GPU" or "MODEL"
    device_id: int
    kinds: tuple[str, ...] = (IMAGE,)  # the model kinds it was read for (LM: the diffusion LM's defaults)
    instance: str = ""  # this model instance's name (Triton's model_instance_name; its drain mark)

    @classmethod
    def from_triton_args(
        cls, args: Mapping[str, str], kinds: Iterable[str] = ALL, request_fields: Iterable[str] = ()
    ) -> ModelSettings:
        model_config = json.loads(args["model_config"])
        name = args["model_name"]
        params = config_parameters(model_config)
        request_fields, kinds = list(request_fields), tuple(kinds)
        field_keys = {form.format(f) for f in request_fields for form in FIELD_PARAMETER_FORMS}
        return cls(
            name=name,
            model_dir=Path(args["model_repository"]),
            config=ModelConfig.parse(params, kinds, request_fields, name),
            field_params={k: v for k, v in params.items() if k in field_keys},
            max_batch_size=int(model_config.get("max_batch_size", 0)),
            instance_kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id", 0)),
            instance=args.get("model_instance_name", ""),
            kinds=kinds,
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

    def resolved(self, name: str, engine: str = "step") -> Any:
        """Parameter ``name`` for this model on ``engine`` (step or request): config.pbtxt's value, else
        its declared derived default (:class:`Derived`, the diffusion LM's where this is one), capped by
        the declaration's ``at_most``. Derived defaults are computed here only."""
        if engine not in ("step", "request"):
            raise ValueError(f"engine must be step or request, got {engine!r}")
        value = getattr(self.config, name)
        derived: Derived | None = _DECLARED[name].metadata["derived"]
        if derived is None:
            return value
        names = _Resolving(self, engine)
        if value is None:
            value = _evaluate(derived.expression(LM if LM in self.kinds else engine), names)
        if derived.at_most is not None:
            value = min(value, _evaluate(derived.at_most, names))
        return value

    def max_rows_per_call(self) -> int:
        return self.resolved("max_rows_per_call")


_DECLARED = {f.name: f for f in fields(ModelConfig)}


class _Resolving(Mapping[str, Any]):
    """The names a :class:`Derived` expression may read: ``max_batch_size`` and every parameter, each
    resolved for the same engine."""

    def __init__(self, settings: ModelSettings, engine: str) -> None:
        self.settings, self.engine = settings, engine

    def __getitem__(self, name: str) -> Any:
        if name == "max_batch_size":
            return self.settings.max_batch_size
        if name not in _DECLARED:
            raise KeyError(name)
        return self.settings.resolved(name, self.engine)

    def __iter__(self):
        return iter(["max_batch_size", *_DECLARED])

    def __len__(self) -> int:
        return len(_DECLARED) + 1


def _evaluate(expression: str, names: Mapping[str, Any]) -> Any:
    """A :class:`Derived` expression (written in this module, never read from a config)."""
    return eval(expression, {"__builtins__": {}, "max": max, "min": min}, names)  # noqa: S307
