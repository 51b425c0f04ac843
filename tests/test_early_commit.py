"""Early commit and early stop (issue 25): a committed prefix never changes (every streamed commit is part of the
final output), text arrives before its canvas ends, rows without the options are untouched (the same ids as the
defaults, alone or batched beside early rows), logprobs compose, what cannot compose is refused, and the server's
stream carries content before the first canvas ends. With `early_commit_cache` the frozen prefix is encoded into the
row's cache while the canvas denoises: the cache then holds what a plain commit of the same final ids gives
(recomputed by an independent prefill and encode), passes really shrink, and a row's output does not depend on its
batch-mates' frozen lengths."""

import pytest
import torch

import dgemma
from dgemma.api import DEMO_MODEL
from dgemma.engine import Engine
from dgemma.sampling import Grammar, SamplingParams, SamplingParamsError
from server_fixtures import start_server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model():
    return dgemma.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def model32():
    """float32: the cache contents compare within float32's tolerance and batching changes no draw."""
    return dgemma.load(DEMO_MODEL, dtype="float32")


def _engine_run(model, params_list, row_clocks=True):
    """Run prompts through one Engine; returns (requests, each request's commit events in order)."""
    engine = Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id, row_clocks=row_clocks)
    ids = model.encode_prompt(PROMPT)
    reqs = [engine.add_request(ids, p) for p in params_list]
    commits = {r.id: [] for r in reqs}
    for ev in engine.stream():
        if ev.kind == "commit":
            commits[ev.request_id].append(ev)
    return reqs, [commits[r.id] for r in reqs]


@pytest.mark.parametrize("row_clocks", [True, False])
def test_early_commits_are_never_taken_back(model, row_clocks):
    """The ids sent early, then the canvas's rest, are exactly the request's output: what the final canvases
    committed agrees with every id sent before they ended. Some ids do go out early (ends_canvas False)."""
    params = model.defaults.replace(max_new_tokens=300, seed=1, early_commit=2)
    (req,), (events,) = _engine_run(model, [params], row_clocks)
    assert any(not e.ends_canvas and e.token_ids for e in events)
    assert [t for e in events for t in e.token_ids] == req.output
    assert sum(e.ends_canvas for e in events) == len(req.stats.steps_per_canvas) > 1


def test_streamed_text_is_a_prefix_of_the_final_text_and_comes_before_the_canvas_ends(model):
    shown, steps_at_first_text, steps = "", None, 0
    for ev in model.stream(PROMPT, max_new_tokens=64, seed=1, early_commit=2):
        if ev.kind == "draft":
            steps += 1
        elif ev.kind == "text" and ev.text:
            shown += ev.text
            steps_at_first_text = steps_at_first_text if steps_at_first_text is not None else steps
            assert ev.result is None
        elif ev.kind == "done":
            result = ev.result
    assert result.text.startswith(shown) and shown == result.text
    first_canvas = result.stats["steps_per_canvas"][0]
    assert steps_at_first_text is not None and steps_at_first_text < first_canvas // 2


def test_off_and_never_stable_give_the_defaults_ids(model):
    """A row whose prefix never freezes (N beyond the step budget) and a default row batched beside an early one
    get exactly the default's ids: the feature draws nothing and touches no other row."""
    base = model.defaults.replace(max_new_tokens=64, seed=3)
    (alone,), _ = _engine_run(model, [base])
    (never, plain, early), _ = _engine_run(model, [base.replace(early_commit=10_000), base,
                                                   base.replace(early_commit=1, seed=4)])
    assert never.output == alone.output == plain.output
    assert model.generate(PROMPT, max_new_tokens=64, seed=3).token_ids == alone.output


def test_logprobs_compose_with_early_commit(model):
    params = model.defaults.replace(max_new_tokens=64, seed=1, early_commit=1, logprobs=2)
    (req,), (events,) = _engine_run(model, [params])
    entries = [x for e in events for x in e.logprobs]
    assert [t for t, _, _ in entries] == req.output
    assert all(lp <= 0 and len(alts) == 2 and alts[0][1] >= lp for _, lp, alts in entries)


def test_early_stop_ends_canvases_on_confidence(model):
    """A threshold above any entropy ends every canvas after its first step; one below any (1e-30) never
    fires, so the ids are the defaults'."""
    base = model.defaults.replace(max_new_tokens=300, seed=2)
    (loose, tight, plain), _ = _engine_run(model, [base.replace(early_stop=1e9), base.replace(early_stop=1e-30),
                                                   base])
    assert set(loose.stats.steps_per_canvas) == {1} and len(loose.output) == 300
    assert tight.output == plain.output and tight.stats.steps_per_canvas == plain.stats.steps_per_canvas


def test_what_cannot_compose_is_refused(model):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(early_commit=2, grammar=Grammar.regex("[a-z]+"))
    assert e.value.param == "early_commit"
    for bad in ({"early_commit": 0}, {"early_commit": 1.5}, {"early_stop": -1.0}, {"early_stop": float("nan")},
                {"target_canvas_ms": 0}):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))
    for kw in ({"sampling": "reference"}, {"mode": "autoregressive"}):
        with pytest.raises(SamplingParamsError, match="early_commit (applies to diffusion decoding|needs the fast sampler)"):
            model.generate(PROMPT, max_new_tokens=4, early_commit=2, **kw)


def test_cli_flags(capsys):
    from dgemma.cli import main

    assert main(["generate", PROMPT, "--max-new-tokens", "8", "--seed", "1", "--early-commit", "2",
                 "--early-stop", "0.01", "--target-canvas-ms", "500", "--json"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    assert main(["generate", PROMPT, "--mode", "autoregressive", "--early-commit", "2"]) != 0
    assert "--early-commit applies to diffusion decoding" in capsys.readouterr().err


def test_server_streams_content_before_the_first_canvas_ends():
    """A streamed chat with early_commit: content chunks come while the first canvas still has draft steps to go;
    the same request without it sends its first content only when that canvas ends; with early_first_token the
    first content comes before the first denoising step's draft."""
    openai = pytest.importorskip("openai")
    s = start_server(DEMO_MODEL)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=32, seed=1, stream=True)
        for sampling, early in (({"early_commit": 2}, True), ({}, False), ({"early_first_token": True}, True)):
            chunks = list(client.chat.completions.create(**kw, extra_body={"dgemma_drafts": True,
                                                                             "dgemma_sampling": sampling}))
            kinds = [c.choices[0].model_extra["dgemma_draft"]["canvas"] if "dgemma_draft" in c.choices[0].model_extra
                     else "text" if c.choices[0].delta.content else None for c in chunks if c.choices]
            assert (0 in kinds[kinds.index("text"):]) is early  # a draft of the first canvas after the first text
            if "early_first_token" in sampling:  # the first text comes before the first step's draft
                assert kinds.index("text") < kinds.index(0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw | {"stream": False},
                                           extra_body={"dgemma_sampling": {"early_commit": 0}})
        assert e.value.body["param"] == "dgemma_sampling.early_commit"
    finally:
        s.stop()


def test_latency_target_picks_the_step_budget_from_the_measured_step_time(model):
    """With a measured step time of 1 s, a 2,500 ms target leaves a canvas 2 steps: the same ids as asking for 2
    steps (the budget is set after the first step, which runs at t_max under every schedule)."""
    base = model.defaults.replace(max_new_tokens=32, seed=5)
    engine = Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id)
    engine.step_seconds = 1.0
    req = engine.add_request(model.encode_prompt(PROMPT), base.replace(target_canvas_ms=2500.0))
    for _ in engine.stream():
        pass
    (two,), _ = _engine_run(model, [base.replace(max_denoising_steps=2)])
    assert req.stats.steps_per_canvas == [2] and req.output == two.output
    assert 0 < engine.step_seconds < 1.0
    # a fresh engine measures its first step, then budgets: a tiny target leaves one step per canvas after it
    result = model.generate(PROMPT, max_new_tokens=96, seed=5, target_canvas_ms=1e-3)
    assert result.stats["steps_per_canvas"] == [2, 1, 1]


def test_a_canvas_after_a_one_step_budget_starts_under_the_requests_own_cap(model, monkeypatch):
    """Each canvas's budget is chosen after its first step, which runs under the request's own step cap: after a
    canvas budgeted one step, the next canvas's first step still computes the self-conditioning signal its
    second step reads (it did not when the first step ran under the previous canvas's budget of one)."""
    import dgemma.engine.engine as engine_module
    import dgemma.engine.runner as runner_module

    wanted = []

    def spy(*args, **kwargs):
        wanted.append(kwargs["want_signal"])
        return fast_step(*args, **kwargs)

    fast_step = runner_module.fast_step
    monkeypatch.setattr(runner_module, "fast_step", spy)
    monkeypatch.setattr(engine_module, "measured", lambda previous, seconds: 0.5)  # every step: 0.5 s
    engine = Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id)
    engine.step_seconds = 1.0  # the first canvas is budgeted at 1 s a step: one step fits 1,500 ms
    req = engine.add_request(model.encode_prompt(PROMPT),
                             model.defaults.replace(max_new_tokens=64, seed=5, target_canvas_ms=1500.0))
    for _ in engine.stream():
        pass
    assert req.stats.steps_per_canvas == [1, 3]
    assert wanted == [True, True, True, False]  # only a canvas's last step has no reader for its signal


def test_a_call_that_runs_no_step_does_not_count_as_a_step_time(model):
    """An engine step that only drops an aborted row (a stop string, a client gone) runs no denoising step: the
    measured step time, which latency targets budget from, stays what the steps took."""
    engine = Engine(model.module, model.defaults.eos_token_ids or (), model.pad_id)
    req = engine.add_request(model.encode_prompt(PROMPT), model.defaults.replace(max_new_tokens=32, seed=5))
    engine.step()
    measured = engine.step_seconds
    assert measured is not None and measured > 0
    engine.abort(req.id)
    engine.step()
    assert engine.step_seconds == measured and not engine.has_work()


def test_the_frozen_prefix_rule_against_a_loop():
    """early_length / decided / stable_runs against the rule written position by position."""
    import torch

    from dgemma.sampling.early import decided, early_length, stable_runs

    g = torch.Generator().manual_seed(0)
    prev, argmax = torch.randint(0, 4, (64, 12), generator=g), torch.randint(0, 4, (64, 12), generator=g)
    accepted, run = torch.rand(64, 12, generator=g) < 0.8, torch.randint(0, 4, (64, 12), generator=g)
    need, limit = torch.randint(1, 4, (64,), generator=g), torch.randint(0, 13, (64,), generator=g)
    eos = torch.tensor([[3, -1]] * 32 + [[-1, -1]] * 32)
    old, run = run, stable_runs(prev, argmax, accepted, run)
    assert all(run[b, n] == (old[b, n] + 1 if argmax[b, n] == prev[b, n] and accepted[b, n] else 0)
               for b in range(64) for n in range(12))
    frozen = early_length(run, argmax, need, eos, limit)
    done = decided(run, argmax, need, eos, frozen, limit)
    for b in range(64):
        n = 0
        while n < 12 and run[b, n] >= need[b] and int(argmax[b, n]) not in eos[b].tolist():
            n += 1
        n = min(n, int(limit[b]))
        assert frozen[b] == n
        stable_eos = n < 12 and int(argmax[b, n]) in eos[b].tolist() and run[b, n] >= need[b]
        assert bool(done[b]) == (n >= limit[b] or stable_eos)


def test_stop_strings_cut_early_text(model):
    """A stop string inside early-committed text ends the answer there, as it does in whole canvases."""
    full = model.generate(PROMPT, max_new_tokens=64, seed=1, early_commit=2)
    stop = full.text[6:9]
    assert len(stop) == 3 and full.text.find(stop) == 6
    cut = model.generate(PROMPT, max_new_tokens=64, seed=1, early_commit=2, stop=stop)
    assert (cut.text, cut.finish_reason) == (full.text[:6], "stop")


@pytest.mark.parametrize("extra", [{"skip_settled": 2}, {"skip_settled": 2, "settled_kv_reuse": True},
                                   {"soft_top_k": 8}])
def test_early_commit_composes_with_the_step_savings(model, extra):
    params = model.defaults.replace(max_new_tokens=64, seed=1, early_commit=2, **extra)
    (req,), (events,) = _engine_run(model, [params])
    assert any(not e.ends_canvas and e.token_ids for e in events)
    assert [t for e in events for t in e.token_ids] == req.output


@pytest.mark.parametrize("early_commit", [None, 2])
def test_drafts_show_only_what_is_not_committed_yet(model, early_commit):
    """A draft is the part of the canvas not committed yet, so committed text + the draft is the answer as it
    stands (what `dgemma generate --visual` and the documented stream client draw): at the last step the
    committed ids and the last draft are exactly the final output, the early-committed prefix not repeated."""
    committed, preview, drafts = [], None, 0
    for ev in model.stream(PROMPT, max_new_tokens=64, seed=1, early_commit=early_commit):
        if ev.kind == "draft":
            preview, drafts = committed + ev.token_ids, drafts + 1
        elif ev.kind == "text":
            committed += ev.token_ids
        elif ev.kind == "done":
            result = ev.result
    assert drafts and preview == result.token_ids == committed


# ---- early_commit_cache: the frozen prefix moves into the KV cache ---------------------------------------------
def _params(model, seed=1, **kw):
    # 32 steps (the demo's budget before issue 43): room for a prefix to freeze well before its canvas ends
    return model.defaults.replace(**{"max_new_tokens": 96, "seed": seed, "early_commit": 1, "early_commit_cache": True,
                                     "max_denoising_steps": 32} | kw)


def _spy(monkeypatch, model, name):
    """Record (width, hide) of every model.denoise call, or the ids of every model.encode call."""
    calls, real = [], getattr(model.module, name)

    def spy(ids, *args, **kw):
        calls.append((ids.shape[1], kw.get("hide")) if name == "denoise" else ids.tolist())
        return real(ids, *args, **kw)

    monkeypatch.setattr(model.module, name, spy)
    return calls


@pytest.mark.parametrize("row_clocks", [True, False])
def test_committed_text_never_changes_and_is_what_was_streamed(model32, row_clocks):
    (req,), (events,) = _engine_run(model32, [_params(model32)], row_clocks)
    assert any(not e.ends_canvas and e.token_ids for e in events)
    assert [t for e in events for t in e.token_ids] == req.output
    assert req.stats.skipped_body_rows > 0  # the prefix did move into the cache


def test_the_cache_holds_what_a_plain_commit_of_the_final_ids_gives(model32, monkeypatch):
    """After a canvas that moved part of its prefix early (the rest encoded at its commit) the row's cache equals,
    slot for slot and layer by layer, a fresh prefill of the prompt followed by one encode of the ids committed."""
    encodes = _spy(monkeypatch, model32, "encode")
    engine = Engine(model32.module, model32.defaults.eos_token_ids or (), model32.pad_id)
    prompt = model32.encode_prompt(PROMPT)
    req = engine.add_request(prompt, _params(model32, max_new_tokens=200))
    c, moved = model32.module.cfg.canvas_length, 0
    while not moved:
        canvases = len(req.stats.steps_per_canvas)
        engine.step()
        moved = req.cached_early if len(req.stats.steps_per_canvas) > canvases else 0
    engine.step()  # the turnover encodes what the commit left, then the next canvas's first pass runs
    assert len(req.output) % c == 0 and not req.finished
    assert len(encodes) >= 2 and [t for ids in encodes for t in ids[0]] == req.output  # moved early, then the rest
    cache = engine.batch.caches[0]
    plain = model32.module.new_cache(1, len(prompt) + len(req.output) + c)
    model32.module.prefill(torch.tensor([prompt]), plain)
    model32.module.encode(torch.tensor([req.output]), plain)
    n = len(req.output)
    assert cache.positions[:, :len(prompt) + n].tolist() == plain.positions[:, :len(prompt) + n].tolist()
    for layer in range(model32.module.cfg.text.num_hidden_layers):
        for got, want in zip(cache.read(layer, len(prompt), n), plain.read(layer, len(prompt), n)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_passes_shrink_by_the_moved_prefix(model32, monkeypatch):
    """The option's passes are narrower than the canvas by exactly the positions counted as left out of the body;
    early commit alone runs every pass over the whole canvas."""
    c = model32.module.cfg.canvas_length
    plain = _spy(monkeypatch, model32, "denoise")
    _engine_run(model32, [_params(model32, early_commit_cache=None)])
    assert {w for w, _ in plain} == {c}
    monkeypatch.undo()
    moved = _spy(monkeypatch, model32, "denoise")
    (req,), _ = _engine_run(model32, [_params(model32)])
    assert min(w for w, _ in moved) < c
    assert sum(c - w for w, _ in moved) == req.stats.skipped_body_rows > 0
    assert all(not any(h or ()) for _, h in moved)  # alone, a row never hides positions


def test_each_step_leaves_out_of_the_head_exactly_the_committed_prefix(model32, monkeypatch):
    """The positions a step's head work skips are the ids of its canvas committed so far (sent early), no others."""
    import dgemma.engine.runner as engine_module

    engine = Engine(model32.module, model32.defaults.eos_token_ids or (), model32.pad_id)
    req = engine.add_request(model32.encode_prompt(PROMPT), _params(model32))
    seen, real = [], engine_module.fast_step

    def spy(*args, reuse=None, **kw):
        seen.append((req.committed_early, None if reuse is None else reuse.skip[0].tolist()))
        return real(*args, reuse=reuse, **kw)

    monkeypatch.setattr(engine_module, "fast_step", spy)
    for _ in engine.stream():
        pass
    c = model32.module.cfg.canvas_length
    assert any(sent for sent, _ in seen)
    assert all((skip or [False] * c) == [j < sent for j in range(c)] for sent, skip in seen)


def test_off_is_early_commit_alone(model32):
    (plain, off), _ = _engine_run(model32, [_params(model32, early_commit_cache=None),
                                             _params(model32, early_commit_cache=False)])
    (alone,), _ = _engine_run(model32, [_params(model32, early_commit_cache=None)])
    assert plain.output == off.output == alone.output
    assert off.stats.skipped_body_rows == 0


@pytest.mark.parametrize("row_clocks", [True, False])
def test_batched_rows_with_different_frozen_lengths_match_their_runs_alone(model32, monkeypatch, row_clocks):
    """Rows that freeze at different rates (and one without the option) batched together give each the ids it gives
    alone: the pass starts at the smallest moved prefix, a row that moved more hides the rest from its canvas."""
    params = [_params(model32, seed=1), _params(model32, seed=2, early_commit=3), model32.defaults.replace(
        max_new_tokens=96, seed=4), _params(model32, seed=5)]
    alone = [_engine_run(model32, [p])[0][0].output for p in params]
    passes = _spy(monkeypatch, model32, "denoise")
    reqs, events = _engine_run(model32, params, row_clocks)
    assert [r.output for r in reqs] == alone
    assert all([t for e in ev for t in e.token_ids] == r.output for r, ev in zip(reqs, events))
    assert any(h and len(set(h)) > 1 for _, h in passes)  # some pass had rows with different hidden counts


def test_refused_without_early_commit(model32, capsys):
    for bad in ({"early_commit_cache": True}, {"early_commit_cache": 1, "early_commit": 2},
                {"early_commit_cache": True, "early_commit": 2, "skip_settled": 1, "settled_kv_reuse": True}):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**bad)
        assert e.value.param == "early_commit_cache"
    from dgemma.cli import main

    assert main(["generate", PROMPT, "--max-new-tokens", "8", "--early-commit-cache"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--early-commit-cache needs early_commit" in err and len(err.splitlines()) == 1
