"""Async output (outputs built during the next step's forward pass) gives exactly the synchronous outputs: tokens,
text, stop strings, finish reasons, logprobs, n > 1, streaming, aborts, speculative decoding; and frees every block.
So does async scheduling (each step launched before the previous step's tokens are read back)."""
from __future__ import annotations

import time

import pytest

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import FinishReason, SamplingParams
from infer.models.tiny import PRETRAINED_DIR

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "    for i in range(", "class Config:\n", "return"]


def params(stop: list[str]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=40, temperature=0.0, stop=stop),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=25, temperature=0.9, seed=3, n=3, stop=stop),
            SamplingParams(max_tokens=35, temperature=0.7, seed=5, top_p=0.9, stop=stop),
            SamplingParams(max_tokens=1, temperature=0.0)]


def engine(**options) -> Engine:
    return Engine(EngineConfig(model=str(PRETRAINED_DIR / "target"), device="cpu", num_kv_blocks=160, **options))


def drained(e: Engine) -> bool:
    s = e.kv.stats()
    return s.used_blocks == 0 and s.free_blocks + s.cached_blocks == s.total_blocks and not e.unemitted \
        and e.in_flight is None


def completions(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def logprobs(outputs) -> list:
    return [(token, value) for o in outputs for c in o.outputs for entry in c.logprobs or [] for token, value in
            sorted(entry.items())]


@pytest.fixture(scope="module")
def stops() -> list[str]:
    """Strings the greedy output of the first prompt reaches, so that stop strings really cut outputs."""
    text = engine().generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0].text
    return [text[6:9], "\n\n"]


@pytest.mark.parametrize("options", [{}, {"proposer": "ngram", "num_speculative_tokens": 3},
                                     {"proposer": "draft-model", "num_speculative_tokens": 2},
                                     {"scheduler": "chunked-prefill", "max_num_batched_tokens": 16}],
                         ids=["plain", "ngram", "draft-model", "chunked"])
def test_async_outputs_equal_sync_outputs(stops, options):
    sync, asynchronous = engine(async_output=False, **options), engine(async_output=True, **options)
    expected, actual = sync.generate(PROMPTS, params(stops)), asynchronous.generate(PROMPTS, params(stops))
    assert completions(actual) == completions(expected)
    # a sequence cut by a stop string runs one more (discarded) step with async output: other rows' float sums
    # see another batch shape, so logprobs agree to rounding, not bit for bit
    assert [t for t, _ in logprobs(actual)] == [t for t, _ in logprobs(expected)]
    assert [v for _, v in logprobs(actual)] == pytest.approx([v for _, v in logprobs(expected)], abs=1e-5)
    expected = completions(expected)
    assert any(c[2] is FinishReason.STOP and c[1] for request in expected for c in request)  # a stop string cut
    assert drained(sync) and drained(asynchronous)


@pytest.mark.parametrize("options", [{}, {"scheduler": "chunked-prefill", "max_num_batched_tokens": 16},
                                     {"preemption_mode": "recompute", "num_kv_blocks": 6, "max_num_seqs": 4}],
                         ids=["plain", "chunked", "preempting"])
def test_async_scheduling_outputs_equal_sync_outputs(stops, options):
    """Greedy, seeded and logprob requests, stop strings, an n = 3 request (it forks from a read-back token, so
    the engine settles the step in flight first) and preemption (a sequence whose last token is still in flight)."""
    options = {"num_kv_blocks": 160, **options}
    sync = Engine(EngineConfig(model=str(PRETRAINED_DIR / "target"), device="cpu", async_output=False, **options))
    ahead = Engine(EngineConfig(model=str(PRETRAINED_DIR / "target"), device="cpu", async_scheduling=True,
                                **options))
    expected, actual = sync.generate(PROMPTS, params(stops)), ahead.generate(PROMPTS, params(stops))
    assert completions(actual) == completions(expected)
    assert [t for t, _ in logprobs(actual)] == [t for t, _ in logprobs(expected)]
    assert [v for _, v in logprobs(actual)] == pytest.approx([v for _, v in logprobs(expected)], abs=1e-5)
    assert drained(sync) and drained(ahead)
    if options.get("num_kv_blocks") == 6:
        assert ahead.stats.preemptions > 0


def test_async_scheduling_stops_on_a_stop_token_read_back_a_step_late():
    """A stop token id is only known once read back: the sequence finishes then (STOP, also when it was the last
    token max_tokens allowed, which the step before had already finished as LENGTH)."""
    reference = engine().generate(PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0].token_ids
    k = next(i for i, t in enumerate(reference) if i >= 3 and t not in reference[:i])  # first use at index k
    cases = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[reference[k]]),
             SamplingParams(max_tokens=k + 1, temperature=0.0, stop_token_ids=[reference[k]])]
    for sp in cases:
        [expected] = engine(async_output=False).generate(PROMPTS[:1], sp)
        e = engine(async_scheduling=True)
        [actual] = e.generate(PROMPTS[:1], sp)
        assert completions([actual]) == completions([expected])
        assert expected.outputs[0].token_ids == reference[: k + 1]
        assert expected.outputs[0].finish_reason is FinishReason.STOP and drained(e)


def test_async_scheduling_fork_step_while_a_stop_token_is_read_back():
    """An n = 2 request's fork step runs synchronously; a sequence of that batch whose in-flight token stops it is
    read back after the launch (it stays in the batch, unsampled). Its arrival is swept over the steps."""
    reference = engine().generate(PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0].token_ids
    k = next(i for i, t in enumerate(reference) if i >= 3 and t not in reference[:i])
    stop = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[reference[k]])
    fork = SamplingParams(max_tokens=6, temperature=0.8, seed=2, n=2)
    for delay in range(1, k + 4):
        runs = []
        for options in ({"async_output": False}, {"async_scheduling": True}):
            e = engine(**options)
            first = e.add_request(PROMPTS[0], stop)
            tokens: dict[tuple[str, int], list[int]] = {}
            for step in range(10_000):
                if step == delay:
                    e.add_request(PROMPTS[1], fork)
                for out in e.step():
                    for c in out.outputs:
                        tokens.setdefault((out.request_id == first and "stop" or "fork", c.index), []).extend(
                            c.token_ids)
                if step >= delay and not e.has_unfinished():
                    break
            assert drained(e)
            runs.append(tokens)
        assert runs[1] == runs[0] and runs[0][("stop", 0)] == reference[: k + 1], delay


def test_async_scheduling_abort_with_a_step_in_flight():
    e = engine(async_scheduling=True)
    ids = [e.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for p in PROMPTS[:3]]
    tokens = []
    for _ in range(4):
        tokens += [t for out in e.step() if out.request_id == ids[0] for t in out.outputs[0].token_ids]
    assert e.in_flight is not None  # the last step's tokens are not read back yet
    final = e.abort(ids[0])  # they come in the abort's output
    tokens += final.outputs[0].token_ids
    reference = engine().generate(PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert final.finished and tokens == reference[0].outputs[0].token_ids[: len(tokens)] and len(tokens) == 4
    while e.has_unfinished():
        e.step()
    assert drained(e)


def test_ctrl_c_while_waiting_for_the_tokens_in_flight_leaves_the_engine_going():
    """The host waits for the device in the read-back, so a Ctrl-C likely lands there: the flight was cleared
    before it was read, which left -1 placeholders in the sequences, and every later step failed blaming the
    model. Now the next step reads it again, and every token comes out as on an uninterrupted engine."""

    class InterruptedOnce:
        def __init__(self, sample) -> None:
            self.sample, self.interrupted = sample, False

        def result(self):
            if not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt
            return self.sample.result()

        def __getattr__(self, name: str):
            return getattr(self.sample, name)

    e = engine(async_scheduling=True)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = [e.add_request(p, sampling) for p in PROMPTS[:2]]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def take(outputs) -> None:
        for out in outputs:
            tokens[out.request_id] += out.outputs[0].token_ids

    for _ in range(3):
        take(e.step())
    e.in_flight.sample = InterruptedOnce(e.in_flight.sample)
    with pytest.raises(KeyboardInterrupt):
        e.step()
    while e.has_unfinished():
        take(e.step())
    reference = engine().generate(PROMPTS[:2], sampling)
    assert [tokens[rid] for rid in ids] == [r.outputs[0].token_ids for r in reference]
    assert drained(e)


def test_async_scheduling_refuses_speculative_decoding_and_sync_outputs():
    from infer.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--async-scheduling does not combine with speculative decoding"):
        engine(async_scheduling=True, proposer="ngram", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="drop --no-async-output"):
        engine(async_scheduling=True, async_output=False)


def steps_ahead(e: Engine, rid: str) -> tuple[list[bool], dict[int, list[int]]]:
    """Step ``e`` until it is done: per step, whether it left tokens in flight (ran ahead); and the tokens of the
    n = 2 request ``rid``, per sequence."""
    ahead: list[bool] = []
    tokens: dict[int, list[int]] = {0: [], 1: []}
    while e.has_unfinished():
        for out in e.step():
            for c in out.outputs if out.request_id == rid else ():
                tokens[c.index] += c.token_ids
        ahead.append(e.in_flight is not None)
    return ahead, tokens


def test_an_n2_request_costs_async_scheduling_one_step():
    """Only the step in which the n = 2 request's first sequence samples (its children copy that token) runs
    synchronously; every other step runs ahead, leaving its tokens in flight."""
    e = engine(async_scheduling=True)
    for prompt in PROMPTS[:3]:
        e.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        e.step()
    rid = e.add_request(PROMPTS[3], SamplingParams(max_tokens=20, temperature=0.8, seed=1, n=2))
    ahead, tokens = steps_ahead(e, rid)
    assert ahead[0] is False and all(ahead[1:-1]) and ahead[-1] is False  # the fork step; the last drains
    reference = engine().generate(PROMPTS[3:4], SamplingParams(max_tokens=20, temperature=0.8, seed=1, n=2))[0]
    assert [tokens[0], tokens[1]] == [c.token_ids for c in reference.outputs]
    assert drained(e)


@pytest.mark.parametrize("mode", ["async_output", "async_scheduling"])
def test_async_stream_deltas_arrive_one_step_later_and_add_up(stops, mode):
    arrivals = {}  # per mode: the step at which each output token reached the stream
    texts = {}
    for options in ({"async_output": False}, {mode: True}):
        e = engine(**options)
        e.add_request(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), request_id="bg")
        steps, text = [], ""
        for delta in e.stream(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, stop=stops)):
            text += delta.outputs[0].text if delta.outputs else ""
            steps += [e.steps_taken] * len(delta.outputs[0].token_ids if delta.outputs else [])
        while e.has_unfinished():
            assert e.step() or e.unemitted == []  # the last deltas come out of a step that schedules nothing
        assert drained(e)
        arrivals[len(arrivals)], texts[len(texts)] = steps, text
    assert texts[1] == texts[0] and len(arrivals[1]) == len(arrivals[0]) > 3
    assert arrivals[1] == [step + 1 for step in arrivals[0]]  # every token, one step later


def test_async_abort_while_outputs_are_pending_frees_everything():
    e = engine(async_output=True)
    ids = [e.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    tokens, text, seq = [], "", e.requests[ids[0]].seqs[0]
    for _ in range(4):
        for out in e.step():
            if out.request_id == ids[0]:
                tokens, text = tokens + out.outputs[0].token_ids, text + out.outputs[0].text
    assert e.unemitted  # the last step's outputs are still to be built
    final = e.abort(ids[0])  # they come in the abort's output, with its own
    assert final.finished and final.outputs[0].finish_reason is FinishReason.ABORT
    tokens, text = tokens + final.outputs[0].token_ids, text + final.outputs[0].text
    assert tokens == seq.output_token_ids and len(tokens) == 4
    assert text == e.tokenizer.decode(tokens, skip_special_tokens=True)
    while e.has_unfinished():
        for output in e.step():
            assert output.request_id != ids[0]
    assert drained(e)


# Regressions from a review: a sequence cut by a stop string in the deferred emit is still in that step's batch.
def test_a_stop_string_finish_while_an_n2_request_waits_to_fork():
    prompts, ps = PROMPTS[:2], [SamplingParams(max_tokens=40, temperature=0.0, stop=["\n"]),
                                SamplingParams(max_tokens=5, temperature=0.8, seed=1, n=2)]
    runs = [engine(async_output=mode, max_num_seqs=2).generate(prompts, ps) for mode in (False, True)]
    assert completions(runs[1]) == completions(runs[0])


def test_each_sequence_finishes_once_in_the_stream():
    e = engine(async_output=True)
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.9, seed=3, n=3, stop=["\n"]))
    finishes = []
    while e.has_unfinished():
        finishes += [c.index for out in e.step() for c in out.outputs if c.finish_reason is not None]
    assert sorted(finishes) == [0, 1, 2]


def test_unseeded_draws_and_speculation_counters_match_the_sync_path():
    ps = [SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"]), SamplingParams(max_tokens=20, temperature=1.0),
          SamplingParams(max_tokens=20, temperature=1.0)]  # the first is cut early; the others draw from the engine
    runs = [engine(async_output=mode).generate(PROMPTS[:3], ps) for mode in (False, True)]
    assert completions(runs[1]) == completions(runs[0])
    stats = []
    for mode in (False, True):
        e = engine(async_output=mode, proposer="draft-model", num_speculative_tokens=2)
        e.generate(PROMPTS[:4], SamplingParams(max_tokens=40, temperature=0.0, stop=["\n", " ("]))
        stats.append((e.stats.spec_rounds, e.stats.spec_proposed, e.stats.spec_accepted, e.stats.spec_emitted))
    assert stats[1] == stats[0]


def test_abort_after_a_stop_string_was_sampled_returns_the_stop():
    e = engine(async_output=True)
    rid = e.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, stop=["\n"]))
    seq, text = e.requests[rid].seqs[0], ""
    while "\n" not in e.tokenizer.decode(seq.output_token_ids):  # the step that samples the stop string
        text += "".join(c.text for out in e.step() for c in out.outputs)
    final = e.abort(rid)  # its outputs are still pending: the stop string is found first
    assert final.finished and final.outputs[0].finish_reason is FinishReason.STOP
    text += final.outputs[0].text
    expected = engine(async_output=False).generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0.0,
                                                                               stop=["\n"]))[0].outputs[0].text
    assert text == expected and "\n" not in text and drained(e)


@pytest.mark.parametrize(("device", "options", "expected"), [
    ("cuda", {}, True), ("cpu", {}, False), ("cuda", {"proposer": "ngram", "num_speculative_tokens": 2}, False),
    ("cuda", {"async_output": False}, False), ("cpu", {"async_scheduling": True}, True),
    ("cuda", {"async_scheduling": False}, False)])
def test_async_scheduling_defaults_on_with_cuda_only_where_it_can_run(device, options, expected):
    """Measured on an H200 (docs/PERF.md), so on by default there; never chosen where it would be refused."""
    assert EngineConfig(model="m", **options).validate().async_scheduling_on(device) is expected


@pytest.mark.parametrize("mode", ["async_output", "async_scheduling"])
def test_the_scheduler_is_updated_with_live_sequences_only(stops, mode):
    """Scheduler.update's contract (core/interfaces.py): its ``output`` is what schedule returned, less the
    sequences the engine finished in between (a stop string found in the outputs built during the forward pass, a
    stop token read back a step late), so every sequence in it is live. The shipped scheduler skips finished ones
    itself, which hid a schedule passed on whole."""
    e = engine(**{mode: True})
    schedule, update = e.scheduler.schedule, e.scheduler.update
    scheduled: list[set[int]] = []
    left_out, finished_in_update = [], []

    def recording_schedule():
        out = schedule()
        scheduled.append({item.seq.seq_id for item in out.scheduled})
        return out

    def checking_update(out, sampled, now):
        given = {item.seq.seq_id for item in out.scheduled}
        left_out.append(scheduled[-1] - given)
        finished_in_update.extend(item.seq.seq_id for item in out.scheduled if item.seq.is_finished)
        return update(out, sampled, now)

    e.scheduler.schedule, e.scheduler.update = recording_schedule, checking_update
    outputs = e.generate(PROMPTS, params(stops))
    assert completions(outputs) == completions(engine(async_output=False).generate(PROMPTS, params(stops)))
    assert any(left_out) and not finished_in_update  # some were finished in between, and none was passed on
    assert drained(e)


def test_an_n2_request_in_chunked_prefill_costs_async_scheduling_one_step():
    """An n = 2 request whose prompt takes several chunks: only the step of its last chunk (its first sequence
    samples there, and the children copy that token) runs synchronously, not every step while the fork is pending."""
    options = {"scheduler": "chunked-prefill", "max_num_batched_tokens": 16}
    e = engine(async_scheduling=True, **options)
    for prompt in PROMPTS[:2]:
        e.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(2):
        e.step()
    prompt = list(range(100, 160))  # 60 tokens: 4 chunks or more beside the two decodes
    sampling = SamplingParams(max_tokens=8, temperature=0.8, seed=1, n=2, ignore_eos=True)
    rid = e.add_request(prompt, sampling)
    ahead, tokens = steps_ahead(e, rid)
    assert ahead.index(False) >= 3 and ahead[:-1].count(False) == 1, ahead  # the fork step; the last drains
    reference = engine(**options).generate([prompt], sampling)[0]
    assert [tokens[0], tokens[1]] == [c.token_ids for c in reference.outputs]
    assert drained(e)


def test_async_scheduling_times_a_token_when_it_is_read_back():
    """A token exists on the host only when the step after its launch reads it back: its time (TTFT's first token,
    TPOT's token times) is taken then, not at the launch."""
    e = engine(async_scheduling=True)
    rid = e.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seq = e.requests[rid].seqs[0]
    launched = []
    while e.has_unfinished():
        e.step()
        launched.append(time.perf_counter())  # this step's token (if any) is still in flight now
    assert len(seq.token_times) == 3 and seq.first_token_time == seq.token_times[0]
    for i, at in enumerate(seq.token_times):  # token i was launched in step i, read back in step i + 1
        assert launched[i] < at <= launched[i + 1]
    assert drained(e)


def test_async_scheduling_recovers_from_a_ctrl_c_before_the_update_placed_its_pending_tokens():
    """A Ctrl-C as the scheduler's update starts: the step's tokens are in flight, but their PENDING places were
    never appended. The next step's read-back skips them (their sequences run that step again): another stream
    still gets every token of an uninterrupted run."""
    e = engine(async_scheduling=True)
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    update, interrupted = e.scheduler.update, []

    def ctrl_c_then_update(out, sampled, now):
        if not interrupted and e.steps_taken == 4:
            interrupted.append(True)
            raise KeyboardInterrupt
        return update(out, sampled, now)

    e.scheduler.update = ctrl_c_then_update
    driver, watched = e.stream(PROMPTS[0], sampling), e.stream(PROMPTS[1], sampling)
    with pytest.raises(KeyboardInterrupt):
        for _ in driver:
            pass
    tokens = [t for out in watched for t in out.outputs[0].token_ids]
    assert interrupted and tokens == engine().generate(PROMPTS[1:2], sampling)[0].outputs[0].token_ids
    assert drained(e)
