"""Tensor and expert parallelism on 2 gloo ranks against one process (float32): encode / denoise logits of a tiny
model with MoE, sliding and full attention and GQA, and its fused vocabulary step over the sharded vocabulary (plain
and quantized), generated ids of the bundled demo model at its defaults, in every mode and with the options that
read the vocabulary otherwise, seeds drawn by rank 0, per-rank weight bytes; and the one-line refusals."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import dgemma
from dgemma import parallel
from dgemma.config import FULL, SLIDING, ModelConfig, TextConfig
from dgemma.errors import ConfigError, SamplingParamsError
from dgemma.model import DiffusionGemma
from dgemma.parallel.shard import check
from dgemma.quant import kernels
from dgemma.sampling.fused import num_uniforms, vocab_step
from dgemma.weights import save_model

WORLD = 2
# 4 query heads: sliding layers 2 KV heads (split, one a rank), the full layer 1 (kept whole on both ranks)
TINY = ModelConfig(TextConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, layer_types=(SLIDING, SLIDING, FULL),
    per_layer={2: {"head_dim": 32, "num_key_value_heads": 1}}, sliding_window=8, num_experts=4, top_k_experts=2,
    moe_intermediate_size=32, max_position_embeddings=512), canvas_length=8)
PROMPT = [2, 651, 1024, 77, 900, 12, 3000, 45]
COMMAND_TOKENS = 32  # one canvas of the demo model
# the fused step's sparse soft embedding and settled positions; the processed step (whole logits) and logprobs
OPTIONS = {"sparse": dict(soft_top_k=8, skip_settled=2), "knobs": dict(top_p=0.9, logit_bias={5: 2.0}, logprobs=2)}


def passes(model: DiffusionGemma) -> list[torch.Tensor]:
    """Logits of a 12-token prompt (past the sliding window) and of two denoising steps, the second self-conditioned."""
    g = torch.Generator().manual_seed(1)
    ids, canvas = torch.randint(3, 256, (2, 12), generator=g), torch.randint(3, 256, (2, 8), generator=g)
    cache = model.new_cache(2, 32)
    encoded = model.head(model.encode(ids, cache))
    first = model.head(model.denoise(canvas, cache))
    return [encoded, first, model.head(model.denoise(canvas, cache, signal=model.soft_embed(first)))]


def steps(model: DiffusionGemma) -> list:
    """The fused vocabulary step over denoised hidden states, with a dense and a sparse soft embedding, in chunks of
    64 (a rank streams 2 of one process's 4) and of 256 (one process's one chunk spans both ranks)."""
    g = torch.Generator().manual_seed(2)
    hidden = model.denoise(torch.randint(3, 256, (2, 8), generator=g), model.new_cache(2, 16)).flatten(0, 1)
    inv_temp, head = torch.full((16,), 1.5), model.lm_head
    return [vocab_step(hidden, head.weight, head.softcap, head.scale, inv_temp,
                       torch.rand(16, num_uniforms(256, chunk), generator=g), chunk=chunk, top_k=k, shard=head.shard)
            for chunk, k in ((64, None), (64, 4), (256, None))]


def compare_steps(one: list, tp: list) -> dict:
    return {"ids": all(torch.equal(a.argmax, b.argmax) and torch.equal(a.sample, b.sample) for a, b in zip(one, tp)),
            "diff": max(max((a.entropy - b.entropy).abs().max().item(), (a.signal - b.signal).abs().max().item())
                        for a, b in zip(one, tp)),
            "drawn": sum(int((a.sample != a.argmax).sum()) for a in one)}

def _rank(rank: int, port: int, tiny: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    kernels.KERNEL_ROWS.clear()  # decode + GEMM for every call: sharded codes must give one process's logits exactly
    results = {}
    with torch.no_grad():
        for quantize in (None, "int8", "nvfp4"):
            one = dgemma.load(tiny, dtype="float32", quantize=quantize).module
            tp = dgemma.load(tiny, dtype="float32", quantize=quantize, tensor_parallel_size=WORLD).module
            results[quantize] = {"diff": max((a - b).abs().max().item() for a, b in zip(passes(one), passes(tp))),
                                 "step": compare_steps(steps(one), steps(tp)),
                                 "one": parallel.weight_bytes(one), "rank": parallel.weight_bytes(tp)}
    kwargs = dict(max_new_tokens=COMMAND_TOKENS, seed=0)
    single_model = dgemma.load(dtype="float32")
    single = single_model.generate(PROMPT, **kwargs)
    demo = dgemma.load(dtype="float32", tensor_parallel_size=WORLD)
    results["ids"] = (single.token_ids, demo.generate(PROMPT, **kwargs).token_ids)
    results["unseeded"] = demo.generate(PROMPT, max_new_tokens=16).token_ids
    for mode, sampling in (("autoregressive", "fast"), ("diffusion", "reference"), ("speculative", "fast")):
        kwargs = dict(max_new_tokens=8, seed=1, mode=mode, sampling=sampling)
        results[mode, sampling] = (single_model.generate(PROMPT, **kwargs).token_ids,
                                   demo.generate(PROMPT, **kwargs).token_ids)
    for name, options in OPTIONS.items():
        runs = [m.generate(PROMPT, max_new_tokens=16, seed=2, **options) for m in (single_model, demo)]
        results[name] = [(r.token_ids, r.logprobs) for r in runs]
    for name, options in (("timed", {"target_canvas_ms": 50.0}), ("speculative", {"mode": "speculative"})):
        demo.speculative_pacing = "timed"
        try:
            demo.generate(PROMPT, max_new_tokens=4, **options)
        except SamplingParamsError as e:
            results[name] = str(e)
    demo.speculative_pacing = "counted"
    parallel.leave()
    torch.save(results, os.path.join(out, f"{rank}.pt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of 2 gloo ranks measured (one process's numbers computed beside them, in the same rank)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from build_bench_checkpoint import randomise

    tiny = tmp_path_factory.mktemp("tiny")
    model = DiffusionGemma(TINY).eval()
    randomise(model, 0)
    save_model(model, tiny, dtype=torch.float32)
    out = tmp_path_factory.mktemp("ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(_free_port(), str(tiny), str(out)), nprocs=WORLD)
    return [torch.load(out / f"{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8", "nvfp4"])
def test_logits_match_one_process(ranks, quantize):
    for r in ranks:
        assert r[quantize]["diff"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8", "nvfp4"])
def test_fused_vocabulary_step_matches_one_process(ranks, quantize):
    """Each rank streams its half of the vocabulary; the merged argmax and samples equal one process's, entropy
    and soft embeddings (dense and top-k) within 1e-4."""
    for r in ranks:
        step = r[quantize]["step"]
        assert step["ids"] and step["diff"] < 1e-4 and step["drawn"] > 4  # samples other than the argmax


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8", "nvfp4"])
def test_each_rank_holds_half_of_the_sharded_weights(ranks, quantize):
    for r in ranks:
        one, mine = r[quantize]["one"], r[quantize]["rank"]
        assert mine["replicated"] == one["replicated"]
        # the full layer's one KV head is on both ranks: a little over half
        assert one["sharded"] / WORLD <= mine["sharded"] <= 0.55 * one["sharded"]
        assert mine["embedding"] * WORLD == one["embedding"] > 0  # codes and scales alike


@pytest.mark.slow
def test_generated_ids_match_one_process(ranks):
    for r in ranks:
        single, tp = r["ids"]
        assert tp == single and len(single) > 8
    assert ranks[0]["unseeded"] == ranks[1]["unseeded"]  # rank 0's drawn seed on both


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("autoregressive", "fast"), ("diffusion", "reference"), ("speculative", "fast")])
def test_other_decodings_match_one_process(ranks, mode):
    single, tp = ranks[0][mode]
    assert tp == single and len(single) > 4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIONS))
def test_sampling_options_match_one_process(ranks, name):
    """Options that read the sharded vocabulary otherwise: a sparse soft embedding and settled positions in the
    fused step; sampling knobs (the whole logits, gathered) and logprobs."""
    (single, single_logprobs), (tp, tp_logprobs) = ranks[0][name]
    assert tp == single and len(single) > 8
    if single_logprobs is not None:  # (token, logprob, [(alternative, logprob), ...]) per token
        pairs = [(a, b) for x, y in zip(single_logprobs, tp_logprobs) for a, b in zip([x[:2], *x[2]], [y[:2], *y[2]])]
        assert len(pairs) > 16 and all(a[0] == b[0] and abs(a[1] - b[1]) < 1e-4 for a, b in pairs)


@pytest.mark.slow
def test_wall_time_decisions_are_refused(ranks):
    assert "target_canvas_ms" in ranks[0]["timed"] and "timed speculative pacing" in ranks[0]["speculative"]


def test_shapes_that_do_not_split_are_refused():
    with pytest.raises(ConfigError, match="does not divide num_attention_heads=4"):
        check(TINY.text, 3)
    text = TextConfig(num_attention_heads=12, num_key_value_heads=3, head_dim=16)  # 6 heads a rank, groups of 4
    with pytest.raises(ConfigError, match="query heads per rank neither hold"):
        check(text, 2)


def test_a_size_without_as_many_processes_is_refused():
    with pytest.raises(ConfigError, match="needs 2 processes, this run has 1"):
        parallel.join(2, torch.device("cpu"))


@pytest.mark.slow
def test_the_command_starts_its_ranks_and_prints_once(ranks):
    """`dgemma generate -tp 2` outside torchrun starts 2 ranks; rank 0 alone prints, the ids one process gives."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    flags = ["generate", "--prompt-ids", ",".join(map(str, PROMPT)), "--dtype", "float32", "--seed", "0",
             "--max-new-tokens", str(COMMAND_TOKENS), "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "dgemma", *flags, "-tp", "2"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    assert json.loads(line)["token_ids"] == ranks[0]["ids"][0]  # one process's


@pytest.mark.slow
def test_chat_reads_its_lines_on_rank_0_only():
    """`dgemma chat -tp 2` from a pipe: rank 0 reads each line and hands it to rank 1; the conversation equals one
    process's (the same answers, turn by turn)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    flags = ["chat", "--dtype", "float32", "--seed", "0", "--max-new-tokens", "12"]
    lines = "Hello\nWho are you\n"
    runs = [subprocess.run([sys.executable, "-m", "dgemma", *flags, *extra], input=lines, capture_output=True,
                           text=True, env=env, timeout=300) for extra in ([], ["-tp", "2"])]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-3000:]
    assert runs[1].stdout == runs[0].stdout and runs[0].stdout.count("\n") >= 2


def _formats(w: torch.Tensor) -> list:
    from dgemma.quant import quantize_tensor
    from dgemma.quant.fp import FP8Weight, nvfp4_weight

    codes = w.to(torch.float8_e4m3fn)
    return [quantize_tensor(w, 8), quantize_tensor(w, 4), FP8Weight(codes, torch.rand(*w.shape[:-1], 1), w.dtype),
            FP8Weight(codes, torch.rand(*w.shape[:-1], w.shape[-1] // 32), w.dtype),
            nvfp4_weight(lambda lo, hi: w[lo:hi], tuple(w.shape), w.dtype, w.device)]


@pytest.mark.parametrize("dims", [(-2, 8, 24), (-1, 32, 96), (0, 1, 3)])
def test_quantized_weights_shard_as_their_float_weights(dims):
    """Rows, columns at group boundaries and experts of every format decode to that part of the whole weight."""
    from dgemma.parallel.shard import _quantized

    dim, lo, hi = dims
    for q in _formats(torch.randn(4, 32, 128)):
        part = _quantized(q, dim, lo, hi)
        assert torch.equal(part.dequantize(), q.dequantize().narrow(dim, lo, hi - lo)), q.format


def test_a_cut_inside_a_quantization_group_is_refused():
    from dgemma.parallel.shard import _quantized

    _, int4, per_channel, _, _ = _formats(torch.randn(32, 128))
    with pytest.raises(ConfigError, match="cut its groups of 32"):
        _quantized(int4, -1, 16, 80)
    part = _quantized(per_channel, -1, 16, 80)  # one scale a row: any cut
    assert torch.equal(part.dequantize(), per_channel.dequantize()[:, 16:80])


def test_vocabulary_shards_sum_to_the_whole_embedding(monkeypatch):
    """The embedding's rows split over the ranks, float and every quantized format: the ranks' lookups (zeros for
    the other ranks' ids) and soft embeddings (each its part of p @ E) sum to the whole embedding's (the
    all-reduce, stubbed)."""
    from types import SimpleNamespace

    from dgemma.model import head
    from dgemma.parallel.shard import _quantized

    monkeypatch.setattr(head, "all_reduce", lambda x, group: x)
    torch.manual_seed(0)
    w, ids, logits, width = torch.randn(64, 128), torch.randint(0, 64, (3, 5)), torch.randn(3, 64), 64 // WORLD
    for q in [w, *_formats(w)]:
        whole = head.Head(SimpleNamespace(weight=q), None, 2.0)
        rows, soft = [], []
        for lo in range(0, 64, width):
            part = q[lo:lo + width] if isinstance(q, torch.Tensor) else _quantized(q, -2, lo, lo + width)
            mine = head.Head(SimpleNamespace(weight=part), None, 2.0)
            mine.shard = head.VocabShard(lo, lo + width, 64, "stub")
            rows.append(mine.rows(ids))
            soft.append(mine.soft_embed(logits))
        torch.testing.assert_close(sum(rows), whole.rows(ids))
        torch.testing.assert_close(sum(soft), whole.soft_embed(logits), rtol=1e-5, atol=1e-5)


def test_expert_shards_sum_to_the_whole_layer(monkeypatch):
    """Each rank's experts give their rows' part, zero where none of its experts was chosen (here rank 1, with
    every row routed to experts 0 and 1); the parts sum to the one-process layer (the all-reduce, stubbed)."""
    import copy

    from dgemma.model import moe
    from dgemma.parallel.shard import _experts

    monkeypatch.setattr(moe, "all_reduce", lambda x, group: x)
    torch.manual_seed(0)
    layer = moe.Experts(TINY.text)
    torch.nn.init.normal_(layer.gate_up_proj, std=0.1), torch.nn.init.normal_(layer.down_proj, std=0.1)
    x, weights = torch.randn(5, 64), torch.rand(5, 2)
    for ids in (torch.randint(0, 4, (5, 2)), torch.tensor([[0, 1]] * 5)):
        parts = []
        for rank in range(WORLD):
            mine = copy.deepcopy(layer)
            _experts(mine, parallel.Group(rank, WORLD, pg="stub"))
            parts.append(mine(x, weights, ids))
        torch.testing.assert_close(parts[0] + parts[1], layer(x, weights, ids), rtol=1e-5, atol=1e-6)
    assert not parts[1].any()


@pytest.mark.slow
def test_serve_under_tensor_parallelism(tmp_path):
    """`dgemma serve -tp 2`: rank 0 serves, rank 1 follows its engine; concurrent requests (streamed and whole,
    batched together) and an image chat give one process's text for each seed; SIGTERM drains an in-flight request,
    then every rank exits."""
    import json
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "-tp", "2", "--dtype", "float32", "--port",
                                 str(port), "--shutdown-timeout", "60"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _ready(url):
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(1)

        def ask(seed: int, stream: bool, tokens: int = 16) -> str:
            body = {"prompt": [*PROMPT[:4], 77 + seed], "max_tokens": tokens, "seed": seed, "stream": stream}
            if not stream:
                return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda s: ask(s, s % 2 == 1), range(4)))
        one = dgemma.load(dtype="float32")
        assert got == [one.generate([*PROMPT[:4], 77 + s], max_new_tokens=16, seed=s).text for s in range(4)]
        image = _image_chat()  # rank 0's tower runs; its features travel to rank 1 with the prompt
        answer = httpx.post(url + "/v1/chat/completions", json={"messages": image, "max_tokens": 16, "seed": 5},
                            timeout=120).json()["choices"][0]["message"]["content"]
        assert answer == one.generate(image, max_new_tokens=16, seed=5).text
        with ThreadPoolExecutor(1) as pool:
            late = pool.submit(ask, 9, False, 96)
            time.sleep(1.0)
            launcher.send_signal(signal.SIGTERM)
            assert late.result() == one.generate([*PROMPT[:4], 86], max_new_tokens=96, seed=9).text
        launcher.wait(timeout=90)
        assert subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True).stdout == b""
    finally:
        if launcher.poll() is None:
            launcher.kill()
        subprocess.run(["pkill", "-f", f"--port {port}"])


def _image_chat() -> list[dict]:
    import base64
    import io

    from PIL import Image

    pixels = torch.randint(0, 256, (30, 40, 3), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
