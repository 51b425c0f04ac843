"""Layout canvases through the Python API: templates with holes and edits keep their fixed text byte-identical
(random templates on a random tiny model and on the bundled model), infill holds the suffix fixed in the canvas,
holes end at their first EOS, and layout, constrained and plain requests share a batch."""

import json
import random
import re

import pytest
import torch

import dgemma
from dgemma import Grammar
from dgemma.sampling import SamplingParamsError, StepOutput
from dgemma.sampling.layout import HOLE, Layout, LayoutState, layout_step
from server_fixtures import load_with_eos, served_checkpoint

WORDS = ["The", " fox", " said", ":", " hello", "\n", " world", "!", " 42", " é", " über", "{", "}", ",", " and"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_with_eos(served_checkpoint(tmp_path_factory))


def _template(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        parts.append("".join(rng.choices(WORDS, k=rng.randint(1, 5))))
        parts.append(rng.choice(["[[hole]]", f"[[hole:{rng.randint(1, 12)}]]"]))
    return "".join(parts[:-1] if len(parts) > 2 and rng.random() < 0.3 else parts)


def _pattern(template: str) -> str:
    """The fixed text verbatim, anything in the holes."""
    pieces = HOLE.split(template)[::2]  # split also yields the optional length group
    return "(?s:.*?)".join(re.escape(p) for p in pieces)


def _run(model, requests):
    runner = model.runner("diffusion", "fast", max_batch=len(requests))
    reqs = [runner.add_request(model.encode_prompt(prompt), p) for prompt, p in requests]
    for _ in runner.stream():
        pass
    return [(model.tokenizer.decode(r.output), r.finish_reason) for r in reqs]


def _check_templates(model, n, seed, steps):
    rng = random.Random(seed)
    templates = [_template(rng) for _ in range(n)]
    results = _run(model, [("Once upon a time", model.params(template=t, seed=i, max_denoising_steps=steps))
                           for i, t in enumerate(templates)])
    for t, (text, reason) in zip(templates, results):
        assert reason == "stop" and re.fullmatch(_pattern(t), text), (t, text)


def test_templates_keep_their_fixed_text_on_a_random_model(tiny):
    _check_templates(tiny, 24, seed=0, steps=6)


@pytest.mark.slow
def test_templates_keep_their_fixed_text_on_the_bundled_model():
    _check_templates(dgemma.load(), 8, seed=1, steps=6)


def test_edit_keeps_what_is_not_renoised(tiny):
    draft = "The quick brown fox jumps over the lazy dog."
    r = tiny.generate("Hello", edit=draft, renoise=[(10, 19)], seed=3, max_denoising_steps=6)
    assert r.finish_reason == "stop"
    assert r.text.startswith("The quick") and r.text.endswith(" over the lazy dog.")
    ids = tiny.tokenizer.encode(draft, add_bos=False)
    for fraction in (0.25, 1.0):
        out = tiny.generate("Hello", edit=ids, renoise=fraction, seed=4, max_denoising_steps=6)
        # the documented choice: round(fraction * n) positions drawn by random.Random(seed)
        chosen = set(random.Random(4).sample(range(len(ids)), max(1, round(fraction * len(ids)))))
        assert out.finish_reason == "stop" and re.fullmatch(_id_pattern(ids, chosen), _id_text(out.token_ids))
    assert out.token_ids != ids  # all renoised: nothing forced back to the draft


def _id_text(ids):
    return "".join(chr(0x100 + t) for t in ids)


def _id_pattern(ids, renoised):
    """Kept tokens exactly where they were; each renoised run a hole of at most its length (a hole ends at EOS)."""
    out, i = "", 0
    while i < len(ids):
        j = i
        while j < len(ids) and (j in renoised) == (i in renoised):
            j += 1
        out += f"(?s:.{{0,{j - i}}})" if i in renoised else re.escape(_id_text(ids[i:j]))
        i = j
    return out


def test_infill_sees_the_suffix(tiny):
    """The middle is generated with the suffix frozen after it: the result differs from plain generation with
    the same seed, and is never longer than max_new_tokens."""
    plain = tiny.generate("The quick brown", seed=5, max_new_tokens=12, max_denoising_steps=6)
    infill = tiny.generate("The quick brown", suffix=" over the lazy dog.", seed=5, max_new_tokens=12,
                           max_denoising_steps=6)
    assert infill.finish_reason == "stop" and len(infill.token_ids) <= 12
    assert infill.token_ids != plain.token_ids


def test_layout_rules():
    """Holes end at their first EOS; an infill's suffix is context only; fixed positions are frozen each step."""
    lay = Layout.from_parts([[7, 8], 3, [9]])
    s = LayoutState(lay, eos=(1,))
    s.start_canvas(4, "cpu")
    assert s.fixed.tolist() == [True, True, False, False] and s.ids.tolist()[:2] == [7, 8]
    assert s.take([7, 8, 5, 1]) == ([7, 8, 5], False)
    s.start_canvas(4, "cpu")
    assert s.fixed.tolist() == [False, True, True, True] and s.ids.tolist()[1:] == [9, 1, 1]
    assert s.take([6, 9, 1, 1]) == ([9], True)  # the hole ended at EOS: its last token is dropped
    infill = LayoutState(Layout.from_parts([2, [9, 9]], echo=False), eos=(1,))
    assert infill.take([4, 5, 9, 9]) == ([4, 5], True)
    out = StepOutput(torch.tensor([[3, 3, 3, 3]]), torch.tensor([[3, 3, 3, 3]]),
                     torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 4))
    s = LayoutState(lay, eos=(1,))
    s.start_canvas(4, "cpu")
    layout_step([s], out)
    assert out.canvas.tolist() == [[7, 8, 3, 3]] and out.argmax.tolist() == [[7, 8, 3, 3]]
    assert out.accepted.tolist() == [[True, True, False, False]] and out.entropy.tolist() == [[0, 0, 1, 1]]


def test_layout_constrained_and_plain_requests_share_a_batch(tiny):
    plain = tiny.params(seed=7, max_new_tokens=16, max_denoising_steps=6)
    alone = _run(tiny, [("The quick brown fox", plain)])[0]
    schema = {"type": "array", "items": {"enum": ["x", 3]}, "maxItems": 4}
    mixed = _run(tiny, [("The quick brown fox", tiny.params(template="A[[hole:3]]B", seed=1, max_denoising_steps=6)),
                        ("The quick brown fox", plain),
                        ("The quick brown fox", tiny.params(grammar=Grammar.json_schema(schema), seed=2,
                                                            max_denoising_steps=6))])
    assert mixed[1] == alone
    assert re.fullmatch(r"A(?s:.*)B", mixed[0][0]) and isinstance(json.loads(mixed[2][0]), list)


@pytest.mark.parametrize("options, param", [
    ({"template": "no holes here"}, "template"),
    ({"template": "a [[hole:0]]"}, "template"),
    ({"suffix": ""}, "suffix"),
    ({"edit": "some text"}, "edit"),
    ({"edit": "some text", "renoise": 1.5}, "renoise"),
    ({"suffix": "x", "template": "[[hole]]"}, "template"),
    ({"template": "[[hole]]", "grammar": Grammar.json_object()}, "template"),
])
def test_bad_layout_requests_name_the_parameter(tiny, options, param):
    with pytest.raises(SamplingParamsError) as e:
        tiny.params(**options)
    assert e.value.param == param
