"""What one request can cost before any model work: layout canvases (templates, edits) are refused before they
are tokenized or built when they cannot fit in the context, edits are prepared in linear time, and turning
committed ids into text (stop strings included) costs time linear in the output, however it arrives."""

import random

import pytest

from dgemma.engine import OutputStream
from dgemma.engine.request import Event
from dgemma.sampling import SamplingParamsError
from dgemma.sampling import layout
from dgemma.sampling.layout import edit_parts, renoised_positions
from dgemma.tokenizer import IncrementalDecoder
from server_fixtures import load_with_eos, served_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_with_eos(served_checkpoint(tmp_path_factory))


@pytest.fixture
def spies(tiny, monkeypatch):
    """Calls to the tokenizer and to the layout builder, recorded."""
    calls = []
    encode, offsets, build = tiny.tokenizer.encode, tiny.tokenizer.tok.encode, layout.Layout.from_parts
    monkeypatch.setattr(tiny.tokenizer, "encode", lambda *a, **k: calls.append("encode") or encode(*a, **k))
    monkeypatch.setattr(layout.Layout, "from_parts", classmethod(
        lambda cls, *a, **k: calls.append("build") or build(*a, **k)))
    return calls


def _char_cap(model):
    """The most characters a text that fits in the context can have (docs/serving.md: L x M x 2)."""
    return model.max_context * model.tokenizer.max_token_chars * 2


def test_a_template_whose_holes_pass_the_context_is_refused_unbuilt(tiny, spies):
    with pytest.raises(SamplingParamsError) as e:
        tiny.params(template="[[hole:4096]]" * 8000)
    assert e.value.param == "template" and "holes total more than" in str(e.value) and spies == []


def test_the_servers_cap_bounds_a_layout_before_tokenizing(tiny, spies):
    """`layout_limit` (the server passes min(room in the context, --max-tokens)) is checked on the text first."""
    with pytest.raises(SamplingParamsError) as e:
        tiny.params(edit="word " * 400, renoise=0.5, layout_limit=64)
    assert e.value.param == "edit" and spies == []
    with pytest.raises(SamplingParamsError, match="at most 64 are allowed"):
        tiny.params(edit="word " * 60, renoise=0.5, layout_limit=64)


def test_a_template_text_too_long_for_the_context_is_refused_untokenized(tiny, spies):
    with pytest.raises(SamplingParamsError) as e:
        tiny.params(template="w" * _char_cap(tiny) + "[[hole]]")
    assert e.value.param == "template" and spies == []


def test_a_hole_with_thousands_of_digits_is_a_parameter_error(tiny):
    with pytest.raises(SamplingParamsError) as e:
        tiny.params(template="[[hole:" + "9" * 5000 + "]]")
    assert e.value.param == "template" and "5000 digits" in str(e.value)


def test_an_edit_draft_too_long_for_the_context_is_refused_untokenized(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(tiny.tokenizer.tok, "encode", lambda *a, **k: calls.append(1))
    with pytest.raises(SamplingParamsError) as e:
        tiny.params(edit="w" * (_char_cap(tiny) + 1), renoise=0.5)
    assert e.value.param == "edit" and not calls


def test_renoised_positions_match_their_definition():
    """Tokens overlapping any span (the definition: a < end and start < b), on random offsets and spans."""
    rng = random.Random(0)
    for _ in range(300):
        ends = sorted(rng.sample(range(1, 60), rng.randint(1, 20)))
        offsets = list(zip([0] + ends[:-1], ends))
        spans = [tuple(sorted(rng.sample(range(-2, 62), 2))) for _ in range(rng.randint(0, len(offsets)))]
        want = {i for i, (a, b) in enumerate(offsets) for s, e in spans if a < e and s < b}
        assert renoised_positions(offsets, spans) == want
    with pytest.raises(SamplingParamsError):
        renoised_positions([(0, 1)], [(0, 1)] * 2)  # more spans than tokens


def test_edit_parts_are_runs_of_kept_and_renoised_tokens():
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(100) for _ in range(rng.randint(1, 30))]
        renoised = {i for i in range(len(ids)) if rng.random() < 0.4}
        parts = edit_parts(ids, renoised)
        flat = [t for p in parts for t in ([-1] * p if isinstance(p, int) else p)]
        assert flat == [-1 if i in renoised else t for i, t in enumerate(ids)]
        kinds = [isinstance(p, int) for p in parts]
        assert all(a != b for a, b in zip(kinds, kinds[1:]))  # maximal runs


class _Counting:
    """A tokenizer whose decode counts the ids it is given (the decoding work)."""

    def __init__(self, tokenizer):
        self.inner, self.work = tokenizer, 0

    def decode(self, ids):
        self.work += len(ids)
        return self.inner.decode(ids)


def _ids(tiny, n):
    text = "Hello world, é über 42! The quick brown fox jumps over the lazy dog. " * (n // 10)
    return tiny.tokenizer.encode(text, add_bos=False)[:n]


@pytest.mark.parametrize("chunk", [1, 8])
def test_incremental_decoding_is_linear_and_exact(tiny, chunk):
    ids = _ids(tiny, 2000)
    counting = _Counting(tiny.tokenizer)
    dec = IncrementalDecoder(counting)
    text = "".join(dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + dec.push([], final=True)
    assert text == tiny.tokenizer.decode(ids)
    assert counting.work <= 6 * len(ids)  # re-decoding every prefix would be ~ len(ids)^2 / (2 * chunk)


def test_stop_strings_cost_linear_time_and_keep_the_right_ids(tiny):
    ids = _ids(tiny, 2000) + tiny.tokenizer.encode(" said (the end) and more", add_bos=False)
    full = tiny.tokenizer.decode(ids)
    stop = "(the end)"
    cut = full.index(stop)  # a late stop string
    counting = _Counting(tiny.tokenizer)
    out = OutputStream(counting, stops=("never appears", stop))
    for i in range(0, len(ids)):
        out.feed(Event("r", "commit", ids[i:i + 1]))
        if out.stopped:
            break
    assert out.text == full[:cut] and out.finish_reason == "stop"
    kept = out.kept_ids()
    assert len(tiny.tokenizer.decode(kept)) >= cut > len(tiny.tokenizer.decode(kept[:-1]))
    assert counting.work <= 6 * len(ids) + 40 * len(ids)  # pushes, then a binary search (log2 n full decodes)
