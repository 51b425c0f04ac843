"""Same seed, inputs and dtype -> same ids (issue 43): no decision that changes numerics reads the clock by default
(speculative pacing counts ids; `pacing="timed"` and `target_canvas_ms` are the opt-ins that do), the runs agree
while another process loads the CPU, and at the default dtype speculative decoding gives autoregressive decoding's
ids: on a CPU with native bf16 its check attends row by row, so its logits are the plain steps' bit for bit."""

import itertools
import subprocess
import sys
import threading
import types

import pytest
import torch

import dgemma
from dgemma.cli import main
from dgemma.dtypes import native_bf16
from dgemma.engine import SpeculativeEngine, speculative

PROMPTS = ("Once upon a time", "She said that", "Why is the sky blue?")


@pytest.fixture(scope="module")
def model():
    return dgemma.load()  # the default dtype: bfloat16 where the CPU has native bf16, else float32


def _ids(model, mode, prompt, **options):
    r = model.generate(prompt, mode=mode, max_new_tokens=96, eos_token_ids=(), **options)
    return r.token_ids, r.stats.get("cycles")


@pytest.mark.skipif(not native_bf16("cpu"), reason="row-exact checks need bf16 GEMMs (a CPU with native bf16)")
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_a_rows_apart_pass_is_one_token_passes_bit_for_bit(quantize):
    """32 new tokens in one encoder pass (rows_apart) against 32 one-token passes, across the sliding window's edge
    and the ring's wrap, with float or quantized weights: the same logits, bit for bit."""
    m = dgemma.load(dtype="bfloat16", quantize=quantize).module
    g = torch.Generator().manual_seed(0)
    prompt, new = (torch.randint(3, m.cfg.text.vocab_size, (1, n), generator=g) for n in (120, 32))
    one, apart = m.new_cache(1, 200), m.new_cache(1, 200)
    m.prefill(prompt, one)
    m.prefill(prompt, apart)
    with torch.inference_mode():
        steps = torch.cat([m.head(m.encode(new[:, i:i + 1], [one])) for i in range(new.shape[1])], dim=1)
        together = m.head(m.encode(new, [apart], rows_apart=True))
    assert speculative.rows_apart_exact(m) and m.dtype == torch.bfloat16
    assert torch.equal(steps, together)


@pytest.mark.parametrize("paced", [True, False])
def test_speculative_ids_are_autoregressive_at_the_default_dtype(model, monkeypatch, paced):
    """Greedy and sampled, paced by counts or drafting at every step: the prompts whose ids parted at token 24-65
    before the check attended row by row (bf16) give the autoregressive ids."""
    monkeypatch.setattr(SpeculativeEngine, "paced", paced)
    for prompt, t in itertools.product(PROMPTS, (0.0, 0.8)):
        ar, _ = _ids(model, "autoregressive", prompt, seed=1, ar_temperature=t)
        spec, _ = _ids(model, "speculative", prompt, seed=1, ar_temperature=t)
        assert spec == ar


def test_counted_pacing_never_reads_the_clock(model, monkeypatch):
    """A clock where every pass takes one second: counted pacing runs the same cycles as with the real clock;
    timed pacing, which follows the clock, then judges every cycle worth it and drafts at nearly every step."""
    real = _ids(model, "speculative", PROMPTS[0], seed=3)
    monkeypatch.setattr(speculative, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    assert _ids(model, "speculative", PROMPTS[0], seed=3) == real
    model.speculative_pacing = "timed"
    try:
        ids, cycles = _ids(model, "speculative", PROMPTS[0], seed=3)
    finally:
        model.speculative_pacing = "counted"
    drafted = [d for *_, d in cycles]
    assert ids == real[0]  # the check is row-exact at bf16 on a CPU, or the ids equal at float32 here
    assert sum(drafted) >= len(drafted) - 1 > sum(d for *_, d in real[1]) * 2


def test_the_same_ids_on_every_run_while_another_process_or_thread_loads_the_cpu(model):
    """Each mode, under load from a busy process and then from a thread of this process running torch matmuls,
    gives its unloaded run's ids (and speculative decoding its unloaded cycles); speculative ids are the
    autoregressive ones throughout."""
    def runs():
        return {mode: _ids(model, mode, PROMPTS[1], seed=5, **({} if mode == "diffusion" else {"ar_temperature": 0.7}))
                for mode in ("diffusion", "autoregressive", "speculative")}

    quiet = runs()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert runs() == quiet
    finally:
        busy.kill()
        busy.wait()
    stop = threading.Event()

    def matmuls():
        a = torch.randn(256, 256)
        while not stop.is_set():
            a = torch.tanh(a @ a)

    worker = threading.Thread(target=matmuls)
    worker.start()
    try:
        assert runs() == quiet
    finally:
        stop.set()
        worker.join()
    assert quiet["speculative"][0] == quiet["autoregressive"][0]


def test_the_pacing_flag_belongs_to_speculative_mode(capsys):
    assert main(["generate", "Hello", "--speculative-pacing", "timed", "--max-new-tokens", "2"]) == 2
    assert "--speculative-pacing applies to --mode speculative" in capsys.readouterr().err
    assert main(["generate", "Hello", "--mode", "speculative", "--speculative-pacing", "timed",
                 "--max-new-tokens", "4"]) == 0
