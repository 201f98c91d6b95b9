"""The calibration at load (models/calibration.py): a family that packs sizes seeds the engine's cost fit
from forwards of its own at two sizes, so the packing gate has prices before the first request; one that
does not pack, or whose forward fails, is not calibrated (the fit learns from traffic)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.step_harness import load_family
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.row_sizes import Packing
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.models.calibration import MAX_ROWS, calibrate


@pytest.fixture(scope="module")
def flux() -> Any:
    pipe, facts, schedulers = load_family("tiny-flux")
    return step_adapter_for(pipe, facts, schedulers, None)


def request(side: int) -> ImageParams:
    return ImageParams(
        "calibration", None, 0, 0, side, side, 28, 3.5, None, "FlowMatchEulerDiscreteScheduler"
    )


def test_a_packing_family_is_calibrated_at_two_sizes_with_one_row_and_its_cap(flux):
    times = calibrate(flux, [request(64), request(128)], lambda r: 8)
    assert times is not None
    # FLUX.1 has no (true) CFG: a row per job; 64x64 is 16 latent tokens a row (2x2 patches of 8x8).
    assert set(times.calibration) == {
        (1, 16),
        (MAX_ROWS, MAX_ROWS * 16),
        (1, 64),
        (MAX_ROWS, MAX_ROWS * 64),
    }
    assert all(seconds > 0 for seconds in times.calibration.values()) and not times.by_rows_tokens
    assert times.forward_cost(8, 8 * 64) is not None  # the plane is determined: the gate has a price
    assert not times.measured  # deadlines are not priced by it: they wait for the traffic's own forwards


def test_nothing_is_calibrated_where_the_family_does_not_pack_or_a_forward_fails(flux, caplog):
    class NoPacking:
        sizes = SimpleNamespace(packing=Packing(on=False))

    assert calibrate(NoPacking(), [request(64), request(128)], lambda r: 8) is None
    assert calibrate(flux, [request(64)], lambda r: 8) is None  # one size: nothing to price packing by

    class Failing:
        sizes = SimpleNamespace(packing=Packing(on=True))

        def __getattr__(self, name: str) -> Any:
            return getattr(flux, name)

        def step(self, jobs, previews):
            raise RuntimeError("a forward that fails")

    assert calibrate(Failing(), [request(64), replace(request(128))], lambda r: 8) is None
    assert "calibration at load failed" in caplog.text
