"""benchmarks/demo_defaults.py without its judge packages: the shuffled control, the repetition guard, the choice
rule, one round-robin measurement on the bundled model with a stand-in judge, and the demo's shipped defaults
agreeing with the training config that rebuilds them."""

import builtins
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import demo_defaults as sweep  # noqa: E402

import dgemma  # noqa: E402


def test_shuffled_words_keep_the_bytes_and_the_whitespace():
    text = " and the king,\n  said unto him: go.\n"
    out = sweep.shuffle_words(text, seed=3)
    assert sorted(out.split()) == sorted(text.split()) and len(out.encode()) == len(text.encode())
    assert [c for c in out if c.isspace()] == [c for c in text if c.isspace()]
    assert out != text and sweep.shuffle_words(text, seed=3) == out


def test_repeated_trigrams():
    assert sweep.repeated_trigrams("a b c d".split()) == 0.0
    assert sweep.repeated_trigrams("a b c a b c".split()) == pytest.approx(1 / 4)  # "a b c" again, of 4 trigrams
    assert sweep.repeated_trigrams(["a"]) == 0.0


def _rows(bpb, invented, seconds=1.0):
    return [{"bpb": b, "invented": i, "words": 10, "repeat3": 0.0, "tokens": 10, "seconds": seconds, "passes": 5,
             "shuffled_bpb": b + 0.2} for b, i in zip(bpb, invented)]


def test_the_choice_needs_both_judges_and_no_slower():
    current = _rows([3.0, 3.1, 2.9], [2, 3, 2])
    rows = {"current": current,
            "better_both": _rows([2.8, 3.0, 2.7], [1, 2, 1]),
            "better_one": _rows([2.0, 2.0, 2.0], [4, 4, 4]),
            "better_but_slow": _rows([2.0, 2.0, 2.0], [0, 0, 0], seconds=2.0)}
    pick, vs = sweep.choose(rows, "current")
    assert pick == "better_both"
    assert [vs[n]["eligible"] for n in rows] == [False, True, False, False]
    assert sweep.choose({"current": current, "worse": _rows([3.5] * 3, [5] * 3)}, "current")[0] == "current"


def test_missing_judges_say_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_wordfreq(name, *args, **kw):
        if name == "wordfreq":
            raise ImportError("no wordfreq", name="wordfreq")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wordfreq)
    with pytest.raises(SystemExit, match=r"the judges need \w+: pip install 'dgemma\[judges\]'"):
        sweep.Judge()


class StandInJudge:
    def score(self, prompt, text, seed):
        return {"words": len(text.split()), "invented": 0, "repeat3": 0.0, "bytes": len(text.encode()),
                "bpb": 1.0 if text.strip() else None, "shuffled_bpb": 1.5 if text.strip() else None}


def test_measure_decodes_every_setting_on_every_prompt_and_seed():
    model = dgemma.load()
    settings = {"two": {"max_denoising_steps": 2}, "one": {"max_denoising_steps": 1}}
    rows = sweep.measure(model, StandInJudge(), ["Call me Ishmael.", "It was"], [0, 1], settings,
                         {"max_new_tokens": 8}, log=lambda m: None)
    assert {n: [(r["prompt"], r["seed"]) for r in rs] for n, rs in rows.items()} == \
        {n: [(0, 0), (0, 1), (1, 0), (1, 1)] for n in settings}
    assert all(r["tokens"] <= 8 and r["seconds"] > 0 for rs in rows.values() for r in rs)
    assert [r["passes"] for r in rows["one"]] == [1] * 4  # 8 tokens: one canvas, one step
    assert sweep.summarise(rows["one"])["shuffle_gain_bpb"] == pytest.approx(0.5)


def test_the_demo_ships_what_its_training_config_writes():
    shipped = json.loads((ROOT / "dgemma/assets/demo/generation_config.json").read_text())
    written = json.loads((ROOT / "configs/demo.json").read_text())["generation"]
    assert {k: shipped[k] for k in ("max_new_tokens", "max_denoising_steps", "t_max", "t_min")} == \
        {k: written[k] for k in ("max_new_tokens", "max_denoising_steps", "t_max", "t_min")}
    assert shipped["sampler_config"]["entropy_bound"] == written["entropy_bound"]
