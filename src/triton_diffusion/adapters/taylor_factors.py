"""TaylorSeer's arithmetic, as diffusers' ``TaylorSeerState.update`` and ``.predict`` do it, for one
attention module of one branch; the update is staged (applied when the forward returned:
adapters/step_caches.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# diffusers' TaylorSeerCacheConfig defaults.
TAYLOR_MAX_ORDER = 1
TAYLOR_FACTORS_DTYPE = torch.bfloat16


@dataclass(eq=False)
class TaylorFactors:
    """One attention module's TaylorSeer state for one branch (diffusers' ``TaylorSeerState``)."""

    last_update_step: int | None = None
    factors: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = ()


def taylor_update(state: TaylorFactors, outputs: tuple[torch.Tensor, ...], step: int) -> Callable[[], None]:
    factors: dict[int, dict[int, torch.Tensor]] = {}
    for i, features in enumerate(outputs):
        new = {0: features}
        if state.last_update_step is not None:
            delta = step - state.last_update_step
            previous = state.factors.get(i, {})
            for j in range(TAYLOR_MAX_ORDER):
                old = previous.get(j)
                if old is None or old.shape != new[j].shape:
                    break
                new[j + 1] = (new[j] - old.to(features.dtype)) / delta
        # copy=True: order 0 is the block's own output, which the model may later change in place
        factors[i] = {order: factor.to(TAYLOR_FACTORS_DTYPE, copy=True) for order, factor in new.items()}
    dtypes = tuple(o.dtype for o in outputs)

    def apply() -> None:
        state.factors, state.dtypes, state.last_update_step = factors, dtypes, step

    return apply


def taylor_predict(state: TaylorFactors, step: int) -> list[torch.Tensor]:
    assert state.last_update_step is not None, "a prediction needs a computed step"
    offset = step - state.last_update_step
    orders = len(state.factors[0])
    outputs = []
    for i in range(len(state.factors)):
        dtype = state.dtypes[i]
        factors = state.factors[i]
        output = torch.zeros_like(factors[0], dtype=dtype)
        for order in range(orders):
            coefficient = (offset**order) / math.factorial(order)
            output = output + factors[order].to(dtype) * coefficient
        outputs.append(output)
    return outputs
