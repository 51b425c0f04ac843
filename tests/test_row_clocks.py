"""Rows on their own clocks (bundled trained model, float32, fixed seeds): a request's ids in a busy batch, with a
request joining at every step, equal its ids decoded alone; a short request beside one that takes many more steps
finishes after as many engine steps as alone; no decoder pass carries a row whose canvas is done. The batch-wide
engine (`row_clocks=False`) gives the same ids, but its short request waits for the slow one."""

import pytest
import torch

import dgemma
from dgemma.engine import Engine
from dgemma.sampling import Grammar, SamplingParams


@pytest.fixture(scope="module")
def demo():
    return dgemma.load(dtype="float32")


def _ids(demo, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, demo.module.cfg.text.vocab_size, (n,), generator=g).tolist()


def _engine(demo, row_clocks=True):
    engine = Engine(demo.module, demo.defaults.eos_token_ids, demo.pad_id, max_batch=16, row_clocks=row_clocks)
    engine.grammar_vocab = demo.grammar_vocab
    return engine


def _requests(demo):
    """(prompt, params): lengths, budgets and step caps that end canvases at different steps; a grammar, logprobs."""
    base = demo.defaults
    return [(_ids(demo, 5 + 3 * i, i), base.replace(seed=i, max_new_tokens=24 + 16 * (i % 3),
                                                    max_denoising_steps=(4, 12, 32)[i % 3],
                                                    logprobs=2 if i == 4 else None,
                                                    grammar=Grammar.regex("[a-z ]{3,40}") if i == 5 else None))
            for i in range(7)]


def _alone(demo, prompt, params):
    """(ids, finish reason, engine steps until it finished) of a request decoded alone."""
    engine = _engine(demo)
    req = engine.add_request(prompt, params)
    steps = _steps_until_finished(engine, req)
    return req.output, req.finish_reason, steps


def _steps_until_finished(engine, req) -> int:
    steps = 0
    while not req.finished:
        engine.step()
        steps += 1
    return steps


@pytest.mark.parametrize("row_clocks", [True, False])
def test_ids_in_a_busy_batch_with_joins_at_every_step_equal_alone(demo, row_clocks):
    requests = _requests(demo)
    engine, reqs = _engine(demo, row_clocks), []
    for prompt, params in requests:  # one more joins before every step
        reqs.append(engine.add_request(prompt, params))
        engine.step()
    while engine.has_work():
        engine.step()
    for (prompt, params), req in zip(requests, reqs):
        output, reason, _ = _alone(demo, prompt, params)
        assert (req.output, req.finish_reason) == (output, reason)
    assert (engine.stats.done_rows == 0) == row_clocks  # batch-wide: done rows ride along


def test_a_short_request_keeps_its_own_clock(demo):
    """Beside a request that takes ~10x more steps, the short one finishes after as many engine steps as alone
    with row clocks; batch-wide, it waits for the slow one's canvases."""
    base = demo.defaults.replace(eos_token_ids=())
    short = (_ids(demo, 6, 1), base.replace(seed=1, max_new_tokens=32, max_denoising_steps=3))
    slow = (_ids(demo, 8, 2), base.replace(seed=2, max_new_tokens=64, max_denoising_steps=32,
                                           confidence_threshold=1e-30))
    _, _, alone = _alone(demo, *short)
    for row_clocks in (True, False):
        engine = _engine(demo, row_clocks)
        s, _ = engine.add_request(*short), engine.add_request(*slow)
        steps = _steps_until_finished(engine, s)
        assert (steps == alone) == row_clocks, (steps, alone)


def test_a_long_prompt_is_prefilled_a_chunk_per_step_beside_running_rows(demo):
    """A prompt of three prefill chunks joins a running request: it is encoded one chunk per step while the other
    row keeps denoising, and both get their ids alone; the batch-wide engine, which encodes it whole, agrees."""
    from dgemma.model.diffusion_gemma import PREFILL_CHUNK

    base = demo.defaults.replace(eos_token_ids=())
    short = (_ids(demo, 6, 1), base.replace(seed=1, max_new_tokens=64, max_denoising_steps=8))
    long = (_ids(demo, 2 * PREFILL_CHUNK + 40, 2), base.replace(seed=2, max_new_tokens=40, max_denoising_steps=6))
    engine = _engine(demo)
    s = engine.add_request(*short)
    engine.step()
    r = engine.add_request(*long)
    passes = []
    while r not in engine.batch.rows:
        engine.step()
        passes.append(s.stats.decoder_passes)
    assert len(passes) == 3 and passes == list(range(passes[0], passes[0] + 3))
    while engine.has_work():
        engine.step()
    whole = _engine(demo, row_clocks=False).generate([long[0]], long[1])[0].output
    assert r.output == _alone(demo, *long)[0] == whole and s.output == _alone(demo, *short)[0]
