"""The row-feature contract holds (issue 40): the engine and its scheduler name no feature, `Request` keeps no
feature's state in a field of its own, features depend on each other through `requires` and not by importing one
another, and every counter a feature declares is one bench/flops.py prices."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import dgemma.engine as engine_package
from dgemma.bench.flops import saved_flops, unit_flops
from dgemma.engine.features import COUNTERS, FEATURES, Feature, bind
from dgemma.engine.request import Request, Stats

ENGINE = Path(engine_package.__file__).parent
FEATURE_MODULES = sorted(p.stem for p in (ENGINE / "features").glob("*.py") if p.stem not in ("__init__", "base"))


def _words_naming_features() -> set[str]:
    """Each feature's module, class and option name, and the SamplingParams fields its module reads."""
    words = set(FEATURE_MODULES)
    for f in FEATURES:
        words |= {type(f).__name__, f.name}
    for module in FEATURE_MODULES:
        words |= set(re.findall(r"params\.(\w+)", (ENGINE / "features" / f"{module}.py").read_text()))
    return words - {"max_denoising_steps", "max_new_tokens", "t_min", "replace"}  # plain parameters every row has


def _references(path: Path) -> set[str]:
    """The names and attributes a module's code uses, and the feature modules it imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {a.name for a in node.names}
            if node.module.startswith("dgemma.engine.features."):
                found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("dgemma.engine.features.")}
    return found


@pytest.mark.parametrize("module", ["engine.py", "scheduler.py"])
def test_the_engine_and_the_scheduler_name_no_feature(module):
    named = _references(ENGINE / module) & _words_naming_features()
    assert not named, f"engine/{module} names features: {sorted(named)}"


def test_request_has_no_feature_fields():
    fields = {f.name for f in dataclasses.fields(Request)}
    assert fields == {"id", "prompt", "params", "eos", "drafts", "generator", "output", "finish_reason", "stats",
                      "image_features", "state"}
    assert not {f.name for f in dataclasses.fields(Stats)} & {k.name for k in COUNTERS}  # counts live in one dict


def test_features_import_only_the_contract():
    for module in FEATURE_MODULES:
        tree = ast.parse((ENGINE / "features" / f"{module}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        others = {m for m in imported if m.startswith("dgemma.engine.features")} - {"dgemma.engine.features.base"}
        assert not others, f"features/{module}.py imports {sorted(others)}"


def test_requires_names_an_earlier_feature():
    names = [f.name for f in FEATURES]
    assert len(set(names)) == len(names) and all(names)
    for i, f in enumerate(FEATURES):
        assert set(f.requires) <= set(names[:i])
        assert set(f.needs) == set(f.requires)

    class Late(Feature):
        name, requires = "late", ("nowhere",)

    with pytest.raises(ValueError, match="requires"):
        bind((Late(),))


def test_every_counter_is_priced():
    from dgemma.config import ModelConfig, TextConfig

    cfg = ModelConfig(text=TextConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=8),
                      canvas_length=4)
    prices = unit_flops(cfg, 4)
    assert {k.unit for k in COUNTERS} <= set(prices)
    for k in COUNTERS:
        one = saved_flops(cfg, {k.name: 1}, 4)
        assert one == (prices[k.unit] if k.saves else -prices[k.unit]) != 0
