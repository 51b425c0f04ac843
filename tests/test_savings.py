"""The opt-in savings of the fast step (issue 25): a sparse self-conditioning embedding (`soft_top_k`) against a
direct softmax @ E, settled positions left out (`skip_settled`) against an independent replay of the rule, and
their FLOP accounting."""

import json

import pytest
import torch

import dgemma
import dgemma.engine.runner as engine_module  # the model runner calls the fused step
import dgemma.sampling.fused as fused
from dgemma.bench.flops import diffusion_flops, saved_flops
from dgemma.errors import SamplingParamsError
from dgemma.sampling import SamplingParams
from dgemma.sampling.fused import num_uniforms, vocab_step


def _setup(n=24, h=32, v=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, emb = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.4
    inv_t = 1.0 / (0.3 + torch.rand(n, generator=g))
    logits = torch.tanh((hidden @ emb.T) / 30.0) * 30.0 * inv_t[:, None]  # the head, written out
    return hidden, emb, inv_t, logits, torch.rand(n, num_uniforms(v, 256), generator=g)


def test_sparse_soft_embedding_with_the_whole_vocabulary_is_the_dense_one():
    hidden, emb, inv_t, logits, u = _setup()
    out = vocab_step(hidden, emb, 30.0, 32**0.5, inv_t, u, chunk=256, top_k=emb.shape[0])
    assert (out.signal - torch.softmax(logits, -1) @ emb * 32**0.5).abs().max() < 1e-4


def test_sparse_soft_embedding_is_the_renormalised_top_k():
    hidden, emb, inv_t, logits, u = _setup()
    dense = vocab_step(hidden, emb, 30.0, 2.0, inv_t, u, chunk=256)
    out = vocab_step(hidden, emb, 30.0, 2.0, inv_t, u, chunk=256, top_k=5)
    vals, ids = logits.topk(5, dim=-1)
    want = (torch.softmax(vals, -1)[:, :, None] * emb[ids]).sum(1) * 2.0
    assert (out.signal - want).abs().max() < 1e-4
    # the rest of the step does not depend on how the signal is formed
    assert torch.equal(out.argmax, dense.argmax) and torch.equal(out.sample, dense.sample)
    assert torch.equal(out.entropy, dense.entropy)


@pytest.fixture(scope="module")
def demo():
    return dgemma.load()


def _ids(model, **kw):
    return model.generate("It is a truth universally acknowledged", max_new_tokens=48, seed=3, **kw).token_ids


def test_a_threshold_never_reached_gives_the_defaults_exactly(demo):
    assert _ids(demo, skip_settled=10_000) == _ids(demo)


def _replay(steps, n):
    """The settled rule on the recorded outputs of one canvas: position j is left out of step s once, on each of
    the n steps before s (the canvas's first step excluded), it was accepted, its token did not change and its
    argmax equalled the step before's."""
    run, expected = torch.zeros_like(steps[0]["canvas"]), []
    for s, st in enumerate(steps):
        expected.append(run >= n)
        if s > 0:
            prev = steps[s - 1]
            same = st["accepted"] & (st["canvas"] == prev["canvas"]) & (st["argmax"] == prev["argmax"])
            run = torch.where(same, run + 1, 0)
    return expected


@pytest.mark.parametrize("n, reuse_kv", [(1, False), (3, False), (1, True)])
def test_skipped_positions_are_exactly_the_settled_ones(demo, monkeypatch, n, reuse_kv):
    steps, rows, body = [], [], []
    real_step, real_vocab, real_denoise = engine_module.fast_step, fused.vocab_step, demo.module.denoise

    def recording_step(hidden, *args, reuse=None, **kw):
        out, signal = real_step(hidden, *args, reuse=reuse, **kw)
        skip = torch.zeros(hidden.shape[:2], dtype=torch.bool) if reuse is None else reuse.skip
        steps.append({"canvas": out.canvas[0], "argmax": out.argmax[0], "accepted": out.accepted[0],
                      "entropy": out.entropy[0], "skip": skip[0].clone()})
        return out, signal

    def counting_vocab(hidden, *args, **kw):
        rows.append(hidden.shape[0])
        return real_vocab(hidden, *args, **kw)

    def recording_denoise(canvas, cache, signal=None, keep=None, **kw):
        body.append(list(range(canvas.shape[1])) if keep is None else keep[0].tolist())
        return real_denoise(canvas, cache, signal, keep=keep, **kw)

    monkeypatch.setattr(engine_module, "fast_step", recording_step)
    monkeypatch.setattr(fused, "vocab_step", counting_vocab)
    monkeypatch.setattr(demo.module, "denoise", recording_denoise)
    c = demo.module.cfg.canvas_length
    res = demo.generate("Once upon a time", max_new_tokens=c, seed=1, skip_settled=n, max_denoising_steps=40,
                        eos_token_ids=(), settled_kv_reuse=reuse_kv or None)
    expected = _replay(steps, n)
    # the body ran on every position, or (settled_kv_reuse) on the unsettled ones (one, if all had settled)
    assert body == [list(range(c)) if not reuse_kv else ((~e).nonzero().squeeze(1).tolist() or [0])
                    for e in expected]
    assert [e.tolist() for e in expected] == [st["skip"].tolist() for st in steps]
    assert sum(int(e.sum()) for e in expected) > 0  # the canvas did settle
    assert rows == [c - int(e.sum()) for e in expected]  # the head ran on the others only
    for prev, st in zip(steps, steps[1:]):  # a left-out position keeps its token and draft, accepted, certain
        skip = st["skip"]
        assert bool((st["entropy"][skip] == 0).all())
        assert torch.equal(st["canvas"][skip], prev["canvas"][skip]) and bool(st["accepted"][skip].all())
        assert torch.equal(st["argmax"][skip], prev["argmax"][skip])
    assert res.stats["skipped_head_rows"] == sum(int(e.sum()) for e in expected)


@pytest.mark.parametrize("options", [{"soft_top_k": 4}, {"skip_settled": 1}, {"skip_settled": 2, "soft_top_k": 16},
                                     {"skip_settled": 1, "settled_kv_reuse": True}])
def test_outputs_with_the_savings_on_are_valid(demo, options):
    vocab = demo.module.cfg.text.vocab_size
    results = demo.generate(["Once upon a time", "The sea"], max_new_tokens=40, seed=5, **options)
    for r in results:
        assert 0 < len(r.token_ids) <= 40 and all(0 <= t < vocab for t in r.token_ids)
        assert r.finish_reason in ("stop", "length") and isinstance(r.text, str)
    if "soft_top_k" in options:
        assert all(r.stats["sparse_soft_rows"] > 0 for r in results)
    if "settled_kv_reuse" in options:
        assert all(r.stats["skipped_body_rows"] > 0 for r in results)


def test_saved_flops_counts_each_left_out_row(demo):
    cfg = demo.module.cfg
    h, v = cfg.text.hidden_size, cfg.text.vocab_size
    stats = {"skipped_head_rows": 3, "skipped_soft_rows": 2, "sparse_soft_rows": 5}
    assert saved_flops(cfg, stats, 8) == 2 * h * v * 5 + 2 * h * (v - 8) * 5
    assert saved_flops(cfg, {"skipped_head_rows": 0, "skipped_soft_rows": 0, "sparse_soft_rows": 0}, None) == 0
    t, c = cfg.text, cfg.canvas_length
    pass_flops = diffusion_flops(cfg, 10, [2])["total"] - diffusion_flops(cfg, 10, [1])["total"]  # one more pass
    per_row = (pass_flops - 2 * c * h * v - 2 * c * h * v) / c  # less its head and soft embedding, per position
    assert saved_flops(cfg, {"skipped_body_rows": 4}, None, 10) == pytest.approx(4 * per_row)
    # early_commit_cache encoding a last canvas costs about that canvas's commit (which the FLOP model leaves out)
    second_step = diffusion_flops(cfg, 10 + c, [1])["total"] - diffusion_flops(cfg, 10 + c, [])["total"]
    commit = diffusion_flops(cfg, 10, [1, 1])["total"] - diffusion_flops(cfg, 10, [1])["total"] - second_step
    assert saved_flops(cfg, {"encoded_early": c}, None, 10) == pytest.approx(-commit, rel=0.05)


@pytest.mark.parametrize("options,param", [({"soft_top_k": 0}, "soft_top_k"), ({"skip_settled": 0}, "skip_settled"),
                                           ({"skip_settled": True}, "skip_settled"),
                                           ({"settled_kv_reuse": True}, "settled_kv_reuse"),
                                           ({"settled_kv_reuse": 1, "skip_settled": 1}, "settled_kv_reuse")])
def test_bad_values_name_their_parameter(options, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**options)
    assert e.value.param == param


def test_reference_sampling_refuses_the_savings(demo):
    with pytest.raises(SamplingParamsError) as e:
        demo.generate("Once", max_new_tokens=4, sampling="reference", soft_top_k=8)
    assert e.value.param == "soft_top_k"


def test_the_cli_takes_the_savings_and_refuses_bad_values(capsys):
    from dgemma.cli import main

    assert main(["generate", "Hello", "--max-new-tokens", "8", "--seed", "0", "--json", "--soft-top-k", "4",
                 "--skip-settled", "1"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["sparse_soft_rows"] > 0  # the flag reached the engine
    assert main(["generate", "Hello", "--soft-top-k", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--soft-top-k" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("prompt_len", [9, 200])  # 200: past the sliding layers' ring (window 128 + canvas)
def test_a_pass_over_some_positions_reuses_the_others_keys_exactly(prompt_len):
    """After a full pass over a canvas, a pass over a subset of the same canvas (same signal) sees the others'
    keys and values as that pass left them, which are exact here: its positions' hidden states equal the full
    pass's, on per-row caches (rows keeping different positions) and on one shared cache."""
    module = dgemma.load(dtype="float32").module
    c, vocab = module.cfg.canvas_length, module.cfg.text.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (2, prompt_len), generator=g)
    canvas = torch.randint(3, vocab, (2, c), generator=g)
    signal = torch.randn(2, c, module.cfg.text.hidden_size, generator=g)
    keep = torch.stack([torch.arange(0, c, 3)[:8], torch.arange(1, c, 2)[:8]])
    room = prompt_len + c
    for caches in ([module.new_cache(1, room) for _ in range(2)], module.new_cache(2, room)):
        module.prefill(prompts, caches)
        full = module.denoise(canvas, caches, signal)
        some = module.denoise(canvas, caches, signal, keep=keep)
        want = full.gather(1, keep[..., None].expand(-1, -1, full.shape[-1]))
        assert some.shape == want.shape and (some - want).abs().max() < 1e-4
        other = module.denoise(canvas.roll(1, 1), caches, signal, keep=keep)  # the kept inputs matter
        assert (other - want).abs().max() > 1e-2
