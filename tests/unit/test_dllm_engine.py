"""The continuous-batching engine against the one-request reference, in float64 on the tiny EuroBERT.

Requests of different prompt lengths, gen/block lengths, temperatures, remasking, thresholds, CFG and
seeds join the running set at different steps; each must come out token for token as if it had run alone,
with fewer forwards than the solo runs together.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.unit.recording import RecordingChannel, deliver_errors, step_as_worker
from triton_diffusion.adapters.diffusion_lm_adapter import (
    DecodingRequest,
    DiffusionLMAdapter,
    block_positions,
    pad_rows,
    padding_changes_logits,
)
from triton_diffusion.adapters.masked_diffusion import (
    DecodeParams,
    commit_blocks,
    generate_reference,
    transfer_schedule,
)
from triton_diffusion.adapters.masked_lm import MaskedLMForward
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.serving.engine_worker import EngineWorker
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.tiny_models import build_tiny_dllm


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-dllm")
    build_tiny_dllm(folder)
    model = AutoModelForMaskedLM.from_pretrained(folder, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


class Recorder:
    """Renders the engine's reports by writing down what happened; each job's channel records its
    answers (a finished job's request is answered with its tokens, as the engine host would)."""

    def __init__(self, cancel_after: dict[str, int] | None = None) -> None:
        self.events: list[tuple[str, str]] = []
        self.finished: dict[str, DecodingRequest] = {}
        self.jobs: dict[str, Job] = {}
        self.cancel_after = cancel_after or {}
        self.forwards: list[tuple[int, int]] = []
        self.lengths: list[set[int]] = []

    def job(self, name: str, request: DecodingRequest) -> Job:
        limit = self.cancel_after.get(name)
        channel = RecordingChannel(cancelled=lambda: limit is not None and request.steps_used >= limit)
        job = Job(TrackedRequest(name, channel), request)
        self.jobs[name] = job
        return job

    @property
    def failed(self) -> dict[str, RequestError]:
        return {
            name: job.request.channel.finals[0]
            for name, job in self.jobs.items()
            if job.request.channel.finals and isinstance(job.request.channel.finals[0], RequestError)
        }

    def render(self, report: StepReport) -> None:
        for stepped in report.stepped:
            self.on_stepped(stepped.job)
        for forward in report.forwards:  # one forward per engine step: its jobs are the ones stepped
            self.forwards.append((forward.rows, forward.images))
            self.lengths.append({stepped.job.state.x.shape[0] for stepped in report.stepped})
        for finished in report.finished:
            self.on_finished(finished.job, finished.output)
        deliver_errors(report)
        for left in report.left:
            self.on_left(left.job, left.reason)

    def on_stepped(self, job: Job) -> None:
        if job.state.new_block:
            self.events.append(("block", job.request.request_id))

    def on_finished(self, job: Job, output: DecodingRequest) -> None:
        self.events.append(("finished", job.request.request_id))
        self.finished[job.request.request_id] = output
        job.request.finish({"tokens": output.tokens()})

    def on_left(self, job: Job, reason: str) -> None:
        if reason != "finished":
            self.events.append((reason, job.request.request_id))


class Harness:
    """A step engine whose reports go to a recorder at once, as the engine host's worker does."""

    def __init__(self, engine: StepEngine, recorder: Recorder) -> None:
        self.engine, self.recorder = engine, recorder

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self) -> None:
        self.recorder.render(step_as_worker(self.engine))


def make_engine(forward, recorder, pad_id, max_running, padding_side="left", group_by_length=False):
    adapter = DiffusionLMAdapter(forward, pad_id, padding_side, group_by_length=group_by_length)
    return Harness(StepEngine(adapter, EngineLimits(max_running, max_running)), recorder)


def make_worker(harness: Harness, waiting_room: int) -> EngineWorker:
    capacity = harness.limits.max_running + waiting_room
    unused = lambda error: None  # noqa: E731
    return EngineWorker(harness.engine, capacity, harness.recorder.render, 60.0, unused, unused)


def submit(worker: EngineWorker, job: Job) -> float:
    (waited,) = worker.submit([(job.request, [job])], max_wait_s=60.0)
    return waited


# name -> (prompt, params, seed, engine step at which it arrives)
CASES = {
    "greedy": ("Tell me a story about the sea", DecodeParams(32, 8, 16), 1, 0),
    "sampled": ("a", DecodeParams(24, 12, 12, temperature=0.8), 2, 0),
    "random_remasking": (
        "the moon and the stars over a dark river at night",
        DecodeParams(16, 16, 8, temperature=0.5, remasking="random"),
        3,
        3,
    ),
    "cfg": ("red horse", DecodeParams(16, 4, 8, temperature=1.0, cfg_scale=1.5), 4, 5),
    "threshold": ("what is a block", DecodeParams(32, 16, 16, temperature=0.3, threshold=0.02), 5, 5),
    "long_blocks": ("one two three four five", DecodeParams(40, 20, 20, temperature=1.3), 6, 11),
}


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text).input_ids, dtype=torch.long)


def make_request(tokenizer, name: str, eos_ids=()) -> DecodingRequest:
    prompt, params, seed, _ = CASES[name]
    return DecodingRequest(
        encode(tokenizer, prompt),
        params,
        torch.Generator().manual_seed(seed),
        tokenizer.mask_token_id,
        tuple(eos_ids),
    )


def solo(forward: MaskedLMForward, tokenizer, name: str, eos_ids=()):
    prompt, params, seed, _ = CASES[name]
    generator = torch.Generator().manual_seed(seed)
    return generate_reference(
        forward.unpadded, encode(tokenizer, prompt), params, tokenizer.mask_token_id, generator, eos_ids
    )


def run_engine(engine: Harness, tokenizer, names, eos_ids=()) -> None:
    arrivals = sorted(names, key=lambda n: CASES[n][3])
    step = 0
    while arrivals or engine.active:
        while arrivals and CASES[arrivals[0]][3] <= step:
            name = arrivals.pop(0)
            engine.add(engine.recorder.job(name, make_request(tokenizer, name, eos_ids)))
        engine.step()
        step += 1


class NoPositions(torch.nn.Module):
    """A model whose forward takes no position_ids (like LLaDA's remote code): right padding."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_batched_engine_matches_one_request_at_a_time(lm, padding):
    model, tokenizer = lm
    forward = MaskedLMForward(model if padding == "left" else NoPositions(model))
    assert forward.padding_side == padding
    recorder = Recorder()
    engine = make_engine(forward, recorder, tokenizer.pad_token_id, 8, forward.padding_side)
    run_engine(engine, tokenizer, list(CASES))

    solo_forwards = 0
    for name in CASES:
        reference = solo(forward, tokenizer, name)
        request = recorder.finished[name]
        assert request.tokens() == reference.tokens, name
        assert request.steps_used == reference.steps_used, name
        solo_forwards += reference.steps_used
    assert engine.forwards < solo_forwards
    # Requests really shared forwards, and ones that arrived later joined mid-generation.
    assert max(requests for _, requests in recorder.forwards) >= 4
    joined = {name: recorder.jobs[name].stats.first_forward for name in CASES}
    assert joined["greedy"] == 1 and joined["long_blocks"] > 1
    # The threshold let its blocks finish early; the others used exactly their steps.
    assert recorder.finished["threshold"].steps_used < CASES["threshold"][1].steps
    assert recorder.finished["greedy"].steps_used == CASES["greedy"][1].steps


class IgnoresMask(torch.nn.Module):
    """Like LLaDA's published modelling code: attention runs with no mask, so padding leaks into rows."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids=input_ids)


def test_a_model_that_ignores_its_mask_is_found_at_load_and_never_padded(lm):
    model, tokenizer = lm
    honest = MaskedLMForward(NoPositions(model))
    leaky = MaskedLMForward(IgnoresMask(model))
    vocab = model.config.vocab_size
    assert not padding_changes_logits(honest, tokenizer.pad_token_id, "right", vocab)
    assert padding_changes_logits(leaky, tokenizer.pad_token_id, "right", vocab)

    names = ["greedy", "sampled", "cfg", "threshold"]  # four prompt lengths
    outcomes = {}
    for group_by_length in (False, True):
        recorder = Recorder()
        engine = make_engine(leaky, recorder, tokenizer.pad_token_id, 8, "right", group_by_length)
        run_engine(engine, tokenizer, names)
        outcomes[group_by_length] = {
            n: recorder.finished[n].tokens() == solo(leaky, tokenizer, n).tokens for n in names
        }
        if group_by_length:  # unpadded: every forward held rows of one length only
            assert all(len(lengths) == 1 for lengths in recorder.lengths)
    assert all(outcomes[True].values()), outcomes  # grouped by length: exactly the solo tokens
    assert not all(outcomes[False].values()), outcomes  # padded next to longer rows: they drift


def test_a_full_running_set_admits_at_the_next_free_slot(lm):
    model, tokenizer = lm
    forward = MaskedLMForward(model)
    recorder = Recorder()
    engine = make_engine(forward, recorder, tokenizer.pad_token_id, 2)
    run_engine(engine, tokenizer, list(CASES))
    assert max(requests for _, requests in recorder.forwards) == 2
    for name in CASES:
        assert recorder.finished[name].tokens() == solo(forward, tokenizer, name).tokens, name


def test_eos_stops_after_its_block_and_text_ends_before_it(lm):
    model, tokenizer = lm
    forward = MaskedLMForward(model)
    # Call a token that greedy decoding produces in the first block "EOS": the request must stop after
    # that block, in the engine and in the reference alike.
    first = solo(forward, tokenizer, "greedy")
    eos = first.tokens[3]
    reference = solo(forward, tokenizer, "greedy", eos_ids=(eos,))
    assert reference.blocks == 1 and reference.tokens == first.tokens[: first.tokens.index(eos)]
    recorder = Recorder()
    engine = make_engine(forward, recorder, tokenizer.pad_token_id, 8)
    run_engine(engine, tokenizer, ["greedy", "sampled"], eos_ids=(eos,))
    assert recorder.finished["greedy"].tokens() == reference.tokens
    assert recorder.finished["greedy"].block_index == 1


def test_a_cancelled_request_leaves_at_once_and_the_others_are_unchanged(lm):
    model, tokenizer = lm
    forward = MaskedLMForward(model)
    recorder = Recorder(cancel_after={"greedy": 3})
    engine = make_engine(forward, recorder, tokenizer.pad_token_id, 8)
    run_engine(engine, tokenizer, ["greedy", "sampled", "cfg"])
    assert ("cancelled", "greedy") in recorder.events and "greedy" not in recorder.finished
    for name in ("sampled", "cfg"):
        assert recorder.finished[name].tokens() == solo(forward, tokenizer, name).tokens
    # (rows, requests) per forward: greedy leaves right after its third step; cfg (two rows) joins at 5.
    assert recorder.forwards[:6] == [(2, 2), (2, 2), (2, 2), (1, 1), (1, 1), (3, 2)]


def test_blocks_are_reported_in_order_before_the_final():
    events = []

    class Listener(Recorder):
        def on_stepped(self, job):
            if job.state.new_block:
                events.append(("block", job.state.block_index))

        def on_finished(self, job, output):
            events.append(("finished", output.block_index))

    def forward(input_ids, attention_mask, position_ids, keep):
        return torch.randn(*keep.shape, 11, dtype=torch.float64)

    listener = Listener()
    engine = make_engine(forward, listener, pad_id=0, max_running=4)
    params = DecodeParams(12, 4, 6)
    request = DecodingRequest(torch.tensor([5, 6]), params, torch.Generator().manual_seed(0), 1)
    engine.add(listener.job("x", request))
    while engine.active:
        engine.step()
    assert events == [("block", 1), ("block", 2), ("block", 3), ("finished", 3)]


def test_padding_keeps_each_rows_positions():
    batch = pad_rows([torch.tensor([7, 8, 9]), torch.tensor([4])], pad_id=0, side="left")
    assert batch.input_ids.tolist() == [[7, 8, 9], [0, 0, 4]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]] and batch.starts.tolist() == [0, 2]
    right = pad_rows([torch.tensor([7, 8, 9]), torch.tensor([4])], pad_id=0, side="right")
    assert right.input_ids.tolist() == [[7, 8, 9], [4, 0, 0]] and right.starts.tolist() == [0, 0]
    assert right.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    # The current blocks: row 0 at positions 1..2 of its own, row 1 (shorter block) at 0, repeated.
    keep = block_positions(batch, [(1, 3), (0, 1)], width=2)
    assert keep.tolist() == [[1, 2], [2, 2]]


def test_transfer_schedule_is_llada_get_num_transfer_tokens():
    for block_length in (1, 5, 8, 16, 33):
        for steps in range(1, block_length + 1):
            # LLaDA: base = n // steps for every step, plus one for the first n % steps steps.
            mask_num = torch.tensor([[block_length]])
            expected = torch.zeros(1, steps, dtype=torch.int64) + mask_num // steps
            expected[0, : int(mask_num % steps)] += 1
            assert transfer_schedule(block_length, steps) == expected[0].tolist()


def test_commit_greedy_picks_the_most_confident_positions_and_threshold_adds_more():
    mask = 9
    logits = torch.full((4, 10), -10.0, dtype=torch.float64)
    for position, (token, score) in enumerate([(1, 5.0), (2, 1.0), (3, 9.0), (4, 0.0)]):
        logits[position, token] = score
    block = torch.tensor([mask, mask, mask, 7])  # the last position is already committed

    def step(scheduled: int, params: DecodeParams) -> list[int]:
        generator = torch.Generator().manual_seed(0)
        return commit_blocks(logits[None], block[None], mask, [scheduled], [params], [generator])[0].tolist()

    assert step(2, DecodeParams(4, 4, 2)) == [1, mask, 3, 7]
    # With a threshold every position above it is committed, even beyond the scheduled one ...
    assert step(1, DecodeParams(4, 4, 2, threshold=0.001)) == [1, 2, 3, 7]
    # ... and at least one, even when none is above it.
    assert step(0, DecodeParams(4, 4, 4, threshold=0.9999999)) == [mask, mask, 3, 7]


def test_commit_steps_requests_of_different_block_lengths_as_if_alone():
    torch.manual_seed(0)
    mask = 0
    params = [
        DecodeParams(8, 8, 4, temperature=0.9),
        DecodeParams(4, 4, 2, remasking="random"),
        DecodeParams(6, 6, 6, temperature=0.4, threshold=0.2),
    ]
    logits = torch.randn(3, 8, 13, dtype=torch.float64) * 3
    blocks = torch.full((3, 8), -1)
    for i, p in enumerate(params):
        blocks[i, : p.block_length] = mask
    scheduled = [2, 2, 1]
    together = commit_blocks(
        logits, blocks, mask, scheduled, params, [torch.Generator().manual_seed(i) for i in range(3)]
    )
    for i, p in enumerate(params):
        width = p.block_length
        alone = commit_blocks(
            logits[i : i + 1, :width],
            blocks[i : i + 1, :width],
            mask,
            [scheduled[i]],
            [p],
            [torch.Generator().manual_seed(i)],
        )
        assert torch.equal(together[i, :width], alone[0])
        assert (alone != mask).sum() >= scheduled[i] and (together[i, width:] == -1).all()


@pytest.mark.parametrize(
    ("params", "field", "allowed"),
    [
        (DecodeParams(30, 8, 15), "block_length", "1, 2, 3, 5, 6, 10, 15, 30"),
        (DecodeParams(32, 8, 10), "steps", "a multiple of 4"),
        (DecodeParams(32, 8, 64), "steps", "4..32"),
        (DecodeParams(32, 8, 8, remasking="entropy"), "remasking", "low_confidence"),
    ],
)
def test_bad_parameter_combinations_name_the_field_and_what_is_allowed(params, field, allowed):
    with pytest.raises(RequestError) as caught:
        params.check()
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert caught.value.message.startswith(f"{field}:") and allowed in caught.value.message


# ---- the worker thread -----------------------------------------------------------------------------
def slow_forward(delay_s: float, fail_when=None):
    def forward(input_ids, attention_mask, position_ids, keep):
        time.sleep(delay_s)
        if fail_when is not None and fail_when(input_ids):
            raise RuntimeError("injected forward failure")
        return torch.randn(*keep.shape, 11, dtype=torch.float64)

    return forward


def tiny_job(recorder: Recorder, name: str, first_token: int = 5) -> Job:
    generator = torch.Generator().manual_seed(0)
    request = DecodingRequest(torch.tensor([first_token, 6]), DecodeParams(8, 4, 4), generator, 1)
    return recorder.job(name, request)


def test_submit_blocks_while_the_running_set_and_waiting_room_are_full():
    recorder = Recorder()
    gate = threading.Event()  # every forward waits for it: nothing finishes until the test opens it
    forward = slow_forward(0.0)
    engine = make_engine(lambda *args: (gate.wait(10), forward(*args))[1], recorder, pad_id=0, max_running=2)
    worker = make_worker(engine, waiting_room=1)
    try:
        for name in "abc":
            submit(worker, tiny_job(recorder, name))
        done = threading.Event()
        waited: list[float] = []
        late = tiny_job(recorder, "d")
        returned: list[float] = []
        threading.Thread(
            target=lambda: (
                waited.append(submit(worker, late)),
                returned.append(time.monotonic()),
                done.set(),
            )
        ).start()
        assert not done.wait(0.05)  # full: the fourth waits for a slot
        opened = time.monotonic()
        gate.set()
        assert done.wait(10)
        assert returned[0] >= opened and waited[0] > 0  # it went in once a slot came free, and says it waited
        deadline = time.monotonic() + 10
        while len(recorder.finished) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(recorder.finished) == ["a", "b", "c", "d"]
    finally:
        worker.close()


def test_a_failing_forward_answers_each_request_it_held_once_and_the_worker_goes_on():
    recorder = Recorder()
    # The forward fails whenever a row starts with token 99 (request "bad").
    forward = slow_forward(0.01, fail_when=lambda ids: bool((ids == 99).any()))
    engine = make_engine(forward, recorder, pad_id=0, max_running=4)
    worker = make_worker(engine, waiting_room=2)
    try:
        submit(worker, tiny_job(recorder, "ok1"))
        submit(worker, tiny_job(recorder, "bad", first_token=99))
        deadline = time.monotonic() + 10
        while "bad" not in recorder.failed and time.monotonic() < deadline:
            time.sleep(0.01)
        submit(worker, tiny_job(recorder, "ok2"))
        while "ok2" not in recorder.finished and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.close()
    assert recorder.failed["bad"].code is ErrorCode.INTERNAL
    assert "injected forward failure" in recorder.failed["bad"].message
    assert "ok1" in recorder.finished and "ok2" in recorder.finished  # the failing forward was bisected
    assert all(len(job.request.channel.finals) == 1 for job in recorder.jobs.values())  # one end each


def test_close_answers_whatever_is_still_held():
    recorder = Recorder()
    engine = make_engine(slow_forward(0.05), recorder, pad_id=0, max_running=1)
    worker = make_worker(engine, waiting_room=3)
    for name in "abcd":
        submit(worker, tiny_job(recorder, name))
    worker.close()
    ended = set(recorder.finished) | set(recorder.failed)
    assert ended == {"a", "b", "c", "d"}
    assert all(e.code is ErrorCode.UNAVAILABLE for e in recorder.failed.values()) and recorder.failed
    assert submit(worker, tiny_job(recorder, "late")) == -1.0
    assert recorder.failed["late"].code is ErrorCode.UNAVAILABLE
    assert "shutting down" in recorder.failed["late"].message
