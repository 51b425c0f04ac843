"""The engines' contracts: per-request EOS, the reference engine's fixed batch, one host read per denoising step,
tensors and generators made on the model's device, autoregressive decoding through the same interface."""

import pytest
import torch

import dgemma
import dgemma.sampling.fused as fused
from dgemma.engine import AutoregressiveEngine, Engine, ReferenceEngine
from dgemma.errors import ConfigError
from dgemma.instruments import Recorder
from dgemma.sampling import SamplingParams
from reference import build_reference


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    build_reference("c", d, spread=0.2, embed=10)  # mild weights: rounding does not flip routing
    return dgemma.load(d)


def _prompt(model, n=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.module.cfg.text.vocab_size, (n,), generator=g).tolist()


def test_commit_pads_with_the_requests_eos_not_the_engines(model):
    """A token that is the engine's default EOS but not the request's must not cut the cached canvas: the
    request's output is the same whatever the engine's default is."""
    c = model.module.cfg.canvas_length
    params = SamplingParams(max_new_tokens=3 * c, seed=3, eos_token_ids=(), confidence_threshold=1e-30)
    free = Engine(model.module, ()).generate([_prompt(model)], params)[0].output
    assert len(free) == 3 * c
    other_eos = free[1]  # in the first canvas, not an EOS of the request
    got = Engine(model.module, (other_eos,)).generate([_prompt(model)], params)[0].output
    assert got == free


def test_request_eos_overrides_the_engines(model):
    c = model.module.cfg.canvas_length
    params = SamplingParams(max_new_tokens=2 * c, seed=5, eos_token_ids=())
    free = Engine(model.module, ()).generate([_prompt(model)], params)[0].output
    eos = free[c + 1]
    req = Engine(model.module, ()).generate([_prompt(model)], params.replace(eos_token_ids=(eos,)))[0]
    assert req.finish_reason == "stop" and req.output == free[:free.index(eos)]


def test_reference_runner_refuses_mixed_parameters_and_late_joins(model):
    runner = ReferenceEngine(model.module, (1,))
    runner.add_request(_prompt(model), SamplingParams(max_new_tokens=4, seed=1))
    with pytest.raises(ConfigError, match="one set of sampling parameters"):
        runner.add_request(_prompt(model, seed=4), SamplingParams(max_new_tokens=4, seed=1, entropy_bound=0.5))
    runner.add_request(_prompt(model, seed=4), SamplingParams(max_new_tokens=4, seed=1))
    next(runner.stream())
    with pytest.raises(ConfigError, match="cannot join"):
        runner.add_request(_prompt(model), SamplingParams(max_new_tokens=4, seed=1))


def _denoise_step_reads(engine, monkeypatch) -> list[list[str]]:
    """Host reads of each step that neither starts nor ends a canvas, with the accelerator's vocabulary step."""
    monkeypatch.setattr(fused, "sync_free_default", lambda device: True)
    per_step = []
    while engine.has_work():
        mid_canvas = engine.batch is not None and engine.batch.canvas is not None
        with Recorder() as rec:
            events = engine.step()
        if mid_canvas and not any(e.kind == "commit" for e in events):
            per_step.append(rec.reads)
    return per_step


def test_a_denoising_step_reads_the_host_once(model, monkeypatch):
    engine = Engine(model.module, ())
    for seed in (1, 2):
        engine.add_request(_prompt(model, seed=seed), SamplingParams(max_new_tokens=12, seed=seed, eos_token_ids=()))
    reads = _denoise_step_reads(engine, monkeypatch)
    assert len(reads) >= 3
    assert max(len(r) for r in reads) <= 1, reads


def test_step_tensors_and_generators_are_made_on_the_models_device(model, monkeypatch):
    """Every tensor the engines make names its device, and every generator is made for the model's device (an
    autoregressive generator made on the CPU crashed CUDA sampling)."""
    import dgemma.engine.base as runner

    devices = []
    real = runner.make_generator
    monkeypatch.setattr(runner, "make_generator", lambda seed, device=None: (devices.append(device),
                                                                             real(seed, device))[1])
    with Recorder() as rec:
        model.generate(_prompt(model), max_new_tokens=8, seed=1)
        model.generate(_prompt(model), mode="autoregressive", max_new_tokens=3, ar_temperature=1.0, seed=1)
        model.generate(_prompt(model), sampling="reference", max_new_tokens=8, seed=1)
    assert len(devices) == 2 and all(d == model.module.device for d in devices)
    assert rec.no_device == []


def test_autoregressive_engine_serves_requests_in_turn(model):
    """Two requests through the engine interface equal each decoded alone; an abort ends one, not the other."""
    params = SamplingParams(max_new_tokens=5, eos_token_ids=())
    alone = [AutoregressiveEngine(model.module, ()).generate([p], params)[0].output
             for p in (_prompt(model), _prompt(model, seed=4))]
    engine = AutoregressiveEngine(model.module, ())
    a, b = engine.add_request(_prompt(model), params), engine.add_request(_prompt(model, seed=4), params)
    assert [a.output, b.output] == [[], []] and engine.num_running == 0
    engine.step()
    engine.abort(a.id)
    for _ in engine.stream():
        pass
    assert a.finish_reason == "abort" and a.output == alone[0][:1]
    assert b.finish_reason == "length" and b.output == alone[1]


@pytest.mark.slow
def test_compiled_denoising_gives_the_same_tokens(tmp_path):
    """`load(compile=True)` (`--compile`): the denoising pass through torch.compile, same tokens as eager over
    several canvases (the grouped experts take their compile-safe path)."""
    build_reference("c", tmp_path, spread=0.2, embed=10)
    eager, compiled = dgemma.load(tmp_path), dgemma.load(tmp_path, compile=True)
    c = eager.module.cfg.canvas_length
    prompt = _prompt(eager)
    assert compiled.module.denoise is not eager.module.denoise
    expected = eager.generate(prompt, max_new_tokens=3 * c, seed=1).token_ids
    assert compiled.generate(prompt, max_new_tokens=3 * c, seed=1).token_ids == expected
