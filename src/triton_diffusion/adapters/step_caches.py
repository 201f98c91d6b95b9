"""Step caches per request inside one batched forward: First Block Cache and TaylorSeer, each job deciding
for itself at each of its own steps, so a request's image is what diffusers' own cache gives it alone.

diffusers' hooks (``hooks/first_block_cache.py``, ``hooks/taylorseer_cache.py``) keep one state per
denoiser call (per ``cache_context``) and decide once for the whole batch: FBC compares the mean change of
the *batch's* first-block residual with the threshold, so a request's output depends on its batch-mates.
Here the same arithmetic runs per *branch*.

**One semantic, both engines: a cache state per CFG branch.** A pipeline that calls the denoiser once per
classifier-free-guidance branch keeps one cache state per branch, as ``FluxPipeline`` names them: each
step's first call (the prompt's) is the "cond" branch, its second (true CFG's negative prompt) the
"uncond" branch, each deciding and predicting from its own history. That holds for every such pipeline,
whether its ``__call__`` names its calls (``transformer.cache_context("cond")`` / ``("uncond")``:
FluxPipeline, Qwen-Image, Wan) or not (FluxImg2ImgPipeline, FluxInpaintPipeline, which under diffusers'
``enable_cache`` alone raise "No cache context is set"). A pipeline that batches its branches into one
call (SD3, PixArt) has one branch: its rows decide together, as diffusers decides over that call.

- The step engine: a guided job of a family that calls per branch (``cache_per_branch``: FLUX.1 in every
  start, text, img2img and inpainting; Wan) holds [uncond, cond] states, each row its own :class:`Slot`.
- The request-level engine: diffusers' own cache on a call of its own (``adapters/call_caches.py``),
  which names the calls of a pipeline whose ``__call__`` names none.

The methods:

- **First Block Cache** (``fbc:THRESHOLD``): the first block runs for every row; each FBC branch compares
  its residual with the one of its last computed step (``mean |r - r_prev| / mean |r_prev|``); a branch at
  or under its threshold reuses its cached residual of the other blocks (its rows skip them: every later
  block runs on the rows that compute, gathered); one over it computes, and its residuals are kept.
- **TaylorSeer** (``taylorseer:INTERVAL[:WARMUP]``): every attention module diffusers' hook matches is run
  for the rows whose branch computes at this step (warm-up steps, then every INTERVAL-th), its outputs kept
  as Taylor factors (first order, in bfloat16, as diffusers' defaults); the rows of a branch that predicts
  get the factors' prediction instead.

Rows with different methods, thresholds, steps and none share one forward. Cache state lives in each job
(:class:`CacheState`, in ``LatentJob.cache``), so a paused job keeps it and a failed job takes it along.
A forward changes no state until it returned: the updates of a forward (a TaylorSeer module's first
factors included) are staged and applied by :meth:`RowCaches.commit`, so the engine's retry of a failed
forward decides the same way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from triton_diffusion.adapters.devices import to_device
from triton_diffusion.adapters.diffusers_compat import BlockLayout, registered_block_layout
from triton_diffusion.adapters.taylor_factors import TaylorFactors, taylor_predict, taylor_update
from triton_diffusion.step_cache_spec import StepCache

# The per-row arguments of a transformer block or attention module (their first dimension is the batch):
# gathered for the rows that run. Everything else (rotary embeddings, kwargs dicts) is shared by the rows.
PER_ROW_ARGUMENTS = frozenset(
    {
        "hidden_states",
        "encoder_hidden_states",
        "temb",
        "timestep",
        "attention_mask",
        "encoder_attention_mask",
        "encoder_hidden_states_mask",
    }
)


# ---- a job's state ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class FbcBranch:
    """One branch's First Block Cache: the first block's residual and the other blocks' residuals at the
    branch's last computed step."""

    threshold: float
    head_residual: torch.Tensor | None = None
    tail_residuals: tuple[torch.Tensor, torch.Tensor | None] | None = None


@dataclass(eq=False)
class TaylorBranch:
    """One branch's TaylorSeer: its step (the denoiser calls it took part in) and each module's factors."""

    interval: int
    warmup: int
    step: int = -1
    modules: dict[int, TaylorFactors] = field(default_factory=dict)

    def computes(self, step: int) -> bool:
        """diffusers' ``_measure_should_compute`` at ``step`` (0-based): warm-up, then every interval."""
        return step < self.warmup or (step - self.warmup - 1) % self.interval == 0


Branch = FbcBranch | TaylorBranch
B = TypeVar("B", FbcBranch, TaylorBranch)


@dataclass(eq=False)
class CacheState:
    """A job's step cache: one branch, or [uncond, cond] where the pipeline calls the denoiser per CFG
    branch (each under its own cache_context)."""

    spec: StepCache
    branches: list[Branch]


def new_cache_state(spec: StepCache, branches: int) -> CacheState | None:
    if not spec:
        return None
    if spec.method == "fbc":
        return CacheState(spec, [FbcBranch(spec.threshold) for _ in range(branches)])
    return CacheState(spec, [TaylorBranch(spec.interval, spec.warmup) for _ in range(branches)])


# ---- one forward -----------------------------------------------------------------------------------------
@dataclass(eq=False)
class Slot(Generic[B]):
    """A branch in this forward: its model rows."""

    branch: B
    rows: list[int]
    computes: bool = True  # decided before the forward (TaylorSeer) or by the first block (FBC)


@dataclass(eq=False)
class CachePlan:
    """The cached branches of one forward over ``rows`` model rows, and what the forward stages."""

    rows: int
    slots: list[Slot[Any]]
    states: list[CacheState]  # the jobs' states the slots' branches belong to
    subset: Callable[[list[int]], contextlib.AbstractContextManager] = contextlib.nullcontext
    active: list[int] = field(default_factory=list)  # the model rows of the module call under way
    skipped: set[int] = field(default_factory=set)  # rows whose FBC branch reuses: they skip the blocks
    running: list[int] = field(default_factory=list)  # ... and the rows that run them
    head: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the first block's output (all rows)
    # The input of the first block after the head (every row): the blocks between run on the rows that
    # compute alone, gathered once, and the last block's output goes back into it.
    full: tuple[torch.Tensor, torch.Tensor | None] | None = None
    staged: list[Callable[[], None]] = field(default_factory=list)
    fbc: list[Slot[FbcBranch]] = field(init=False)
    taylor: list[Slot[TaylorBranch]] = field(init=False)
    indices: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # built once per forward

    def index(self, rows: list[int], device: Any) -> torch.Tensor:
        """The rows as an index tensor on ``device``: sent once per forward, not once per block."""
        key = tuple(rows)
        index = self.indices.get(key)
        if index is None:
            index = self.indices[key] = to_device(torch.tensor(rows), device)  # no sync mid-forward
        return index

    def __post_init__(self) -> None:
        self.active = list(range(self.rows))
        # Sorted once per forward: every hooked block and attention module reads these.
        self.fbc = [s for s in self.slots if isinstance(s.branch, FbcBranch)]
        self.taylor = [s for s in self.slots if isinstance(s.branch, TaylorBranch)]
        for slot in self.taylor:
            slot.computes = slot.branch.computes(slot.branch.step + 1)


# The denoiser's ModuleLists whose blocks diffusers' First Block Cache chains, and the module names its
# TaylorSeer caches by default (re.fullmatch): private constants there, so spelled here (and tested).
_TAYLOR_LISTS = ("blocks", "transformer_blocks", "single_transformer_blocks", "temporal_transformer_blocks")
BLOCK_LISTS = frozenset({*_TAYLOR_LISTS, "layers", "visual_transformer_blocks"})
TAYLOR_MODULES = tuple(f"^{name}.*attn" for name in _TAYLOR_LISTS)
HOOK_PREFIX = "triton_diffusion_step_cache_"  # the names of RowCaches' hooks in diffusers' HookRegistry
_INSTALLS = itertools.count()


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks diffusers' First Block Cache hooks, in its order (head first, tail last)."""
    return [
        block
        for name, child in transformer.named_children()
        if name in BLOCK_LISTS and isinstance(child, torch.nn.ModuleList)
        for block in child
    ]


def _attention_modules(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules diffusers' TaylorSeer hooks by default (its attention patterns), in its order."""
    return [
        module
        for name, module in transformer.named_modules()
        if any(re.fullmatch(pattern, name) for pattern in TAYLOR_MODULES)
    ]


_LAYOUTS: dict[type, BlockLayout | None] = {}


def block_layout(block_class: type) -> BlockLayout | None:
    """``block_class``'s layout as diffusers' First Block Cache reads it; None for a class it has none of
    (it refuses such a model: Sana's blocks). Read through diffusers_compat (no public form)."""
    if block_class not in _LAYOUTS:
        _LAYOUTS[block_class] = registered_block_layout(block_class)
    return _LAYOUTS[block_class]


def servable(transformer: torch.nn.Module, methods: Sequence[str]) -> tuple[str, ...]:
    """Of a family's ``methods`` (those its tests check against diffusers), the ones diffusers' own hooks
    apply to this transformer: FBC needs two blocks of classes with a :func:`block_layout` (not Sana's),
    TaylorSeer an attention module its patterns match (not PixArt's ``attn1``: there it would do nothing)."""
    served = []
    blocks = _blocks(transformer)
    if "fbc" in methods and len(blocks) >= 2 and all(block_layout(type(b)) for b in blocks):
        served.append("fbc")
    if "taylorseer" in methods and _attention_modules(transformer):
        served.append("taylorseer")
    return tuple(served)


class RowCaches:
    """The hooks on a transformer's blocks (FBC) and attention modules (TaylorSeer), installed once at
    load for the ``methods`` it serves (:func:`servable`): without a plan (a forward with no cached row)
    each is its module's own forward."""

    def __init__(self, transformer: torch.nn.Module, methods: Sequence[str]) -> None:
        from diffusers.hooks import HookRegistry

        self.methods = tuple(methods)
        self._plan: CachePlan | None = None
        # Hooks in each module's HookRegistry: other diffusers hooks on it (offloading's, a cache's) stay in
        # the chain. Names of its own: a second RowCaches on the same modules stacks (tests make two).
        name = f"{HOOK_PREFIX}{next(_INSTALLS)}"
        hooked: list[tuple[torch.nn.Module, Callable]] = []
        if "fbc" in self.methods:
            blocks = _blocks(transformer)
            layouts = {type(b): block_layout(type(b)) for b in blocks}
            self._layouts = {cls: layout for cls, layout in layouts.items() if layout is not None}  # servable
            roles = [self._head_forward, *[self._block_forward] * (len(blocks) - 2), self._tail_forward]
            hooked += zip(blocks, roles, strict=True)
        if "taylorseer" in self.methods:
            hooked += [(m, self._taylor_forward(i)) for i, m in enumerate(_attention_modules(transformer))]
        for module, forward in hooked:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(_hook_class()(forward), name)
        # diffusers caches which submodules carry registries (for its cache contexts): new ones stale it.
        # (Older diffusers keep no such cache and have no such method.)
        invalidate = getattr(
            HookRegistry.check_if_exists_or_initialize(transformer), "invalidate_child_registries_cache", None
        )
        if invalidate is not None:
            invalidate()

    @contextlib.contextmanager
    def running(self, plan: CachePlan | None) -> Iterator[None]:
        previous, self._plan = self._plan, plan
        try:
            yield
        finally:
            self._plan = previous

    @staticmethod
    def commit(plan: CachePlan) -> None:
        """The forward returned: its staged updates become the branches' state."""
        for update in plan.staged:
            update()
        for slot in plan.taylor:
            slot.branch.step += 1

    # ---- First Block Cache -------------------------------------------------------------------------------
    def _head_forward(self, original: Callable, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        output = original(*args, **kwargs)
        plan = self._plan
        if plan is None or not plan.fbc:
            return output
        layout = self._layouts[type(module)]
        hidden_in = _argument(module, layout.hidden_argument, args, kwargs)
        hidden, encoder = _split(output, layout)
        residual = hidden - hidden_in
        judged = [slot for slot in plan.fbc if slot.branch.head_residual is not None]
        if judged:  # diffusers' _should_compute_remaining_blocks per branch, one host sync for all
            changes = []
            for slot in judged:
                previous = slot.branch.head_residual
                assert previous is not None
                change = (_rows(residual, slot.rows) - previous).abs().mean()
                changes.append(change / previous.abs().mean())
            values = torch.stack(changes).tolist()
            for slot, value in zip(judged, values, strict=True):
                slot.computes = value > slot.branch.threshold
        plan.head = (hidden, encoder)
        reusing = [slot for slot in plan.fbc if not slot.computes]
        for slot in plan.fbc:
            if slot.computes:
                plan.staged.append(_setter(slot.branch, "head_residual", _rows(residual, slot.rows).clone()))
        if not reusing:
            return output
        # A reusing branch's rows are final now: this step's first block plus its cached residual of the
        # other blocks (diffusers returns this from the first block and skips the rest).
        hidden, encoder = hidden.clone(), None if encoder is None else encoder.clone()
        for slot in reusing:
            assert slot.branch.tail_residuals is not None  # it reuses: it computed before
            cached_hidden, cached_encoder = slot.branch.tail_residuals
            index = plan.index(slot.rows, hidden.device)
            hidden.index_copy_(0, index, cached_hidden + hidden.index_select(0, index))
            if encoder is not None and cached_encoder is not None:
                encoder.index_copy_(0, index, cached_encoder + encoder.index_select(0, index))
            plan.skipped.update(slot.rows)
        plan.running = [row for row in range(plan.rows) if row not in plan.skipped]
        return _join(output, layout, hidden, encoder)

    def _block_forward(self, original: Callable, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        plan = self._plan
        if plan is None or not plan.skipped:
            return original(*args, **kwargs)
        return self._on_rows(original, module, args, kwargs, plan, last=False)

    def _tail_forward(self, original: Callable, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        plan = self._plan
        if plan is None or not plan.fbc:
            return original(*args, **kwargs)
        output = (
            self._on_rows(original, module, args, kwargs, plan, last=True)
            if plan.skipped
            else original(*args, **kwargs)
        )
        layout = self._layouts[type(module)]
        hidden, encoder = _split(output, layout)
        assert plan.head is not None  # the head block ran first
        head_hidden, head_encoder = plan.head
        for slot in plan.fbc:
            if slot.computes:
                tail = _rows(hidden, slot.rows) - _rows(head_hidden, slot.rows)
                tail_encoder = None
                if encoder is not None and head_encoder is not None:
                    tail_encoder = _rows(encoder, slot.rows) - _rows(head_encoder, slot.rows)
                plan.staged.append(_setter(slot.branch, "tail_residuals", (tail, tail_encoder)))
        return output

    def _on_rows(
        self,
        original: Callable,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        plan: CachePlan,
        last: bool,
    ) -> Any:
        """A block after the head over the rows that compute; the skipped rows pass through unchanged.
        The first such block gathers the computing rows' states once; the blocks between pass them on
        gathered (only per-row inputs such as ``temb`` are gathered again); the last puts them back."""
        layout = self._layouts[type(module)]
        bound = _bound(module, args, kwargs)
        hidden_in = bound[layout.hidden_argument]
        encoder_in = None
        if layout.encoder_index is not None:
            encoder_in = bound[layout.encoder_argument]
        running = plan.running
        if not running:  # every row reuses: the block does not run
            return _join(None, layout, hidden_in, encoder_in)
        if plan.full is None:
            plan.full = (hidden_in, encoder_in)
        index = plan.index(running, hidden_in.device)
        gathered = _gather(bound, index, plan.rows)  # arguments of every row; gathered ones stay
        with self._rows_active(plan, running):
            output = original(**gathered)
        if not last:
            return output
        hidden, encoder = _split(output, layout)
        full_hidden, full_encoder = plan.full
        hidden = full_hidden.index_copy(0, index, hidden)
        if encoder is not None and full_encoder is not None:
            encoder = full_encoder.index_copy(0, index, encoder)
        return _join(output, layout, hidden, encoder)

    @contextlib.contextmanager
    def _rows_active(self, plan: CachePlan, rows: list[int]) -> Iterator[None]:
        previous, plan.active = plan.active, rows
        try:
            with plan.subset(rows):
                yield
        finally:
            plan.active = previous

    # ---- TaylorSeer -------------------------------------------------------------------------------------
    def _taylor_forward(self, index: int) -> Callable:
        def forward(original: Callable, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
            plan = self._plan
            if plan is None or not plan.taylor:
                return original(*args, **kwargs)
            return self._taylor_rows(index, original, module, args, kwargs, plan)

        return forward

    def _taylor_rows(
        self,
        index: int,
        original: Callable,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        plan: CachePlan,
    ) -> Any:
        active = plan.active
        position = {row: i for i, row in enumerate(active)}
        slots = [s for s in plan.taylor if s.rows[0] in position]
        predicting = [s for s in slots if not s.computes]
        predicted_rows = {position[row] for s in predicting for row in s.rows}
        running = [i for i in range(len(active)) if i not in predicted_rows]
        outputs: tuple[torch.Tensor, ...] | None = None
        single = False
        if running:
            if predicting:  # the computing rows alone, with their own LoRA adapters
                bound = _bound(module, args, kwargs)
                rows = [active[i] for i in running]
                gather = plan.index(running, _device_of(bound))
                with self._rows_active(plan, rows):
                    computed = original(**_gather(bound, gather, len(active)))
            else:
                computed = original(*args, **kwargs)
            single = isinstance(computed, torch.Tensor)
            outputs = (computed,) if single else tuple(computed)
            local = {i: k for k, i in enumerate(running)}
            for slot in slots:
                if slot.computes:
                    rows = [local[position[row]] for row in slot.rows]
                    step = slot.branch.step + 1
                    modules = slot.branch.modules  # a new module's state joins the job's at commit
                    state = modules.get(index) or TaylorFactors()
                    plan.staged.append(taylor_update(state, tuple(_rows(o, rows) for o in outputs), step))
                    plan.staged.append(functools.partial(modules.__setitem__, index, state))
            if not predicting:
                return computed
        pieces: dict[int, list[torch.Tensor]] = {}  # local row -> its outputs
        if outputs is not None:
            for k, i in enumerate(running):
                pieces[i] = [o[k : k + 1] for o in outputs]
        for slot in predicting:
            state = slot.branch.modules[index]
            predicted = taylor_predict(state, slot.branch.step + 1)
            single = len(predicted) == 1 if outputs is None else single
            for k, row in enumerate(slot.rows):
                pieces[position[row]] = [p[k : k + 1] for p in predicted]
        count = len(pieces[0])
        joined = tuple(torch.cat([pieces[i][j] for i in range(len(active))]) for j in range(count))
        return joined[0] if single else joined


def reused_rows(plan: CachePlan) -> dict[int, int]:
    """Rows served from a cache in this forward, by ``id`` of the job's CacheState: an FBC branch that
    reused, a TaylorSeer branch that predicted."""
    reused: dict[int, int] = {}
    owners = {id(branch): state for state in plan.states for branch in state.branches}
    for slot in plan.slots:
        if not slot.computes:
            key = id(owners[id(slot.branch)])
            reused[key] = reused.get(key, 0) + len(slot.rows)
    return reused


# ---- plumbing ----------------------------------------------------------------------------------------------
@functools.cache
def _hook_class() -> type:
    """A diffusers ``ModelHook`` running a RowCaches ``forward(original, module, args, kwargs)``, original
    being the chain below it (the module's forward, or hooks registered before). Built on first use."""
    from diffusers.hooks import ModelHook

    class RowCacheHook(ModelHook):
        def __init__(self, forward: Callable) -> None:
            super().__init__()
            self.row_forward = forward

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.row_forward(self.fn_ref.original_forward, module, args, kwargs)

    return RowCacheHook


_SIGNATURES: dict[type, inspect.Signature] = {}


def _bound(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (as the module's forward would bind them)."""
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    bound = _SIGNATURES[cls].bind(module, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    for name, parameter in _SIGNATURES[cls].parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments


def _argument(module: torch.nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    return _bound(module, args, kwargs)[name]


def _gather(arguments: dict[str, Any], index: torch.Tensor, batch: int) -> dict[str, Any]:
    return {
        name: value.index_select(0, index)
        if name in PER_ROW_ARGUMENTS and isinstance(value, torch.Tensor) and value.shape[:1] == (batch,)
        else value
        for name, value in arguments.items()
    }


def _device_of(arguments: dict[str, Any]) -> Any:
    return next(v.device for v in arguments.values() if isinstance(v, torch.Tensor))


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Consecutive rows as a view (a job's rows are), else gathered."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return values[rows[0] : rows[0] + len(rows)]
    return values.index_select(0, to_device(torch.tensor(rows), values.device))


def _split(output: Any, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(output, tuple):
        return output, None
    encoder = None if layout.encoder_index is None else output[layout.encoder_index]
    return output[layout.hidden_index], encoder


def _join(output: Any, layout: BlockLayout, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    """A block's output with its hidden (and encoder) states replaced, in the block's own order."""
    if layout.encoder_index is None and not isinstance(output, tuple):
        return hidden
    joined: list[Any] = list(output) if isinstance(output, tuple) else [None, None]
    joined[layout.hidden_index] = hidden
    if layout.encoder_index is not None:
        joined[layout.encoder_index] = encoder
    return tuple(joined)


def _setter(branch: Any, name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(branch, name, value)
