"""Matrix-vector kernels that libraries already ship, at the real model's widths, against the read bandwidth.

For each weight shape of the released model (projections, dense MLP, one expert, the tied head) and each M (rows
of the call: 1 is a token of autoregressive decoding, ~16 an expert's share of a canvas), every candidate that is
installed and runs here (`--candidates`, default: all found):

int4 (group 32)
- `torch int4`: torch's `_weight_int4pack_mm_for_cpu` on dgemma's `CPUInt4Weight` (what M <= 64 runs today);
- `torchao int4`: torchao's `PrototypeInt4WeightOnlyConfig` (`Int4OpaqueTensor`, its CPU layout: torch's int4
  kernel again, with asymmetric scales and zeros);
- `bnb nf4`: bitsandbytes' CPU 4-bit GEMV (AVX-512 BF16), NF4 codes with a bf16 absmax per block of 32: another
  4-bit format (a 16-value code book), so not dgemma's int4;
- `inductor int4`: `torch.compile(mode="max-autotune")` over the int4 call (Inductor's WoQ int4 GEMM template
  against aten, its pick; a C++ compiler at run time, seconds of compile per shape and M);
- `aten dyn4` (slow, only when named): `torch.ops.aten._dyn_quant_matmul_4bit` (KleidiAI on Arm; a reference
  loop on x86).

int8
- `decode + GEMM int8`: dgemma's int8 group-32 weight as every M runs it today (decode to bf16 + GEMM);
- `torch int4 x2 int8`: dgemma's int8 group-32 weight exactly, through torch's int4 kernel: a code q = 16 h + l
  (h in -8..7, l in 0..15) is two int4 codes, the weight [N, K] becomes [W_h | W_l] of [N, 2K] (scales 16 s and s,
  zero 8 s for l) and x becomes [x | x]: one call reads the int8 bytes at the int4 kernel's speed;
- `torch int8`: `torch._weight_int8pack_mm`, one scale per output channel;
- `torchao int8`: torchao's `Int8WeightOnlyConfig` (per channel: the codes converted to bf16 every call);
- `inductor int8`: max-autotune over `_weight_int8pack_mm` (Inductor's WoQ template against aten);
- `a8`: dgemma's `+a8` (oneDNN int8 x int8 on a per-channel int8 copy, activations quantized per row).

Times are medians of `--repeats` samples, the candidates interleaved within each sample; a sample repeats the call
to last >= 2 ms. GB/s counts the bytes the kernel reads for the weight (codes, scales, tables); `x_bw` is that
over the read bandwidth measured right after (decode_bound.read_bandwidth, same threads). `rel_err`: max |y - ref|
/ max |ref| at M = max(rows), where ref is x (float32) times the candidate's own dequantized weight in float32.

    python benchmarks/matvec_kernels.py [--shapes expert_gate_up,...] [--rows 1,2,4,8,16] [--threads 1,2]
        [--repeats 5] [--candidates "torch int4,bnb nf4,..."]

A JSON line after each shape; the last stdout line holds them all: {cpu, load_average, rows, threads, results:
{shape: {threads: {M: {candidate: {ms, gb_s, x_bw}}}}}, bandwidth_gb_s, rel_err: {shape: {candidate: e}},
skipped: {candidate: why}}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bound import read_bandwidth  # noqa: E402
from dgemma.quant import a8, int4cpu, quantize_tensor  # noqa: E402

SHAPES = {"q_sliding": (4096, 2816), "kv_sliding": (2048, 2816), "o_sliding": (2816, 4096),
          "q_full": (8192, 2816), "k_full": (1024, 2816), "mlp_gate_up": (2112, 2816), "mlp_down": (2816, 2112),
          "expert_gate_up": (1408, 2816), "expert_down": (2816, 704), "head": (262144, 2816)}
GROUP = 32
TORCHAO_MAX = 1 << 26  # torchao quantizes through float copies of the weight: not the head (24 GB machines)
SAMPLE_S = 2e-3  # a sample repeats the call until it lasts this long


class Candidate:
    """A callable x [M, K] (bf16) -> [M, N], the bytes it reads for the weight, and its dequantized weight."""

    def __init__(self, fn, nbytes: int, dequantized):
        self.fn, self.nbytes, self.dequantized = fn, nbytes, dequantized  # dequantized(): float32 [N, K], or None


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def int4_candidates(w: torch.Tensor, intw, names: set[str], skipped: dict) -> dict[str, Candidate]:
    out = {}
    ref = lambda: intw.dequantize(dtype=torch.float32)  # noqa: E731
    if "torch int4" in names or "inductor int4" in names:
        p = int4cpu.CPUInt4Weight.from_int(intw)
        out["torch int4"] = Candidate(p.kernel_mm, nbytes(p.packed, p.scale_zero), ref)
        if "inductor int4" in names:
            fn = _compiled(lambda x, q, t: torch._weight_int4pack_mm_for_cpu(x, q, GROUP, t), p.packed, p.scale_zero)
            out["inductor int4"] = Candidate(fn, out["torch int4"].nbytes, ref)
    if "bnb nf4" in names:
        _try(out, skipped, "bnb nf4", lambda: _bnb(w))
    if "torchao int4" in names and w.numel() <= TORCHAO_MAX:
        _try(out, skipped, "torchao int4", lambda: _torchao(w, "int4"))
    if "aten dyn4" in names:
        _try(out, skipped, "aten dyn4", lambda: _dyn4(intw))
    return out


def int8_candidates(w: torch.Tensor, intw, names: set[str], skipped: dict) -> dict[str, Candidate]:
    out = {}
    w8 = quantize_tensor(w, 8, GROUP)
    if "decode + GEMM int8" in names:
        out["decode + GEMM int8"] = Candidate(w8.linear, nbytes(w8.qweight, w8.scales),
                                              lambda: w8.dequantize(dtype=torch.float32))
    if "torch int4 x2 int8" in names:
        packed, table = int8_as_int4(w8.qweight, w8.scales)
        out["torch int4 x2 int8"] = Candidate(
            lambda x: torch._weight_int4pack_mm_for_cpu(torch.cat([x, x], -1), packed, GROUP, table),
            nbytes(packed, table), lambda: w8.dequantize(dtype=torch.float32))
    q, sb = per_channel_int8(w)
    ref = lambda: q.float() * sb.float()[:, None]  # noqa: E731
    if "torch int8" in names:
        out["torch int8"] = Candidate(lambda x: torch._weight_int8pack_mm(x, q, sb), nbytes(q, sb), ref)
    if "inductor int8" in names:
        fn = _compiled(torch._weight_int8pack_mm, q, sb)
        out["inductor int8"] = Candidate(fn, nbytes(q, sb), ref)
    if "torchao int8" in names and w.numel() <= TORCHAO_MAX:
        _try(out, skipped, "torchao int8", lambda: _torchao(w, "int8"))
    if "a8" in names and a8.available(w.device):
        m = a8.Int8Activations(intw, min(w.shape[0], 1 << 16), transposed=False)  # the head: blocks as the model's
        out["a8"] = Candidate(m.linear, m.nbytes, lambda: intw.dequantize(dtype=torch.float32))
    return out


def per_channel_int8(w: torch.Tensor, rows: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and bf16 scales [N] (one per output channel), a block of rows at a time (the head)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    sb = torch.empty(w.shape[0], dtype=torch.bfloat16)
    for lo in range(0, w.shape[0], rows):
        part = w[lo:lo + rows].float()
        sb[lo:lo + rows] = (part.abs().amax(1) / 127).clamp_min(1e-12)
        q[lo:lo + rows] = (part / sb[lo:lo + rows].float()[:, None]).round().clamp(-127, 127)
    return q, sb


def int8_as_int4(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and group scales [N, K // g] -> torch's int4 layout of [W_h | W_l] and its scale table."""
    n, k = q.shape
    packed = torch.empty(n, k, dtype=torch.uint8)
    for lo in range(0, n, 4096):  # whole blocks of rows at a time (int32 codes of the head would take 6 GB)
        part = q[lo:lo + 4096]
        codes = torch.cat([(part >> 4) + 8, part & 15], dim=1).int()  # h stored as h + 8 (the kernel takes 8 off)
        packed[lo:lo + 4096] = torch._convert_weight_to_int4pack_for_cpu(codes, 2).view(-1, k)
    s = scales.float()
    scale = torch.cat([16 * s, s], dim=1).T  # [2K // g, N]
    zero = torch.cat([torch.zeros_like(s), 8 * s], dim=1).T  # (l - 8) * s + 8 s = l * s
    return packed, torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()


def _try(out: dict, skipped: dict, name: str, build) -> None:
    try:
        out[name] = build()
    except Exception as e:  # noqa: BLE001 - a candidate that does not install or run here is reported, not fatal
        skipped[name] = f"{type(e).__name__}: {e}"[:200]


def _bnb(w: torch.Tensor) -> Candidate:
    import bitsandbytes.functional as bf

    qw, state = bf.quantize_4bit(w.to(torch.bfloat16), blocksize=GROUP, quant_type="nf4")
    plain = copy.deepcopy(state)  # the conversion rewrites the state in place
    packed, state = bf._convert_weight_packed_for_cpu(qw, state)  # the AVX-512 BF16 kernel's layout
    if not getattr(state, "packing_format_for_cpu", False):
        raise RuntimeError("no CPU packing")
    return Candidate(lambda x: bf.gemv_4bit(x, packed, state=state), nbytes(packed, state.absmax),
                     lambda: bf.dequantize_4bit(qw, plain).float())


def _torchao(w: torch.Tensor, kind: str) -> Candidate:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    if kind == "int4":  # Int4OpaqueTensor: torchao's CPU int4 layout (torch's int4 kernel)
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        config = PrototypeInt4WeightOnlyConfig(group_size=GROUP, set_inductor_config=False)
    else:
        config = Int8WeightOnlyConfig()
    quantize_(lin, config)
    t = lin.weight
    size = nbytes(*(getattr(t, a) for a in t.__tensor_flatten__()[0]))
    return Candidate(lin, size, None if kind == "int4" else lambda: t.dequantize().float())  # opaque: no dequantize


def _dyn4(intw) -> Candidate:
    n, k = intw.shape
    codes = (intw.dequantize(dtype=torch.float32).view(n, -1, GROUP) / intw.scales.float()[..., None]).round()
    u = (codes.view(n, k) + 8).to(torch.uint8)
    packed = u[:, 0::2] | (u[:, 1::2] << 4)
    pw = torch.ops.aten._dyn_quant_pack_4bit_weight(packed, intw.scales.float(), None, GROUP, k, n)
    return Candidate(lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x.float(), pw, GROUP, k, n), nbytes(pw),
                     lambda: intw.dequantize(dtype=torch.float32))


class _Frozen(torch.nn.Module):
    """`op(x, *weights)` with the weights as buffers: Inductor's WoQ templates want weights it can freeze."""

    def __init__(self, op, *weights: torch.Tensor):
        super().__init__()
        self.op, self.count = op, len(weights)
        for i, t in enumerate(weights):
            self.register_buffer(f"w{i}", t)

    def forward(self, x):
        return self.op(x, *(getattr(self, f"w{i}") for i in range(self.count)))


_COMPILED: list[dict] = []  # every compiled candidate's programs by M, for the thread count in `_THREADS`
_THREADS = [0]


def _compiled(op, *weights: torch.Tensor):
    """max-autotune over `op(x, *weights)`, compiled on the first call of each M and thread count."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    torch._dynamo.config.cache_size_limit = 64
    mod = _Frozen(op, *weights).eval()
    compiled: dict = {}
    _COMPILED.append(compiled)

    def call(x):
        if _THREADS[0] != torch.get_num_threads():  # compiled code keeps its thread count; dynamo does not guard it
            torch._dynamo.reset()
            for programs in _COMPILED:
                programs.clear()
            _THREADS[0] = torch.get_num_threads()
        if x.shape[0] not in compiled:
            compiled[x.shape[0]] = torch.compile(mod, mode="max-autotune", dynamic=False)
        return compiled[x.shape[0]](x)
    return call


def sample_ms(fn, x, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn(x)
    return (time.perf_counter() - t0) * 1e3 / inner


def measure(cands: dict[str, Candidate], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median ms per call of each candidate, interleaved sample by sample."""
    inner = {}
    for name, c in cands.items():
        c.fn(x)  # warm-up (and compile)
        inner[name] = max(1, int(SAMPLE_S * 1e3 / max(sample_ms(c.fn, x, 1), 1e-3)))
    times: dict[str, list[float]] = {name: [] for name in cands}
    for _ in range(repeats):
        for name, c in cands.items():
            times[name].append(sample_ms(c.fn, x, inner[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def rel_err(c: Candidate, x: torch.Tensor) -> float:
    """max |y - x @ W.T| / max |x @ W.T| with W the candidate's own dequantized weight, in float32."""
    y = c.fn(x).float()
    w = c.dequantized()
    ref = torch.cat([x.float() @ w[lo:lo + 16384].T for lo in range(0, w.shape[0], 16384)], dim=-1)
    return float((y - ref).abs().max() / ref.abs().max())


def run_shape(name: str, args, names: set[str], buf: torch.Tensor, skipped: dict) -> tuple[dict, dict, list]:
    n, k = SHAPES[name]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16) * 0.02
    intw = quantize_tensor(w, 4, GROUP)  # dgemma's int4 weight (+a8 requantizes it per channel)
    cands = {**int4_candidates(w, intw, names, skipped), **int8_candidates(w, intw, names, skipped)}
    del w, intw
    rows = [int(r) for r in args.rows.split(",")]
    results, bws = {}, []
    with torch.inference_mode():
        x = torch.randn(max(rows), k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        errors = {c: round(rel_err(cand, x), 5) for c, cand in cands.items() if cand.dequantized}
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            results[threads] = {}
            for m in rows:
                ms = measure(cands, x[:m].contiguous(), args.repeats)
                bw = read_bandwidth(buf)
                bws.append(bw / 1e9)
                results[threads][m] = {c: {"ms": round(t, 4), "gb_s": round(cands[c].nbytes / t / 1e6, 2),
                                           "x_bw": round(cands[c].nbytes / t * 1e3 / bw, 3)} for c, t in ms.items()}
                print(f"{name} t={threads} M={m} bw={bw / 1e9:.1f} GB/s: " + ", ".join(
                    f"{c} {r['ms']:.3f} ms {r['gb_s']:.1f} GB/s" for c, r in results[threads][m].items()),
                    file=sys.stderr, flush=True)
    return results, errors, bws


ALL = ["torch int4", "torchao int4", "bnb nf4", "inductor int4", "decode + GEMM int8", "torch int4 x2 int8",
       "torch int8", "torchao int8", "inductor int8", "a8"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--candidates", default=",".join(c for c in ALL if "inductor" not in c),
                   help=f"comma-separated, of: {', '.join(ALL)}, aten dyn4")
    args = p.parse_args(argv)
    names = set(args.candidates.split(","))
    buf = torch.ones(1 << 28)  # 1 GiB for the read bandwidth
    out = {"cpu": torch.backends.cpu.get_cpu_capability(), "load_average": os.getloadavg(), "rows": args.rows,
           "threads": args.threads, "results": {}, "rel_err": {}, "bandwidth_gb_s": {}, "skipped": {}}
    for shape in args.shapes.split(","):
        res, err, bws = run_shape(shape, args, names, buf, out["skipped"])
        out["results"][shape], out["rel_err"][shape] = res, err
        out["bandwidth_gb_s"][shape] = round(statistics.median(bws), 2)
        out["load_average_end"] = os.getloadavg()
        print(json.dumps(out), flush=True)  # after every shape: the last line has all of them
    return 0


if __name__ == "__main__":
    sys.exit(main())
