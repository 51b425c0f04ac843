"""The benchmark harness on a tiny checkpoint: every engine runs, a table is printed, the last line is the JSON report.
Speed is never asserted here; only that the numbers exist and are sane."""

import argparse
import json

import pytest

from dgemma import bench
from dgemma.weights.hf import read_config
from reference import build_reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    build_reference("c", d)  # vocab 300, canvas 5
    return d


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_runs_every_engine_and_ends_with_json(ckpt, capsys):
    args = _args("--model", str(ckpt), "--prompt-len", "3", "--max-new-tokens", "7", "--steps", "2",
                 "--batch", "1,2", "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                 "--matmul-size", "128", "--in-process")
    assert bench.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("tok/s" in line and "x bound" in line for line in lines)
    report = json.loads(lines[-1])
    assert set(report) >= {"schema", "model", "settings", "machine", "runs", "ratios", "targets"}
    assert report["machine"]["matmul"]["float32"]["gflops"] > 0
    runs = {(r["engine"], r["batch"]): r for r in report["runs"]}
    assert set(runs) == {("dgemma", 1), ("dgemma", 2), ("autoregressive", 1), ("reference", 1)}
    for (engine, batch), r in runs.items():
        assert "error" not in r, r.get("error")
        assert r["tokens"] == 7 * batch  # EOS ignored: fixed work
        assert r["tokens_per_second"] > 0 and r["seconds_per_step"] > 0
        assert r["flop_bound_seconds_per_step"] > 0 and r["bound_ratio"] > 0
        assert r["peak_rss_bytes"] > 0 and r["weights_bytes"] > 0
        assert r["ttft_seconds"] is not None and 0 < r["ttft_seconds"] <= r["seconds"]
        if engine != "autoregressive":
            assert r["steps_per_canvas"] == [2, 2]  # 7 tokens = 2 canvases of 5, exactly --steps each
            assert r["tokens_per_forward"] == pytest.approx(7 / 4)
    for key in ("dgemma_float32_vs_reference_float32", "dgemma_float32_vs_autoregressive_float32",
                "batch2_vs_batch1_dgemma_float32"):
        assert report["ratios"][key] > 0


def test_flop_count_adds_up(ckpt):
    """One canvas: prefill + steps x (body + LM head) + (steps - 1) x self-conditioning (none on the first step)."""
    cfg = read_config(ckpt)
    t, c = cfg.text, cfg.canvas_length
    f = bench.diffusion_flops(cfg, prompt_len=3, max_new=c, steps=4)
    assert f["lm_head"] == 2 * c * t.hidden_size * t.vocab_size
    body = bench.body_flops(t, c, 3, causal=False)
    expected = bench.body_flops(t, 3, 0, causal=True) + 4 * (body + f["lm_head"]) + 3 * f["self_conditioning"]
    assert f["total"] == pytest.approx(expected)
    assert f["decoder_step"] == pytest.approx(body + f["lm_head"] + f["self_conditioning"])
    assert bench.body_flops(t, c, 100, causal=False) > body  # attention grows with the context
