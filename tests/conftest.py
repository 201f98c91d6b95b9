"""Settings for every test process: under pytest-xdist (scripts/test.sh runs two workers on two cores),
each worker computes with one torch thread, so the two never ask for four threads on two cores (the
servers the integration tests start keep their own threads)."""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
