"""Graph-captured forwards (config ``cuda_graphs``, adapters/captured_forwards.py).

What is not CUDA's own is tested on the CPU: row buckets, padding into static buffers, one graph per
signature and bucket captured at load, the eager fallbacks, a failed capture failing the load, and,
through the step engine on tiny SD 1.x and FLUX.1, that every image still equals its pipeline's own with
every forward padded to its bucket. The CPU stands in for
the graph with :class:`EagerGraph`: what a replay computes (the forward captured over the static inputs,
into one output tensor that the next replay overwrites). The CUDA capture itself runs only on a GPU.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from tests.unit.step_harness import Host, assert_each_image_equals_the_pipelines_own, load_family, run_engine
from triton_diffusion.adapters.captured_forwards import (
    CapturedForwards,
    CaptureError,
    bucket_for,
    fill_rows,
    row_buckets,
    signature,
)
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job
from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.settings import ModelConfig, ModelSettings
from triton_diffusion.tiny_models import build_missing


@dataclass
class EagerGraph:
    """A CUDA graph's replay on the CPU: the captured forward again over the same static inputs, written
    into the same output tensor."""

    forward: Callable[[], torch.Tensor]
    output: torch.Tensor
    replays: int = 0

    def replay(self) -> None:
        self.output.copy_(self.forward())
        self.replays += 1


def eager_capture(forward, pool, device) -> EagerGraph:
    return EagerGraph(forward, forward())


def toy_predict(latents, timesteps, inputs, size):
    """Row-wise: each row's result depends on its own inputs only (as a denoiser's)."""
    return latents * timesteps[:, None] + inputs["text"].sum(dim=1, keepdim=True)


def toy_rows(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 4, generator=generator),
        torch.rand(rows, generator=generator),
        {"text": torch.randn(rows, 3, generator=generator)},
    )


def test_row_buckets_are_1_2_4_8_then_every_4_up_to_the_largest_forward():
    assert row_buckets(16) == (1, 2, 4, 8, 12, 16)
    assert row_buckets(14) == (1, 2, 4, 8, 12, 14)
    assert row_buckets(6) == (1, 2, 4, 6)
    assert row_buckets(1) == (1,)
    with pytest.raises(ValueError):
        row_buckets(0)
    buckets = (1, 2, 4, 8, 12)
    assert [bucket_for(rows, buckets) for rows in (1, 3, 4, 5, 9, 12, 13)] == [1, 4, 4, 8, 12, 12, None]


def test_signature_is_every_shape_past_the_rows_and_none_where_an_input_is_not_per_row():
    latents, timesteps, inputs = toy_rows(3)
    key = signature(latents, timesteps, inputs, (64, 64))
    assert key == signature(*toy_rows(5), (64, 64))  # rows are the bucket's, not the signature's
    assert key != signature(latents, timesteps, inputs, (64, 96))
    assert key != signature(latents, timesteps, {"text": torch.randn(3, 4)}, (64, 64))
    assert key != signature(latents, timesteps, {"text": inputs["text"].double()}, (64, 64))
    assert signature(latents, timesteps, {"text": torch.randn(2, 3)}, (64, 64)) is None
    assert signature(latents, torch.tensor(1.0), inputs, (64, 64)) is None


def test_fill_rows_copies_the_rows_and_repeats_the_first_into_the_rest():
    static = torch.full((4, 2), float("nan"))
    fill_rows(static, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert static.tolist() == [[1, 2], [3, 4], [1, 2], [1, 2]]


def warmed(max_rows: int, *sizes: tuple[int, int], capture=eager_capture) -> CapturedForwards:
    graphs = CapturedForwards(toy_predict, "cpu", capture=capture)
    for size in sizes:
        graphs.warm(*toy_rows(1, seed=99), size, max_rows)
    return graphs


def test_a_padded_replay_equals_the_eager_forward_and_one_graph_serves_its_bucket():
    graphs = warmed(8, (64, 64))
    assert sorted(bucket for _, bucket in graphs.graphs) == [1, 2, 4, 8]
    for rows, seed in ((3, 0), (4, 1), (3, 2), (1, 3), (5, 4), (8, 5)):
        latents, timesteps, inputs = toy_rows(rows, seed)
        out = graphs(latents, timesteps, inputs, (64, 64))
        assert out.shape == (rows, 4)
        assert torch.equal(out, toy_predict(latents, timesteps, inputs, (64, 64)))
    assert (graphs.replays, graphs.eager) == (6, 0)
    replays = {bucket: graph.replay.replays for (_, bucket), graph in graphs.graphs.items()}
    assert replays == {8: 2, 4: 3, 2: 0, 1: 1}  # every forward replays its bucket's one graph


def test_an_answer_is_not_overwritten_by_the_next_replay():
    graphs = warmed(4, (64, 64))
    first = graphs(*toy_rows(2, 0), (64, 64))
    kept = first.clone()
    graphs(*toy_rows(2, 1), (64, 64))
    assert torch.equal(first, kept)


def test_forwards_without_a_graph_run_eagerly_and_nothing_is_captured_after_load():
    graphs = warmed(4, (64, 64))
    held = dict(graphs.graphs)
    for size, rows in (((64, 96), 2), ((64, 64), 6)):  # another size; more rows than the largest bucket
        latents, timesteps, inputs = toy_rows(rows)
        assert torch.equal(
            graphs(latents, timesteps, inputs, size), toy_predict(latents, timesteps, inputs, size)
        )
    assert (graphs.eager, graphs.replays) == (2, 0) and graphs.graphs == held


def test_a_failed_capture_is_an_error_for_the_load_not_an_eager_fallback():
    def failing_capture(forward, pool, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(CaptureError, match=r"at \(64, 64\), 4 model rows, failed: .*not permitted"):
        warmed(4, (64, 64), capture=failing_capture)
    graphs = CapturedForwards(toy_predict, "cpu", capture=eager_capture)
    with pytest.raises(CaptureError, match="not one row per model row"):
        graphs.warm(*toy_rows(2)[:2], {"text": torch.randn(3, 3)}, (64, 64), 4)


def test_warm_captures_every_bucket_largest_first_once():
    order = []

    def recording_capture(forward, pool, device):
        graph = eager_capture(forward, pool, device)
        order.append(graph.output.shape[0])
        return graph

    graphs = CapturedForwards(toy_predict, "cpu", capture=recording_capture)
    latents, timesteps, inputs = toy_rows(2)
    assert graphs.warm(latents, timesteps, inputs, (64, 64), 16) == 6
    assert order == [16, 12, 8, 4, 2, 1]
    assert graphs.warm(latents, timesteps, inputs, (64, 64), 16) == 0  # held already
    # A size capped lower (max_rows_by_resolution) gets only the buckets its forwards can use.
    assert graphs.warm(latents, timesteps, inputs, (64, 96), 4) == 3
    graphs(*toy_rows(6), (64, 96))  # 6 rows: more than that size's largest bucket
    assert graphs.eager == 1


# (negative prompt, steps, guidance, (height, width), arrives at engine step): forwards of 1 to 6 jobs
# (up to 12 model rows, so buckets 1 to 16), two shapes, jobs with and without CFG.
REQUESTS = [
    (None, 4, 7.5, (64, 64), 0),
    ("blurry", 3, 1.0, (96, 64), 0),
    (None, 5, 3.0, (64, 64), 1),
    ("dark", 4, 5.0, (64, 64), 2),
    (None, 2, 7.5, (96, 64), 2),
    ("noise", 6, 2.0, (64, 64), 4),
]


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-flux"])
def test_every_image_equals_the_pipelines_own_with_every_forward_padded_to_its_bucket(name):
    family = load_family(name)
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    scheduler = schedulers.names[0]
    warm = [
        ImageParams("warm-up", None, 0, 0, *size, 4, 7.5, 1.0, scheduler) for size in ((64, 64), (96, 64))
    ]
    assert (
        adapter.capture_forwards([(r, 16) for r in warm], capture=eager_capture) == 12
    )  # 6 buckets at each size
    # Captured per size: one size per forward from now on (a packed canvas would run eagerly), said why.
    assert not adapter.sizes.packing.on
    assert name == "tiny-sd" or "cuda_graphs" in adapter.sizes.packing.why_not
    requests = [
        ImageParams(f"prompt {i}", negative, 30 + i, 0, *size, steps, guidance, 1.0, scheduler)
        for i, (negative, steps, guidance, size, _) in enumerate(REQUESTS)
    ]
    host = Host()
    jobs = run_engine(adapter, [(spec[4], r) for spec, r in zip(REQUESTS, requests, strict=True)], host)
    assert adapter.captured.eager == 0 and adapter.captured.replays == len(host.model_rows)
    padded = [rows for rows in host.model_rows if bucket_for(rows, row_buckets(16)) != rows]
    assert padded, f"no forward was padded: {host.model_rows}"
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)


def load_model(**config) -> TextToImageModel:
    build_missing(WEIGHTS, only=["tiny-sd"])
    texts = {"model": str(WEIGHTS / "tiny-sd"), **{k: str(v).lower() for k, v in config.items()}}
    settings = ModelSettings(
        "m", WEIGHTS, ModelConfig.parse(texts, ("image", "image_source"), [], "m"), {}, 4, "CPU", 0
    )
    model = TextToImageModel()
    model.fields, model.adapter = model.load(settings)
    model.settings = settings
    return model


def test_cuda_graphs_is_refused_with_loras_and_bad_sizes_and_ignored_on_a_cpu(caplog):
    loras = json.dumps({"ink": "tiny-sd-lora-ink"})
    build_missing(WEIGHTS, only=["tiny-sd-lora-ink"])
    with pytest.raises(ValueError, match="cuda_graphs cannot be used with loras"):
        load_model(cuda_graphs=True, loras=loras)
    with pytest.raises(ValueError, match="cuda_graphs: a warm-up request was refused: .*width"):
        load_model(cuda_graphs=True, cuda_graph_sizes="64x64,60x64")  # not a multiple of 8: checked anywhere
    with caplog.at_level(logging.WARNING, logger="triton_diffusion"):
        model = load_model(cuda_graphs=True, cuda_graph_sizes="64x64,128x64")
    assert model.adapter.captured is None
    assert any("cuda_graphs ignored: the model runs on cpu" in r.message for r in caplog.records)
    # What a GPU would capture at load: a forward of each configured size, at every bucket.
    settings = ModelSettings(
        "m", WEIGHTS, replace(model.settings.config, cuda_graph_sizes=((128, 64),)), {}, 4, "CPU", 0
    )
    warm = model.warm_up_requests(settings, model.fields)
    assert [(r.width, r.height) for r in warm] == [(128, 64)]
    assert model.adapter.capture_forwards([(r, 8) for r in warm], capture=eager_capture) == 4
    assert {key[0] for key, _ in model.adapter.captured.graphs} == {(64, 128)}  # (height, width)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_match_the_eager_forward_on_a_gpu():
    pipe, facts, schedulers = load_family("tiny-sd")
    pipe.to("cuda")
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    name = schedulers.names[0]
    assert (
        adapter.capture_forwards([(ImageParams("warm-up", None, 0, 0, 64, 64, 4, 7.5, None, name), 8)]) == 4
    )
    # Other prompts, seeds and timesteps than the warm-up's, replayed in turn across buckets sharing a pool.
    for count, step in ((3, 2), (1, 1), (4, 3), (1, 0)):
        jobs = [
            Job(None, ImageParams(f"fox {i}", None, 50 + i, 0, 64, 64, 4, 3.0 + i, None, name))
            for i in range(count)
        ]
        adapter.prepare(jobs)
        with torch.inference_mode():
            inputs = adapter.forward_inputs(jobs, [job.state.timesteps[step] for job in jobs])[:3]
            eager = adapter.predict(*inputs, (64, 64))
            replayed = adapter.captured(*inputs, (64, 64))
        torch.cuda.synchronize()
        assert (replayed - eager).abs().max().item() <= 1e-3 * eager.abs().max().item(), (count, step)
    assert (adapter.captured.replays, adapter.captured.eager) == (4, 0)


def test_an_inpainting_checkpoint_is_refused_with_its_reason():
    pipe, facts, schedulers = load_family("tiny-sd-inpaint")
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert (
        adapter.uncapturable
        == "an inpainting checkpoint's forwards are captured from text jobs, which it refuses"
    )
    with pytest.raises(CaptureError, match="inpainting checkpoint"):
        adapter.capture_forwards([], capture=eager_capture)
    assert adapter.captured is None
