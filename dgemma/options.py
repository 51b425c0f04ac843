"""The options commands share, declared once: model loading (`--model`, `--revision`, `--dtype`, `--device`,
`--compile`, `--quantize`), the decoding mode, and every request option beyond the core sampling fields
(`OPTIONS`: the opt-in decoding options below and the sampling knobs of `dgemma/knobs/`), with the one table of
which field applies to which decoding mode (`check_modes`). No torch import here: `--help` stays fast."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from dgemma.dtypes import NAMES
from dgemma.errors import SamplingParamsError
from dgemma.knobs import KNOBS
from dgemma.option import DIFFUSION, MODES, PACINGS, Option

SAMPLINGS = ("fast", "reference")
MODE_HELP = ("decode by block diffusion, autoregressively with the encoder, or speculatively (the decoder drafts, "
             "the encoder checks: autoregressive output, several tokens a pass where the drafts hold)")

PACING_HELP = ("--mode speculative: when a row drafts. counted (default): from the ids its cycles commit, so a "
               "seed runs the same passes on every run; timed (opt-in): from measured cycle and step times, adapting "
               "to the machine: the passes follow the load, so the ids are bit-reproducible only where the check is "
               "row-exact (bfloat16 on a CPU)")


def opt_in(name: str, type: type, metavar: str, help: str) -> Option:
    """A decoding option that changes outputs, off unless asked for: fast diffusion only, a dgemma_sampling field."""
    return Option(name, type, metavar, help, opt_in=True)


OPT_IN = (
    opt_in("early_commit", int, "N", "stream a canvas's left prefix once each of its positions kept its token for N "
           "steps, before the canvas ends (the text sent never changes)"),
    opt_in("early_commit_cache", bool, "", "with early_commit: the frozen prefix moves into the KV cache (encoded "
           "as the canvas's commit would encode it), so the rest of the canvas is smaller"),
    opt_in("early_first_token", bool, "", "commit the answer's first token before any denoising step: the "
           "encoder's next-token choice after the prompt (the prefill computes it), held as the first canvas's first "
           "position"),
    opt_in("early_stop", float, "H", "end a canvas once its mean token entropy is below H, stable or not"),
    opt_in("target_canvas_ms", float, "MS", "each canvas's step budget: the steps that fit MS milliseconds at the "
           "measured step time (at most max_denoising_steps); follows the clock, so not bit-reproducible"),
    opt_in("soft_top_k", int, "K", "the self-conditioning signal over each position's K most likely tokens"),
    opt_in("skip_settled", int, "N", "positions accepted and unchanged for N steps leave the head work"),
    opt_in("settled_kv_reuse", bool, "", "with skip_settled: settled positions leave the body too, their keys and "
           "values reused (approximate)"),
)
OPTIONS: tuple[Option, ...] = (*OPT_IN, *(k.option for k in KNOBS))

# The core SamplingParams fields that apply to some modes only (every other core field applies to all)
AUTOREGRESSIVE = MODES[1:]
FIELD_MODES: dict[str, tuple[str, ...]] = {
    **{name: DIFFUSION for name in ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                                    "confidence_threshold", "logprobs")},
    "ar_temperature": AUTOREGRESSIVE,
    **{o.name: o.modes for o in OPTIONS},
}
# fields the reference sampler cannot follow
REFERENCE_SAMPLING = {"logprobs", "max_thinking_tokens", *(o.name for o in OPTIONS)}


def check_modes(given: Iterable[str], mode: str, sampling: str = "fast") -> None:
    """Refuse a field set for a decoding it does not apply to (`given`: the SamplingParams fields a caller set, to
    something other than off), naming the field: the one rule for the Python API, the CLI and the server."""
    for name in given:
        modes = FIELD_MODES.get(name, MODES)
        if mode not in modes:
            where = "diffusion decoding" if modes == DIFFUSION else "--mode " + " and ".join(modes)
            raise SamplingParamsError(f"{name} applies to {where}, not to {mode} decoding", name)
        if sampling == "reference" and name in REFERENCE_SAMPLING:
            raise SamplingParamsError(f"{name} needs the fast sampler (--sampling fast)", name)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """The one --threads of every command that runs the model (`apply_threads` sets it once the command runs)."""
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's, one per physical core; on a machine busy with other "
                        "work, fewer threads than cores, e.g. 1 on 2 cores, is often several times faster)")


def add_parallel_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-tp", "--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                   help="shard the model over N processes, one a GPU (NCCL) or CPU processes (gloo); dgemma starts "
                        "them itself, or run it under `torchrun --nproc-per-node N -m dgemma` (default 1)")


def apply_threads(args: argparse.Namespace) -> None:
    """--threads, once a command runs (torch imported only then)."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_model_options(p: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory, Hugging Face repo id (downloaded into the "
                   "Hugging Face cache unless already there), or GGUF file of llama.cpp's diffusion-gemma (default: "
                   "demo, the bundled demo model)")
    p.add_argument("--revision", default=None, help="with a repo id: the branch, tag or commit to load "
                   "(default: main)")
    p.add_argument("--dtype", default="auto", choices=("auto", *NAMES),
                   help=dtype_help or "weight dtype (auto: bfloat16 checkpoints stay bfloat16, else float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--compile", action="store_true", help="compile the denoising step's model pass with "
                   "torch.compile (minutes of start-up; fewer kernel launches on accelerators; on CPUs it "
                   "measured slower)")
    add_quantize_option(p)


def add_quantize_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default=None, metavar="SCHEME",
                   help="quantize weights while loading: int8, int4 (group-wise symmetric, 32 columns per scale) or "
                   "nvfp4; int4:64 sets the group, int4+emb8 keeps the embedding / LM head in int8, +embfp in "
                   "float; a final +a8 (or a8 alone, for a GGUF / pre-quantized file) multiplies int8 activations "
                   "on x86 CPUs: faster, one more byte per 2D weight")


def add_mode_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default=MODES[0],
                   help=f"{MODE_HELP} (default {MODES[0]})")
    p.add_argument("--speculative-pacing", choices=PACINGS, default=None, help=PACING_HELP)
