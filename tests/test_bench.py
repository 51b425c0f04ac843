"""The benchmark package on a tiny checkpoint: every engine runs, the table comes first and the JSON report is the
last stdout line, ratios come from the runs, each run records its settings, and the FLOP model adds up by hand.
Speed is never asserted here; only that the numbers exist and are consistent."""

import argparse
import json
import shutil
import subprocess
import sys

import pytest

from dgemma import bench
from dgemma.bench import flops, report, trials
from dgemma.bench.command import plan
from dgemma.bench.job import FIXED_STEPS_THRESHOLD, Job
from dgemma.config import ModelConfig, TextConfig
from dgemma.errors import DgemmaError
from reference import build_reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    build_reference("c", d)  # vocab 300, canvas 5
    return d


@pytest.fixture(scope="module")
def adaptive_ckpt(ckpt, tmp_path_factory):
    """The same weights with a generation_config.json of its own: at most 3 steps per canvas."""
    d = tmp_path_factory.mktemp("adaptive")
    for f in ckpt.iterdir():
        shutil.copy(f, d)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen.update(max_denoising_steps=3, confidence_threshold=0.5, t_min=0.2, t_max=0.3, eos_token_id=[1],
               sampler_config={"entropy_bound": 0.7, "_cls_name": "EntropyBoundSamplerConfig"})
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _bench(capsys, *argv: str) -> tuple[list[str], dict]:
    common = ("--prompt-len", "3", "--max-new-tokens", "7", "--dtype", "float32", "--repeats", "1",
              "--warmup", "0", "--matmul-size", "128", "--in-process")
    assert bench.run(_args(*argv, *common)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_fixed_steps_runs_every_engine_and_ends_with_json(ckpt, capsys):
    lines, rep = _bench(capsys, "--model", str(ckpt), "--steps", "2", "--batch", "1,2", "--rounds", "2")
    assert any("tok/s" in line and "rows/pass" in line and "done-row s" in line for line in lines)
    assert set(rep) == {"schema", "model", "settings", "machine", "runs", "ratios"}  # measurements only
    assert not any("target" in line for line in lines)
    assert rep["machine"]["matmul"]["float32"]["gflops"] > 0 and rep["machine"]["cpu_capability"]
    runs = {(r["engine"], r["batch"]): r for r in rep["runs"]}
    assert set(runs) == {("dgemma", 1), ("dgemma", 2), ("autoregressive", 1), ("speculative", 1), ("reference", 1)}
    for (engine, batch), r in runs.items():
        assert "error" not in r, r.get("error")
        assert r["tokens"] == 7 * batch and r["row_tokens"] == [7] * batch  # EOS ignored: fixed length
        assert r["rounds"] == 2 and len(r["seconds_all"]) == 2  # 1 repeat x 2 rounds, pooled
        assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["flop_bound_seconds_per_step"] > 0 and r["bound_ratio"] > 0
        assert r["peak_rss_bytes"] > 0 and r["weights_bytes"] > 0
        assert r["ttft_seconds"] is not None and 0 < r["ttft_seconds"] <= r["seconds"]
        if engine not in ("autoregressive", "speculative"):
            assert r["steps_per_canvas"] == [[2, 2]] * batch  # 7 tokens = 2 canvases of 5, exactly --steps each
            assert r["tokens_per_forward"] == pytest.approx(7 / 4)
            assert r["settings"]["steps"] == "--steps 2 (fixed)"
            assert r["settings"]["max_denoising_steps"] == 2
            assert r["settings"]["confidence_threshold"] == FIXED_STEPS_THRESHOLD
        if engine == "dgemma":  # both rows in each of the 4 passes; none carried after its canvas was done
            assert (r["rows_per_pass"], r["done_rows"], r["done_row_seconds"]) == (batch, 0, 0.0)
        else:
            assert r["rows_per_pass"] is None and r["done_row_seconds"] is None
    d1, ar, spec = runs[("dgemma", 1)], runs[("autoregressive", 1)], runs[("speculative", 1)]
    assert ar["settings"] == {"mode": "autoregressive", "eos": "ignored", "temperature": 0.0}
    assert spec["settings"] == {"mode": "speculative", "eos": "ignored", "temperature": 0.0}
    # the prefill's head gives the first id, each cycle a draft pass and a checking pass
    drafted = sum(d for _, _, d in spec["cycles"][0])
    assert spec["passes"] == 1 + len(spec["cycles"][0]) + drafted and ar["passes"] == 7
    ratios = rep["ratios"]
    assert "diffusion_vs_autoregressive_float32" not in ratios  # fixed steps are not what a user runs
    assert ratios == pytest.approx({
        "fixed_2_steps_diffusion_vs_autoregressive_float32": d1["tokens_per_second"] / ar["tokens_per_second"],
        "fixed_2_steps_dgemma_float32_vs_reference_float32":
            d1["tokens_per_second"] / runs[("reference", 1)]["tokens_per_second"],
        "fixed_2_steps_batch2_vs_batch1_dgemma_float32":
            runs[("dgemma", 2)]["tokens_per_second"] / d1["tokens_per_second"],
        "fixed_2_steps_diffusion_vs_speculative_float32": d1["tokens_per_second"] / spec["tokens_per_second"],
        "speculative_vs_autoregressive_float32": spec["tokens_per_second"] / ar["tokens_per_second"]})


@pytest.mark.parametrize("engine", ["dgemma", "speculative"])
def test_multi_turn_reuses_each_turns_prompt_and_answer(ckpt, capsys, engine):
    """`--scenario multi-turn`, diffusion or the one token engine --engines names: every later turn's prompt is
    the previous prompt, its answer and --turn-tokens new ids, and the prefix cache gives it the previous prompt
    and answer (all of it but an uncached last canvas or token), with the answers it gets without the cache."""
    _, rep = _bench(capsys, "--model", str(ckpt), "--scenario", "multi-turn", "--engines", engine, "--turns", "3",
                    "--turn-tokens", "4", "--steps", "2")  # prompt 3 tokens, answers 7
    assert rep["mode"] == ("diffusion" if engine == "dgemma" else engine) and rep["identical_outputs"]
    with_cache, without = rep["per_turn"]["with"], rep["per_turn"]["without"]
    assert [t["cached_tokens"] for t in without] == [0, 0, 0] and with_cache[0]["cached_tokens"] == 0
    for before, turn in zip(with_cache, with_cache[1:]):
        answer = turn["prompt_tokens"] - before["prompt_tokens"] - 4  # 7 tokens: EOS is ignored
        assert answer == 7 and before["prompt_tokens"] < turn["cached_tokens"] <= before["prompt_tokens"] + answer


def test_default_runs_at_the_checkpoints_adaptive_settings(adaptive_ckpt, capsys):
    _, rep = _bench(capsys, "--model", str(adaptive_ckpt), "--engines", "dgemma,autoregressive,reference",
                    "--batch", "1", "--steps", "auto,2")
    assert rep["settings"]["steps"] == "auto,2"
    runs = {(r["engine"], r["steps"]): r for r in rep["runs"]}
    assert set(runs) == {("dgemma", None), ("dgemma", 2), ("reference", None), ("reference", 2),
                         ("autoregressive", None)}
    for engine in ("dgemma", "reference"):
        r = runs[(engine, None)]
        assert "error" not in r, r.get("error")
        assert r["steps"] is None
        s = r["settings"]
        assert s["steps"] == "checkpoint defaults (adaptive)"
        assert (s["max_denoising_steps"], s["confidence_threshold"], s["entropy_bound"], s["t_min"], s["t_max"]) \
            == (3, 0.5, 0.7, 0.2, 0.3)  # from generation_config.json, nothing forced
        assert len(r["steps_per_canvas"][0]) == 2 and all(1 <= n <= 3 for n in r["steps_per_canvas"][0])
        assert runs[(engine, 2)]["steps_per_canvas"] == [[2, 2]]
    assert runs[("reference", None)]["settings"]["sampling"] == "transformers"
    tps = {k: r["tokens_per_second"] for k, r in runs.items()}
    assert rep["ratios"] == pytest.approx({
        "diffusion_vs_autoregressive_float32": tps["dgemma", None] / tps["autoregressive", None],
        "dgemma_float32_vs_reference_float32": tps["dgemma", None] / tps["reference", None],
        "fixed_2_steps_diffusion_vs_autoregressive_float32": tps["dgemma", 2] / tps["autoregressive", None],
        "fixed_2_steps_dgemma_float32_vs_reference_float32": tps["dgemma", 2] / tps["reference", 2]})


def test_steps_are_not_forced_by_default():
    """No --steps: every diffusion job runs the checkpoint's defaults; `auto,4` adds fixed-step jobs beside them."""
    args = _args()
    assert args.steps == "auto" and args.dtype == "float32,bfloat16"
    jobs = plan(args, "m")
    assert {j.steps for j in jobs} == {None}
    assert all("max_denoising_steps" not in j.overrides() for j in jobs)
    assert [(j.engine, j.batch) for j in jobs if j.dtype == "float32"] == [
        ("dgemma", 1), ("dgemma", 4), ("reference", 1), ("autoregressive", 1), ("speculative", 1)]
    both = plan(_args("--steps", "auto,4", "--batch", "1", "--dtype", "float32"), "m")
    assert [(j.engine, j.steps) for j in both] == [("dgemma", None), ("dgemma", 4), ("reference", None),
                                                   ("reference", 4), ("autoregressive", None),
                                                   ("speculative", None)]
    assert both[1].overrides()["max_denoising_steps"] == 4


@pytest.mark.parametrize("argv", [("--dtype", "float16"), ("--engines", "dgemma,vllm"), ("--steps", "0"),
                                  ("--steps", "4,x"), ("--batch", "0"), ("--batch", "one")])
def test_plan_refuses_bad_arguments(argv):
    with pytest.raises(DgemmaError):
        plan(_args(*argv), "m")


def test_ratios_come_from_runs():
    def run(engine, tps, batch=1, steps=None, dtype="float32"):
        return {"engine": engine, "dtype": dtype, "batch": batch, "steps": steps, "tokens_per_second": tps}

    at_defaults = [run("dgemma", 50.0), run("autoregressive", 80.0), run("dgemma", 120.0, batch=4),
                   run("reference", 25.0), run("dgemma", 9.0, dtype="bfloat16"), {**run("autoregressive", 0.0),
                                                                                     "dtype": "bfloat16"}]
    assert report.compute_ratios(at_defaults) == pytest.approx({
        "diffusion_vs_autoregressive_float32": 50 / 80, "dgemma_float32_vs_reference_float32": 2.0,
        "batch4_vs_batch1_dgemma_float32": 120 / 50, "dgemma_bfloat16_vs_reference_float32": 9 / 25})
    fixed = [run("dgemma", 200.0, steps=4), run("autoregressive", 80.0), run("reference", 20.0),
             run("reference", 40.0, steps=4), run("dgemma", 100.0, batch=2)]
    assert report.compute_ratios(fixed) == {"fixed_4_steps_diffusion_vs_autoregressive_float32": 2.5,
                                            "fixed_4_steps_dgemma_float32_vs_reference_float32": 5.0}
    # like with like: no reference at other steps, no batch ratio without a batch-1 run at the same steps


def test_flop_model_by_hand():
    """One full-attention layer, hidden 2, one head of 2, MLP 3, 2 experts (top 1) of 1, vocabulary 5, canvas 2.
    Per token: projections 2*2*(2*2 + 2) = 24, MLP 6*2*3 = 36, router 2*2*2 = 8, expert 6*2*1 = 12: 80;
    attention 4 * 2 = 8 per (query, key) pair."""
    t = TextConfig(vocab_size=5, hidden_size=2, intermediate_size=3, num_hidden_layers=1, num_attention_heads=1,
                   num_key_value_heads=1, head_dim=2, num_experts=2, top_k_experts=1, moe_intermediate_size=1)
    cfg = ModelConfig(text=t, canvas_length=2)
    assert flops.body_flops(t, 3, 0, causal=True) == 3 * 80 + 8 * (1 + 2 + 3)  # prefill: 288
    assert flops.body_flops(t, 2, 3, causal=False) == 2 * 80 + 8 * 2 * (3 + 2)  # canvas after 3: 240
    f = flops.diffusion_flops(cfg, prompt_len=3, steps_per_canvas=[2, 1])
    assert f["lm_head"] == 2 * 2 * 2 * 5 and f["self_conditioning"] == 2 * 2 * 5 * 2 + 6 * 2 * 2 * 3
    # prefill 288; canvas 0: 2 x (240 + 40) + 1 x 112 self-conditioning, commit 160 + 8 x (4 + 5);
    # canvas 1 after 5 tokens: 1 x (160 + 8 x 14 + 40), no self-conditioning on its only step, no commit.
    assert f["total"] == 288 + 672 + 232 + 312 and f["steps"] == 3
    a = flops.autoregressive_flops(cfg, prompt_len=3, tokens=2)
    assert a["total"] == 288 + 2 * 20 + (80 + 8 * 4) and a["steps"] == 2


def test_bounds_use_the_steps_each_row_ran(ckpt):
    cfg = ModelConfig(text=TextConfig(vocab_size=5, hidden_size=2, intermediate_size=3, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=2, num_experts=2,
                                      top_k_experts=1, moe_intermediate_size=1), canvas_length=2)
    machine = {"matmul": {"float32": {"gflops": 1e-9}}}  # 1 FLOP/s: the bound is the FLOP count
    run = {"engine": "dgemma", "dtype": "float32", "batch": 2, "prompt_len": 3, "total_steps": 3,
           "seconds_per_step": 3008.0, "steps_per_canvas": [[2, 1], [2, 1]]}
    out = flops.add_bounds(run, cfg, machine)
    assert out["flops"] == 2 * 1504 and out["flop_bound_seconds_per_step"] == pytest.approx(2 * 1504 / 3)
    assert out["bound_ratio"] == pytest.approx(3.0)
    assert flops.add_bounds({**run, "error": "x"}, cfg, machine) == {**run, "error": "x"}


def test_isolated_worker_returns_its_json(ckpt):
    job = Job("autoregressive", "float32", 1, str(ckpt), "cpu", prompt_len=3, max_new_tokens=4, steps=None,
              repeats=1, warmup=0, seed=0, sampling="fast", ignore_eos=True, threads=1)
    out = trials.run_isolated(job, timeout=300)
    assert "error" not in out, out.get("error")
    assert [s["tokens"] for s in out["samples"]] == [[4]] and out["peak_rss_bytes"] > 0
    assert trials.pool([out])["tokens"] == 4


def test_pool_merges_rounds():
    def out(seconds, peak):
        sample = {"seconds": seconds, "tokens": [8], "passes": [4], "steps": 4, "steps_per_canvas": [[4]],
                  "ttft_seconds": seconds / 2}
        return {"engine": "dgemma", "samples": [sample], "peak_rss_bytes": peak, "weights_bytes": 10}

    run = trials.pool([out(1.0, 100), out(3.0, 300), out(2.0, 200)])
    assert run["seconds"] == 2.0 and run["seconds_all"] == [1.0, 3.0, 2.0] and run["tokens_per_second"] == 4.0
    assert run["peak_rss_bytes"] == 300 and run["extra_memory_bytes"] == 290 and run["rounds"] == 3
    assert "samples" not in run
    assert trials.pool([out(1.0, 100), {"engine": "dgemma", "error": "boom"}]) == {"engine": "dgemma", "error": "boom"}


def test_importing_the_command_does_not_import_torch():
    code = "import sys, dgemma.bench; print('torch' in sys.modules, callable(dgemma.bench.run))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_gpu_script_runs_on_small_shapes():
    """The prepared accelerator run, on the CPU with small shapes: every measurement it promises is there."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "--tiny", "--dtype", "float32", "--shapes",
                        "real", "--batch", "1", "--steps", "4", "--max-new-tokens", "64", "--ar-tokens", "3"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    diffusion, ar = report["runs"]
    assert (diffusion["mode"], ar["mode"]) == ("diffusion", "autoregressive")
    assert diffusion["tokens"] == 64 and ar["tokens"] == 3
    assert diffusion["seconds_per_step"] > 0 and diffusion["host_reads_per_step"] >= 1


def test_image_abuse_script_runs_one_prep_case():
    """benchmarks/abuse_images.py end to end on one small case: a report per case, the JSON last (targets are the
    script's to judge, not this test's)."""
    from pathlib import Path

    pytest.importorskip("PIL")
    if not Path("/proc/self/status").exists():
        pytest.skip("reads the server's memory from /proc (Linux)")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "abuse_images.py"
    r = subprocess.run([sys.executable, str(script), "--scenarios", "prep", "--prep-cases", "gif_7000x7000_palette"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    case = report["prep"]["cases"]["gif_7000x7000_palette"]
    assert case["status"] == 200 and case["seconds"] > 0 and case["rss_growth_mb"] is not None
    assert report["ok"] == report["prep"]["ok"] == case["ok"]
