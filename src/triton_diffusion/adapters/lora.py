"""Per-request LoRA adapters, different adapters mixed in one forward.

Adapters are loaded once, at model load, from the config's ``loras`` (``{"name": "path"}``, paths relative
to the model's folder, safetensors only) through diffusers' own ``load_lora_weights``, so every format
diffusers converts (its own, kohya/A1111) is read as diffusers reads it, and the adapters stay unmerged:
peft wraps each adapted layer as ``base(x) + scale * B(A(x))`` per adapter.

What changes is who decides which rows get which adapter. peft applies its *active* adapters to every row
of a batch; here each adapted layer's forward is replaced by :meth:`LoraBank.forward`, which runs the base
layer once for all rows and then, per distinct adapter in the forward, ``B(A(x))`` over just the rows that
asked for it, times each row's own scale (the S-LoRA/Punica idea in plain torch). What rows ask for is set
around each model call: :meth:`LoraBank.rows` (one adapter set per model row: the step engine's forward)
or :meth:`LoraBank.uniform` (one set for every row: a text-encoder call, a request-level fused call).
With several adapters in one forward a linear layer stacks them: every adapter's A over every row in one
matmul, each row's scale on its own adapters' rank columns, every B in one more.
Without a plan a layer is its base layer, so no request can change another's result.

The scale is computed as peft's ``set_scale`` does (``weight * lora_alpha / r``) and applied in float32
(rounded once, as peft's multiply by a Python float), so a row's output equals diffusers'
``set_adapters(names, adapter_weights)`` + ``pipe(...)`` to batch rounding: bit for bit where every row
has one adapter set, to <= 1 uint8 on CPU fp32 with the stacked path (tests/unit/test_lora.py); in bf16 the
stacked path rounds the low-rank product once more (not measured on a GPU yet).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from triton_diffusion.errors import invalid_field

log = logging.getLogger("triton_diffusion")

# A request's adapters: (name, scale) pairs, in the order the request named them.
LoraSet = tuple[tuple[str, float], ...]
NO_LORA: LoraSet = ()


@dataclass(frozen=True)
class LoraLimits:
    names: tuple[str, ...]  # the configured adapters, the only ones a request may name
    max_scale: float
    max_per_request: int


def parse_lora(text: str | None, limits: LoraLimits) -> LoraSet:
    """The request field ``lora``: ``"name"`` or ``"name:scale,other:scale"`` (scale default 1).
    Raises INVALID_ARG naming ``lora`` and what is allowed."""
    if text is None or not text.strip():
        return NO_LORA
    allowed = f"allowed names: {', '.join(limits.names) or 'none configured'}"
    items: list[tuple[str, float]] = []
    for item in text.split(","):
        name, colon, scale_text = item.strip().partition(":")
        name = name.strip()
        if name not in limits.names:
            raise invalid_field("lora", f"names an unknown adapter {name[:64]!r} ({allowed})")
        scale = 1.0
        if colon:
            try:
                scale = float(scale_text)
            except ValueError:
                raise invalid_field(
                    "lora", f"scale {scale_text[:32]!r} of {name!r} is not a number (as in 'name:0.8')"
                ) from None
            if not math.isfinite(scale) or abs(scale) > limits.max_scale:
                raise invalid_field(
                    "lora",
                    f"scale {scale_text[:32]!r} of {name!r} is outside "
                    f"-{limits.max_scale:g}..{limits.max_scale:g}",
                )
        if any(name == seen for seen, _ in items):
            raise invalid_field("lora", f"names {name!r} twice")
        items.append((name, scale))
    if len(items) > limits.max_per_request:
        raise invalid_field(
            "lora", f"names {len(items)} adapters (allowed: at most {limits.max_per_request})"
        )
    return tuple(items)


def lora_text(adapters: LoraSet) -> str:
    """The canonical form (the compatibility key, BATCH, logs): ``name:scale,...``, exact (repr)."""
    return ",".join(f"{name}:{scale!r}" for name, scale in adapters)


def lora_set(text: str | None) -> LoraSet:
    """A canonical text (:func:`lora_text`, already validated) back into its adapters."""
    if not text:
        return NO_LORA
    pairs = (item.rpartition(":") for item in text.split(","))
    return tuple((name, float(scale)) for name, _, scale in pairs)


# ---- loading ----------------------------------------------------------------------------------------------
def lora_file(model_dir: Path, name: str, path: str) -> Path:
    """The adapter's ``.safetensors`` file: the path itself, or the one in the folder it names
    (``pytorch_lora_weights.safetensors`` first). Pickled weights (``.bin``, ``.pt``, ``.ckpt``): refused."""
    location = Path(path).expanduser()
    if not location.is_absolute():
        location = model_dir / location
    if location.is_dir():
        candidates = sorted(location.glob("*.safetensors"))
        preferred = location / "pytorch_lora_weights.safetensors"
        if preferred.is_file():
            return preferred
        if len(candidates) == 1:
            return candidates[0]
        others = sorted(p.name for p in location.iterdir() if p.is_file() and not p.name.startswith("."))
        raise ValueError(
            f"LoRA {name!r}: {location} holds {len(candidates)} .safetensors files (need one; safetensors "
            f"only, found {others[:8]})"
        )
    if location.suffix != ".safetensors":
        raise ValueError(f"LoRA {name!r}: {location} is not a .safetensors file (safetensors only)")
    if not location.is_file():
        raise ValueError(f"LoRA {name!r}: {location} does not exist")
    return location


def load_loras(pipe: Any, model_dir: Path, paths: Mapping[str, str], model: str) -> LoraBank | None:
    """Load every configured adapter into ``pipe`` (unmerged) and take over its adapted layers."""
    if not paths:
        return None
    if not hasattr(pipe, "load_lora_weights"):
        raise ValueError(f"model {model}: {type(pipe).__name__} does not take LoRA adapters (config 'loras')")
    for name, path in paths.items():
        file = lora_file(model_dir, name, path)
        try:
            pipe.load_lora_weights(
                str(file.parent), weight_name=file.name, adapter_name=name, use_safetensors=True
            )
        except Exception as exc:  # noqa: BLE001  (any load error is a config error naming the adapter)
            detail = str(exc) if len(str(exc)) < 800 else str(exc)[:800] + " ..."  # names the first layers
            message = f"model {model}: LoRA {name!r} ({file}) does not fit the model: {detail}"
            raise ValueError(message) from None
        log.info("model %s: LoRA %r loaded from %s", model, name, file)
    return LoraBank(pipe, tuple(paths))


# ---- mixing adapters per row ------------------------------------------------------------------------
@dataclass(frozen=True)
class _LayerAdapters:
    """What an adapted layer holds, read once at load: the configured adapters it has (configured order),
    and each one's peft scaling as ``weight * alpha / divisor`` (divisor r, or sqrt(r) with rslora)."""

    names: tuple[str, ...]
    alphas: tuple[float, ...]
    divisors: tuple[float, ...]
    ranks: tuple[int, ...]

    def scales(self, j: int, weights: Sequence[float]) -> torch.Tensor:
        """float32 scales of adapter ``j`` for these weights, each computed as peft's ``set_scale`` does."""
        return torch.tensor([w * self.alphas[j] / self.divisors[j] for w in weights], dtype=torch.float32)


@dataclass
class _Gather:
    """One adapter over some rows of a layer kind: its rows (None: all) and their float32 scales."""

    name: str
    rows: torch.Tensor | None
    scales: torch.Tensor


@dataclass
class _Stack:
    """Several adapters in a layer kind: each row's scale on each adapter's rank columns (0: not named)."""

    names: tuple[str, ...]
    columns: torch.Tensor  # [rows, sum of ranks], float32


@dataclass
class _Plan:
    rows: int | None  # model rows the call must have (None: one adapter set for every row, any batch)
    uniform: LoraSet = NO_LORA  # rows None: the adapters of every row, in the request's order
    by_kind: dict[_LayerAdapters, _Gather | _Stack] = field(default_factory=dict)


class LoraBank:
    """The model's adapters and the layers they adapt; decides per call which rows get which."""

    def __init__(self, pipe: Any, names: tuple[str, ...]) -> None:
        from peft.tuners.lora.layer import Conv2d, Linear, LoraLayer

        self.names = names
        self._plan: _Plan | None = None
        # One stacked copy per layer, of the last adapter combination it served (steady traffic repeats
        # it from step to step); bounded by one copy of the loaded adapters.
        self._stacks: dict[int, tuple[tuple[str, ...], torch.Tensor, torch.Tensor]] = {}
        self.kinds: set[_LayerAdapters] = set()  # distinct layer kinds: usually one per component
        self.layers = 0
        self.text_encoder_layers = 0
        for component, module in pipe.components.items():
            if not isinstance(module, torch.nn.Module):
                continue
            for layer_name, layer in module.named_modules():
                if not isinstance(layer, LoraLayer):
                    continue
                where = f"LoRA layer {component}.{layer_name}"
                if any(getattr(layer, "lora_bias", {}).values()):
                    raise ValueError(f"{where}: adapters with a bias are not served")
                if any(getattr(layer, "use_dora", {}).values()) or any(
                    getattr(layer, "lora_variant", {}).values()
                ):
                    raise ValueError(f"{where}: DoRA and other LoRA variants are not served")
                if not isinstance(layer, (Linear, Conv2d)):
                    raise ValueError(
                        f"{where} is a {type(layer).__name__}: only Linear and Conv2d are mixed per row"
                    )
                kind = self._kind_of(layer)
                self.kinds.add(kind)
                # The one layer's forward, as torch patches a module instance (mypy: a method).
                layer.forward = self._forward_of(layer, kind)  # type: ignore[method-assign]
                self.layers += 1
                if component.startswith("text_encoder"):
                    self.text_encoder_layers += 1
        log.info(
            "LoRA: %d adapters over %d layers (%d in text encoders)",
            len(names),
            self.layers,
            self.text_encoder_layers,
        )

    def _kind_of(self, layer: Any) -> _LayerAdapters:
        present = [n for n in self.names if n in layer.lora_A]
        divisors = [
            math.sqrt(layer.r[n]) if layer.use_rslora.get(n, False) else float(layer.r[n]) for n in present
        ]
        return _LayerAdapters(
            tuple(present),
            tuple(float(layer.lora_alpha[n]) for n in present),
            tuple(divisors),
            tuple(int(layer.r[n]) for n in present),
        )

    @contextlib.contextmanager
    def rows(
        self, adapters_per_row: Sequence[LoraSet], to_device: Callable[[torch.Tensor], torch.Tensor]
    ) -> Iterator[None]:
        """Around one model call whose batch rows are ``adapters_per_row`` (in order)."""
        with self.planned(self.plan_for(adapters_per_row, to_device)):
            yield

    def plan_for(
        self, adapters_per_row: Sequence[LoraSet], to_device: Callable[[torch.Tensor], torch.Tensor]
    ) -> _Plan | None:
        """What the layers need for a call whose batch rows are ``adapters_per_row``: built here on the
        host and sent once (``to_device``: without a sync); a step cache reuses it for every block."""
        first = adapters_per_row[0] if adapters_per_row else NO_LORA
        if all(adapters == first for adapters in adapters_per_row):
            return _Plan(None, first) if first else None  # every row alike: peft's own arithmetic
        count = len(adapters_per_row)
        by_name: dict[str, tuple[list[int], list[float]]] = {n: ([], []) for n in self.names}
        for row, adapters in enumerate(adapters_per_row):
            for name, weight in adapters:
                by_name[name][0].append(row)
                by_name[name][1].append(weight)
        plan = _Plan(count)
        for kind in self.kinds:
            used = [j for j, name in enumerate(kind.names) if by_name[name][0]]
            if len(used) == 1:  # one adapter: gathered over its rows
                j = used[0]
                rows, weights = by_name[kind.names[j]]
                index = None if len(rows) == count else to_device(torch.tensor(rows))
                plan.by_kind[kind] = _Gather(kind.names[j], index, to_device(kind.scales(j, weights)))
            elif used:  # several: stacked (see _forward_of)
                blocks = []
                for j in used:
                    rows, weights = by_name[kind.names[j]]
                    per_row = torch.zeros(count, dtype=torch.float32)
                    per_row[rows] = kind.scales(j, weights)
                    blocks.append(per_row[:, None].expand(count, kind.ranks[j]))
                names = tuple(kind.names[j] for j in used)
                plan.by_kind[kind] = _Stack(names, to_device(torch.cat(blocks, dim=1)))
        return plan

    def subsets(
        self, adapters_per_row: Sequence[LoraSet], to_device: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[list[int]], contextlib.AbstractContextManager]:
        """Around a call over some rows of a forward whose rows are ``adapters_per_row`` (a step cache's
        block over the rows that compute): each subset's plan is built once per forward, though every
        block runs under it."""
        plans: dict[tuple[int, ...], _Plan | None] = {}

        def subset(rows: list[int]) -> contextlib.AbstractContextManager:
            key = tuple(rows)
            if key not in plans:
                plans[key] = self.plan_for([adapters_per_row[r] for r in key], to_device)
            return self.planned(plans[key])

        return subset

    @contextlib.contextmanager
    def uniform(self, adapters: LoraSet) -> Iterator[None]:
        """Around a call in which every row has ``adapters`` (text encoding, a request-level call)."""
        with self.planned(_Plan(None, adapters) if adapters else None):
            yield

    @contextlib.contextmanager
    def planned(self, plan: _Plan | None) -> Iterator[None]:
        """Around a call the layers run under ``plan`` (from ``plan_for``)."""
        previous, self._plan = self._plan, plan
        try:
            yield
        finally:
            self._plan = previous

    def _stacked(self, layer: Any, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's A factors of ``names`` stacked [sum r, in], its B factors side by side [out, sum r]."""
        cached = self._stacks.get(id(layer))
        if cached is None or cached[0] != names:
            stacked_a = torch.cat([layer.lora_A[n].weight for n in names])
            stacked_b = torch.cat([layer.lora_B[n].weight for n in names], dim=1)
            cached = (names, stacked_a, stacked_b)
            self._stacks[id(layer)] = cached
        return cached[1], cached[2]

    def _forward_of(self, layer: Any, kind: _LayerAdapters) -> Callable[..., torch.Tensor]:
        base = layer.base_layer
        stackable = isinstance(base, torch.nn.Linear)

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = base(x, *args, **kwargs)
            plan = self._plan
            if plan is None:
                return result
            dtype = result.dtype
            if plan.rows is None:  # one adapter set for every row: exactly peft's forward
                for name, weight in plan.uniform:
                    if name in layer.lora_A:
                        j = kind.names.index(name)
                        inputs = x.to(layer.lora_A[name].weight.dtype)
                        scale = weight * kind.alphas[j] / kind.divisors[j]
                        result = result + layer.lora_B[name](layer.lora_A[name](inputs)) * scale
                return result.to(dtype)
            work = plan.by_kind.get(kind)
            if work is None:
                return result
            if x.shape[0] != plan.rows:  # a layer over packed tokens (Z-Image's embedders), not rows
                raise RuntimeError(
                    f"LoRA: a layer saw {x.shape[0]} rows where the call has {plan.rows}: adapters on this "
                    "layer cannot differ per row"
                )
            if isinstance(work, _Stack) and stackable:
                # Several adapters over different rows: every adapter's A for every row in one matmul,
                # each row's scale on its own adapters' rank columns (0 elsewhere), every B in one more:
                # two matmuls whatever the number of adapters, instead of a gather and two per adapter.
                stacked_a, stacked_b = self._stacked(layer, work.names)
                low = torch.nn.functional.linear(x.to(stacked_a.dtype), stacked_a)
                shape = (work.columns.shape[0], *([1] * (low.dim() - 2)), work.columns.shape[1])
                low = (low * work.columns.reshape(shape)).to(low.dtype)  # float32 scales, rounded once
                return (result + torch.nn.functional.linear(low, stacked_b)).to(dtype)
            gathers = (
                [work]
                if isinstance(work, _Gather)
                else [
                    _Gather(n, None, work.columns[:, sum(kind.ranks[: kind.names.index(n)])])
                    for n in work.names
                ]
            )
            for gather in gathers:  # one adapter over its rows (or a Conv2d layer's adapters one by one)
                lora_a, lora_b = layer.lora_A[gather.name], layer.lora_B[gather.name]
                inputs = x.to(lora_a.weight.dtype)
                if gather.rows is not None:
                    inputs = inputs.index_select(0, gather.rows)
                delta = lora_b(lora_a(inputs))
                # float32 scales: the product rounds once, as peft's multiply by a Python float does
                delta = (delta * gather.scales.reshape(-1, *([1] * (delta.dim() - 1)))).to(result.dtype)
                result = result + delta if gather.rows is None else result.index_add(0, gather.rows, delta)
            return result.to(dtype)

        return forward
