"""Early commit into the cache (`early_commit_cache`, issue 25): a canvas's frozen prefix is encoded into the row's
cache while the canvas denoises, so the passes after it are narrower. The cache then holds what a plain commit of
the same final ids gives (recomputed here by an independent prefill and encode), the committed text never changes,
passes really shrink, a row's output does not depend on its batch-mates' frozen lengths, and off is exactly off."""

import pytest
import torch

import dgemma
from dgemma.api import DEMO_MODEL
from dgemma.engine import Engine
from dgemma.sampling import SamplingParams, SamplingParamsError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model():
    return dgemma.load(DEMO_MODEL, dtype="float32")


def _params(model, seed=1, **kw):
    return model.defaults.replace(**{"max_new_tokens": 96, "seed": seed, "early_commit": 1, "early_commit_cache": True}
                                  | kw)


def _spy(monkeypatch, model, name):
    """Record (width, hide) of every model.denoise call, or the ids of every model.encode call."""
    calls, real = [], getattr(model.module, name)

    def spy(ids, *args, **kw):
        calls.append((ids.shape[1], kw.get("hide")) if name == "denoise" else ids.tolist())
        return real(ids, *args, **kw)

    monkeypatch.setattr(model.module, name, spy)
    return calls


def _run(model, params_list, row_clocks=True):
    engine = Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id, row_clocks=row_clocks)
    ids = model.encode_prompt(PROMPT)
    reqs = [engine.add_request(ids, p) for p in params_list]
    commits = {r.id: [] for r in reqs}
    for ev in engine.stream():
        if ev.kind == "commit":
            commits[ev.request_id].append(ev)
    return reqs, [commits[r.id] for r in reqs]


@pytest.mark.parametrize("row_clocks", [True, False])
def test_committed_text_never_changes_and_is_what_was_streamed(model, row_clocks):
    (req,), (events,) = _run(model, [_params(model)], row_clocks)
    assert any(not e.ends_canvas and e.token_ids for e in events)
    assert [t for e in events for t in e.token_ids] == req.output
    assert req.stats.skipped_body_rows > 0  # the prefix did move into the cache


def test_the_cache_holds_what_a_plain_commit_of_the_final_ids_gives(model, monkeypatch):
    """After a canvas that moved part of its prefix early (the rest encoded at its commit) the row's cache equals,
    slot for slot and layer by layer, a fresh prefill of the prompt followed by one encode of the ids committed."""
    encodes = _spy(monkeypatch, model, "encode")
    engine = Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id)
    prompt = model.encode_prompt(PROMPT)
    req = engine.add_request(prompt, _params(model, max_new_tokens=200))
    c, moved = model.module.cfg.canvas_length, 0
    while not moved:
        canvases = len(req.stats.steps_per_canvas)
        engine.step()
        moved = req.moved if len(req.stats.steps_per_canvas) > canvases else 0
    engine.step()  # the turnover encodes what the commit left, then the next canvas's first pass runs
    assert len(req.output) % c == 0 and not req.finished
    assert len(encodes) >= 2 and [t for ids in encodes for t in ids[0]] == req.output  # moved early, then the rest
    cache = engine.batch.caches[0]
    plain = model.module.new_cache(1, len(prompt) + len(req.output) + c)
    model.module.prefill(torch.tensor([prompt]), plain)
    model.module.encode(torch.tensor([req.output]), plain)
    n = len(req.output)
    assert cache.positions[:, :len(prompt) + n].tolist() == plain.positions[:, :len(prompt) + n].tolist()
    for layer in range(model.module.cfg.text.num_hidden_layers):
        for got, want in zip(cache.read(layer, len(prompt), n), plain.read(layer, len(prompt), n)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_passes_shrink_by_the_moved_prefix(model, monkeypatch):
    """The option's passes are narrower than the canvas by exactly the positions counted as left out of the body;
    early commit alone runs every pass over the whole canvas."""
    c = model.module.cfg.canvas_length
    plain = _spy(monkeypatch, model, "denoise")
    _run(model, [_params(model, early_commit_cache=None)])
    assert {w for w, _ in plain} == {c}
    monkeypatch.undo()
    moved = _spy(monkeypatch, model, "denoise")
    (req,), _ = _run(model, [_params(model)])
    assert min(w for w, _ in moved) < c
    assert sum(c - w for w, _ in moved) == req.stats.skipped_body_rows > 0
    assert all(not any(h or ()) for _, h in moved)  # alone, a row never hides positions


def test_off_is_early_commit_alone(model):
    (plain, off), _ = _run(model, [_params(model, early_commit_cache=None), _params(model, early_commit_cache=False)])
    (alone,), _ = _run(model, [_params(model, early_commit_cache=None)])
    assert plain.output == off.output == alone.output
    assert off.stats.skipped_body_rows == 0


def test_batched_rows_with_different_frozen_lengths_match_their_runs_alone(model, monkeypatch):
    """Rows that freeze at different rates (and one without the option) batched together give each the ids it gives
    alone: the pass starts at the smallest moved prefix, a row that moved more hides the rest from its canvas."""
    params = [_params(model, seed=1), _params(model, seed=2, early_commit=3), model.defaults.replace(
        max_new_tokens=96, seed=4), _params(model, seed=5)]
    alone = [_run(model, [p])[0][0].output for p in params]
    passes = _spy(monkeypatch, model, "denoise")
    reqs, events = _run(model, params)
    assert [r.output for r in reqs] == alone
    assert all([t for e in ev for t in e.token_ids] == r.output for r, ev in zip(reqs, events))
    assert any(h and len(set(h)) > 1 for _, h in passes)  # some pass had rows with different hidden counts


def test_refused_without_early_commit(model, capsys):
    for bad in ({"early_commit_cache": True}, {"early_commit_cache": 1, "early_commit": 2},
                {"early_commit_cache": True, "early_commit": 2, "skip_settled": 1, "settled_kv_reuse": True}):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**bad)
        assert e.value.param == "early_commit_cache"
    from dgemma.cli import main

    assert main(["generate", PROMPT, "--max-new-tokens", "8", "--early-commit-cache"]) != 0
    err = capsys.readouterr().err.strip()
    assert "early_commit_cache needs early_commit" in err and len(err.splitlines()) == 1
