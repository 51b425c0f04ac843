"""Sampling against the reference: HF's own sampler, schedule, stopping and finalize code on identical
inputs (transformers==5.23.0), plus distribution and independence checks for the fast sampler."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.generation import EosTokenCriteria, LogitsProcessorList, StoppingCriteriaList
from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf

from dgemma.sampling import (
    Limits,
    SamplingParams,
    SamplingParamsError,
    StableConfidentStopper,
    entropy_bound_accept,
    exponential_race,
    finalize_canvas,
    freeze_rows,
    make_generator,
    reference_step,
    renoise,
    sample_next,
    stop_holdback,
    temperature_schedule,
    token_entropy,
    truncate_at_stop_strings,
)

EOS = (1, 106, 50)


def random_logits(seed, shape, spread=(0.2, 8.0), dtype=torch.float32):
    """Logits whose sharpness varies per position, so entropies range from ~0 to ~log V."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.empty(shape[:-1] + (1,)).uniform_(*spread, generator=g)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def hf_sampler(bound, canvas_length, vocab_size, steps=48):
    return hf.EntropyBoundSampler(hf.EntropyBoundSamplerConfig(entropy_bound=bound), canvas_length, vocab_size, steps)


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("n_steps", [1, 7, 48, 100])
def test_temperature_matches_reference_schedule(n_steps):
    proc = hf.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=n_steps)
    x = random_logits(0, (2, 3, 11))
    schedule = temperature_schedule(n_steps, 0.4, 0.8)
    assert schedule.shape == (n_steps,) and schedule.dtype == torch.float32
    for i, s in enumerate(range(n_steps, 0, -1)):
        # the int32 tensor step that HF `generate` passes
        assert torch.equal(x / schedule[i], proc(None, x, cur_step=torch.tensor(s, dtype=torch.int32)))
    assert float(schedule[0]) == pytest.approx(0.8)
    assert float(schedule[-1]) == pytest.approx(0.4 + 0.4 / n_steps)


# ---------------------------------------------------------------- entropy and acceptance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_entropy_is_bit_equal_to_categorical(dtype):
    x = random_logits(1, (3, 16, 50), dtype=dtype)
    x[0, :4, :10] = float("-inf")  # masked vocabulary entries must not produce nan
    ref = torch.distributions.Categorical(logits=x).entropy()
    assert torch.equal(token_entropy(x, dtype=None), ref)
    exact = torch.distributions.Categorical(logits=x.double()).entropy()
    h = token_entropy(x)
    assert h.dtype == torch.float32 and h.shape == (3, 16)
    torch.testing.assert_close(h.double(), exact, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(40))
def test_entropy_bound_accept_matches_reference(seed):
    B, C, V = 3, 32, 50
    x = random_logits(seed, (B, C, V))
    bound = [0.01, 0.1, 0.5, 2.0, 20.0][seed % 5]
    sampler = hf_sampler(bound, C, V)
    sampler.accept_canvas(torch.zeros(B, C, dtype=torch.long), torch.ones(B, C, dtype=torch.long), x, 1)
    mask = entropy_bound_accept(token_entropy(x, dtype=None), bound)
    assert torch.equal(mask, sampler.accepted_token_mask)
    assert mask.any(-1).all()  # the lowest-entropy position is always accepted


def test_entropy_bound_accept_boundary_is_inclusive():
    h = torch.tensor([[0.5, 0.25, 0.25, 1.0], [0.125, 0.0, 0.375, 0.5]])  # exact in binary
    assert entropy_bound_accept(h, 0.5).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert entropy_bound_accept(h, 0.49).tolist() == [[False, True, True, False], [True, True, True, False]]


def test_entropy_bound_accept_ties_match_reference():
    C, V = 12, 40
    base = random_logits(3, (1, 1, V), spread=(1.0, 1.0))
    row_same = base.expand(1, C, V)  # every position has the same entropy
    row_pairs = random_logits(4, (1, C // 2, V)).repeat_interleave(2, dim=1)  # tied pairs
    x = torch.cat([row_same, row_pairs, row_same, row_pairs.flip(1)]).contiguous()  # duplicated rows too
    e = float(token_entropy(x[:1, :1], dtype=None))
    for bound in (0.5 * e, 1.5 * e, 2.5 * e, 6.5 * e, 0.3, 1.0, 3.0):
        sampler = hf_sampler(bound, C, V)
        sampler.accept_canvas(torch.zeros(4, C, dtype=torch.long), torch.ones(4, C, dtype=torch.long), x, 1)
        mask = entropy_bound_accept(token_entropy(x, dtype=None), bound)
        assert torch.equal(mask, sampler.accepted_token_mask), bound
    # The boundary falls inside a tie group: which tied positions win is decided by the sort.
    mask = entropy_bound_accept(token_entropy(x, dtype=None), 2.5 * e)
    assert mask[0].sum() == 3


def test_renoise_matches_reference():
    B, C, V = 4, 16, 30
    accepted = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(0))
    mask = torch.rand(B, C, generator=torch.Generator().manual_seed(1)) < 0.4
    sampler = hf_sampler(0.1, C, V)
    sampler.accepted_token_mask = mask
    torch.manual_seed(5)
    ref = sampler.renoise_canvas(accepted, 1)
    torch.manual_seed(5)
    ours = renoise(accepted, mask, torch.randint(0, V, (B, C)))
    assert torch.equal(ours, ref)
    assert torch.equal(ours[mask], accepted[mask]) and not torch.equal(ours, accepted)


# ---------------------------------------------------------------- one step, and the HF denoising loop


@pytest.mark.parametrize("seed", range(5))
def test_reference_step_matches_reference_pieces(seed):
    B, C, V = 3, 24, 64
    x = random_logits(seed, (B, C, V))
    current = torch.randint(0, V, (B, C), generator=torch.Generator().manual_seed(seed))
    sampler = hf_sampler(0.3, C, V)
    torch.manual_seed(seed)
    probs = torch.softmax(x, dim=-1, dtype=torch.float32)
    denoised = torch.multinomial(probs.view(-1, V), num_samples=1).view(B, C)
    ref = sampler.renoise_canvas(sampler.accept_canvas(current, denoised, x, 1), 1)
    torch.manual_seed(seed)
    out = reference_step(x, 0.3)
    assert torch.equal(out.canvas, ref)
    assert torch.equal(out.argmax, x.argmax(-1))
    assert torch.equal(out.accepted, sampler.accepted_token_mask)
    assert torch.equal(out.entropy, torch.distributions.Categorical(logits=x).entropy())
    # The same draws from an explicit generator.
    assert torch.equal(reference_step(x, 0.3, torch.Generator().manual_seed(seed)).canvas, ref)


def fake_decoder(B, C, V, dtype):
    """Logits that depend on the canvas: row 0 is sharp (stops early), row 1 sharpens as its canvas
    reaches the target (stops later), row 2 stays flat (never stops)."""
    g = torch.Generator().manual_seed(123)
    table = torch.randn(V, V, generator=g) * 2
    target = torch.randint(0, V, (B, C), generator=g)
    alpha = torch.tensor([400.0, 30.0, 1.0])[:B, None, None]

    def decoder(canvas):
        progress = (canvas == target).float().mean(-1)[:, None, None] + 0.05
        return (alpha * progress * F.one_hot(target, V) + table[canvas]).to(dtype)

    return decoder


def hf_denoising_loop(decoder, canvas, n_steps, bound, stability, dtype):
    """HF's own `_denoising_step` driven as its `generate` drives it, with a fake decoder."""
    B, C = canvas.shape
    V = decoder(canvas).shape[-1]
    model = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(vocab_size=V)),
                            model=SimpleNamespace(decoder=SimpleNamespace(
                                embed_tokens=SimpleNamespace(weight=torch.empty(0, dtype=dtype)))))
    procs = LogitsProcessorList([hf.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, n_steps)])
    criteria = hf.StableAndConfidentStoppingCriteria(stability, 0.005)
    argmax, self_cond, finished, trace = canvas, None, torch.zeros(B, dtype=torch.bool), []
    for step in reversed(range(1, n_steps + 1)):
        canvas, argmax, self_cond, finished = hf.DiffusionGemmaGenerationMixin._denoising_step(
            model, decoder_forward=lambda decoder_input_ids, **_: SimpleNamespace(logits=decoder(decoder_input_ids)),
            current_canvas=canvas, argmax_canvas=argmax, input_ids=None, decoder_position_ids=None,
            self_conditioning_logits=self_cond, mask_mapping=None, past_key_values=None,
            finished_denoising=finished, cur_step=step, sampler=hf_sampler(bound, C, V, n_steps),
            logits_processor=procs, diffusion_stopping_criteria=criteria)
        trace.append((canvas.clone(), argmax.clone(), finished.clone()))
        if finished.all():
            break
    return trace


def our_denoising_loop(decoder, canvas, n_steps, bound, stability):
    temps = temperature_schedule(n_steps, 0.4, 0.8)
    stopper = StableConfidentStopper(stability, 0.005)
    argmax, finished, trace = canvas, torch.zeros(canvas.shape[0], dtype=torch.bool), []
    for i in range(n_steps):
        out = reference_step(decoder(canvas) / temps[i], bound)
        argmax = freeze_rows(finished, argmax, out.argmax)
        canvas = freeze_rows(finished, canvas, out.canvas)
        finished = stopper.update(argmax, out.entropy, active=~finished)
        trace.append((canvas, argmax, finished))
        if finished.all():
            break
    return trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stability", [0, 1, 3])
def test_denoising_loop_matches_hf_denoising_step(dtype, stability):
    B, C, V, N = 3, 16, 48, 14
    decoder = fake_decoder(B, C, V, dtype)
    torch.manual_seed(7)
    start = torch.randint(0, V, (B, C))
    ref = hf_denoising_loop(decoder, start, N, 0.1, stability, dtype)
    torch.manual_seed(7)
    ours = our_denoising_loop(decoder, torch.randint(0, V, (B, C)), N, 0.1, stability)
    assert len(ours) == len(ref)
    for step, ((c, a, f), (rc, ra, rf)) in enumerate(zip(ours, ref)):
        assert torch.equal(c, rc) and torch.equal(a, ra) and torch.equal(f, rf), step
    finished = torch.stack([f for _, _, f in ref])
    first = finished.int().argmax(0)
    assert finished[-1, :2].all() and first[1] > first[0] and not finished[-1, 2]  # rows stop at different steps
    assert first[0] == stability  # first stable at step threshold + 1 (HF: -1 history)


# ---------------------------------------------------------------- stopping


@pytest.mark.parametrize("stability", [0, 1, 2, 3])
def test_stopper_matches_reference(stability):
    B, C, V, T = 5, 6, 8, 25
    g = torch.Generator().manual_seed(stability)
    ref = hf.StableAndConfidentStoppingCriteria(stability, 1.2)
    ours = StableConfidentStopper(stability, 1.2)
    argmax = torch.randint(0, V, (B, C), generator=g)
    agree = []
    for _ in range(T):
        change = torch.rand(B, 1, generator=g) < 0.3
        argmax = torch.where(change, torch.randint(0, V, (B, C), generator=g), argmax)
        logits = torch.randn(B, C, V, generator=g) * torch.empty(B, 1, 1).uniform_(0.5, 4, generator=g)
        active = torch.rand(B, generator=g) < 0.8
        expected = ref(argmax, logits)
        done = ours.update(argmax, logits if stability % 2 else token_entropy(logits, dtype=None), active)
        assert torch.equal(done, expected | ~active)
        agree.append(expected)
    assert torch.stack(agree).any() and not torch.stack(agree).all()  # both outcomes occurred


def test_stopper_per_row_thresholds():
    stability, confidence = torch.tensor([0, 1, 2, 1]), torch.tensor([1.0, 1.2, 1.3, 2.5])
    batched = StableConfidentStopper(stability, confidence)
    single = [StableConfidentStopper(int(s), float(c)) for s, c in zip(stability, confidence)]
    g = torch.Generator().manual_seed(0)
    argmax, seen = torch.randint(0, 3, (4, 5), generator=g), []
    for _ in range(20):
        argmax = torch.where(torch.rand(4, 1, generator=g) < 0.3, torch.randint(0, 3, (4, 5), generator=g), argmax)
        entropy = torch.rand(4, 5, generator=g) * 2
        done = batched.update(argmax, entropy)
        assert done.tolist() == [bool(s.update(argmax[i:i + 1], entropy[i:i + 1])) for i, s in enumerate(single)]
        seen.append(done)
    assert torch.stack(seen).any(0).all() and not torch.stack(seen).all(0).any()


def test_freeze_rows():
    old, new = torch.zeros(3, 2, 4), torch.ones(3, 2, 4)
    out = freeze_rows(torch.tensor([False, True, False]), old, new)
    assert out[:, 0, 0].tolist() == [1, 0, 1]


def hf_finalize(canvas, finished_before, prompt_len=3):
    prompt = torch.full((canvas.shape[0], prompt_len), 9)
    ids, finished = hf.DiffusionGemmaGenerationMixin._finalize_canvas(
        input_ids=torch.cat([prompt, canvas], dim=-1), finished_sequences=finished_before.clone(),
        generation_config=SimpleNamespace(pad_token_id=0, eos_token_id=list(EOS)),
        stopping_criteria=StoppingCriteriaList([EosTokenCriteria(list(EOS))]),
        canvas_length=canvas.shape[1], eos_tensor=torch.tensor(EOS))
    assert torch.equal(ids[:, :prompt_len], prompt)
    return ids[:, prompt_len:], finished


def test_finalize_canvas_matches_reference():
    C = 8
    rows = [
        [5, 6, 7, 8, 9, 10, 11, 12],  # no EOS
        [5, 6, 106, 8, 9, 10, 11, 12],  # one EOS
        [5, 50, 7, 1, 9, 106, 11, 12],  # several different EOS ids
        [1, 6, 7, 8, 9, 10, 11, 12],  # EOS first
        [5, 6, 7, 8, 9, 10, 11, 50],  # EOS last
        [5, 6, 1, 1, 9, 10, 11, 12],  # repeated EOS
        [5, 6, 106, 8, 9, 10, 11, 12],  # finished before, with EOS
        [5, 6, 7, 8, 9, 10, 11, 12],  # finished before, no EOS
    ]
    canvas = torch.tensor(rows)
    before = torch.tensor([False] * 6 + [True, True])
    ref_canvas, ref_finished = hf_finalize(canvas, before)
    padded = finalize_canvas(canvas, EOS, 0, before)
    assert torch.equal(padded, ref_canvas)
    assert ref_finished.tolist() == [False, True, True, True, True, True, True, True]
    assert padded[2].tolist() == [5, 50, 0, 0, 0, 0, 0, 0] and padded[6].tolist() == [0] * C
    assert torch.equal(canvas, torch.tensor(rows))  # input untouched
    for seed in range(20):  # random canvases dense in EOS ids
        g = torch.Generator().manual_seed(seed)
        canvas = torch.tensor(EOS + (7, 8, 9))[torch.randint(0, 6, (6, C), generator=g)]
        canvas[torch.rand(6, C, generator=g) < 0.6] = 7
        before = torch.rand(6, generator=g) < 0.3
        ref_canvas, ref_finished = hf_finalize(canvas, before)
        assert torch.equal(finalize_canvas(canvas, torch.tensor(EOS), 0, before), ref_canvas)
        per_row = torch.tensor([EOS] * 6)  # the same EOS ids given per row: the same padding
        assert torch.equal(finalize_canvas(canvas, per_row, 0, before), ref_canvas)


def test_stop_strings():
    assert truncate_at_stop_strings("hello world. bye", ["bye", "."]) == ("hello world", True)
    assert truncate_at_stop_strings("hello world", ["xyz"]) == ("hello world", False)
    assert truncate_at_stop_strings("abc", []) == ("abc", False)
    assert truncate_at_stop_strings("a</s>b<end>", ["<end>", "</s>"]) == ("a", True)
    assert stop_holdback("answer: </", ["</s>"]) == 2
    assert stop_holdback("answer: <", ["</s>", "<end>"]) == 1
    assert stop_holdback("answer", ["</s>"]) == 0
    assert stop_holdback("x</s", ["</s>"]) == 3
    assert stop_holdback("x</s>", ["</s>"]) == 0  # a whole stop is truncate_at_stop_strings' business


# ---------------------------------------------------------------- fast sampler


def test_fast_sampler_distribution():
    V, n = 6, 30_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits, -1)
    draws = exponential_race(probs.expand(1, n, V).contiguous(), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws.flatten(), minlength=V).double()
    assert chi_square(counts, probs.double()) < 20.5  # chi2(df=5) 0.999 quantile
    assert chi_square(counts, torch.full((V,), 1 / V, dtype=torch.double)) > 1000  # the test has power


def test_sample_next():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample_next(logits, 0.0).tolist() == [1, 0]
    n = 20_000
    draws = sample_next(logits[:1].expand(n, 3), 2.0, make_generator(0))
    counts = torch.bincount(draws, minlength=3).double()
    assert chi_square(counts, torch.softmax(logits[0] / 2.0, -1).double()) < 13.8  # chi2(df=2) 0.999


# ---------------------------------------------------------------- params


def test_params_defaults_are_hf_defaults():
    hf_defaults = hf.DiffusionGemmaGenerationConfig._get_default_generation_params()
    p = SamplingParams()
    assert p.entropy_bound == hf_defaults.pop("sampler_config").entropy_bound
    assert {k: getattr(p, k) for k in hf_defaults} == hf_defaults
    assert SamplingParams.from_generation_config({}) == p


def test_params_from_generation_config():
    cfg = {"max_new_tokens": 512, "max_denoising_steps": None, "t_min": 0.3, "t_max": None,
           "sampler_config": {"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"},
           "stability_threshold": 2, "confidence_threshold": None, "eos_token_id": [1, 106, 50],
           "pad_token_id": 0, "transformers_version": "5.23.0"}
    p = SamplingParams.from_generation_config(cfg)
    assert (p.max_new_tokens, p.max_denoising_steps, p.t_min, p.t_max) == (512, 48, 0.3, 0.8)
    assert (p.entropy_bound, p.stability_threshold, p.confidence_threshold) == (0.2, 2, 0.005)
    assert p.eos_token_ids == (1, 106, 50)
    assert SamplingParams.from_generation_config({"eos_token_id": 1, "sampler_config": None}).eos_token_ids == (1,)
    with pytest.raises(ValueError, match="max_denoising_steps"):
        SamplingParams.from_generation_config({"max_denoising_steps": 0})


def test_params_replace():
    p = SamplingParams(seed=3, stop=["</s>"])
    assert p.stop == ("</s>",) and hash(p)
    q = p.replace(max_new_tokens=None, seed=None, t_min=0.8, stop="x")
    assert (q.max_new_tokens, q.seed, q.t_min, q.stop) == (256, 3, 0.8, ("x",))  # t_max == t_min allowed
    assert p.t_min == 0.4
    with pytest.raises(ValueError, match="unknown"):
        p.replace(top_kk=5)
    with pytest.raises(ValueError, match="t_max"):
        p.replace(t_min=0.9)
    with pytest.raises(AttributeError):
        p.seed = 4


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(max_new_tokens=-5), dict(max_new_tokens=1_000_001), dict(max_new_tokens=2.0),
    dict(max_new_tokens=True), dict(max_denoising_steps=0), dict(max_denoising_steps=10_001),
    dict(entropy_bound=0.0), dict(entropy_bound=-0.1), dict(entropy_bound=float("nan")),
    dict(t_min=-0.1), dict(t_max=0.0, t_min=0.0), dict(t_max=0.3), dict(t_max=float("inf")),
    dict(stability_threshold=-1), dict(stability_threshold=1.0), dict(confidence_threshold=0.0),
    dict(seed=-1), dict(seed=2**64), dict(stop=("ok", "")), dict(stop=(3,)), dict(eos_token_ids=(-1,)),
    dict(eos_token_ids=("a",)), dict(ar_temperature=-1.0),
])
def test_params_validation(bad):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**bad)
    name = next(iter(bad))
    assert "\n" not in str(err.value) and name in str(err.value) and err.value.param == name


def test_params_validate_against_model():
    p = SamplingParams(max_new_tokens=100, eos_token_ids=(1, 106))
    p.validate(vocab_size=262_144, max_context=200, prompt_len=100)
    with pytest.raises(ValueError, match="vocabulary"):
        p.validate(vocab_size=100)
    with pytest.raises(ValueError, match="context"):
        p.validate(max_context=200, prompt_len=101)
    SamplingParams(t_min=0.0, t_max=0.5, stability_threshold=0, ar_temperature=0.7, seed=0).validate(vocab_size=10)


@pytest.mark.parametrize("limits, param", [
    (Limits(max_prompt_tokens=9), "prompt"), (Limits(max_new_tokens=99), "max_new_tokens"),
    (Limits(max_stop=1), "stop"), (Limits(max_stop_chars=2), "stop"),
])
def test_params_validate_deployment_limits(limits, param):
    p = SamplingParams(max_new_tokens=100, stop=("abc", "d"))
    p.validate(prompt_len=9, limits=Limits(9, 100, 2, 3))  # at the caps: accepted
    with pytest.raises(SamplingParamsError) as err:
        p.validate(prompt_len=10 if param == "prompt" else 9, limits=limits)
    assert err.value.param == param
