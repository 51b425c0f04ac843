import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: threading overhead would dominate, and the machine is shared.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory):
    """(server, openai client) of the served tiny checkpoint with EOS id 1, one per test module."""
    from server_fixtures import openai_server, served_checkpoint

    pytest.importorskip("openai")
    with openai_server(served_checkpoint(tmp_path_factory), max_concurrency=8) as pair:
        yield pair


@pytest.fixture(scope="module")
def eos_server(served_pair):
    return served_pair[0]


@pytest.fixture(scope="module")
def openai_client(served_pair):
    return served_pair[1]


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    """A tiny random model in bf16 (widths divisible by 32, so every quantization scheme's groups fit)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from build_bench_checkpoint import bench_config, randomise

    from dgemma.model import DiffusionGemma
    from dgemma.weights import save_model

    out = tmp_path_factory.mktemp("float")
    model = DiffusionGemma(bench_config(hidden=64, layers=2, vocab=512, canvas=16)).eval()
    randomise(model, 0)
    save_model(model, out, dtype=torch.bfloat16)
    return out


def _reference_configs():
    from reference import CONFIGS

    return sorted(CONFIGS)


@pytest.fixture(scope="module", params=_reference_configs())
def reference_pair(request, tmp_path_factory):
    """(transformers model, dgemma Model) of one tiny reference configuration, the same random weights."""
    import dgemma
    from reference import build_reference

    d = tmp_path_factory.mktemp(f"ref_{request.param}")
    return build_reference(request.param, d), dgemma.load(d)
