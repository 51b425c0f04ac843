"""The options commands share, declared once: model loading (`--model`, `--dtype`, `--device`, `--compile`,
`--quantize`), the decoding mode and the opt-in decoding options; and the names of the decoding modes and
samplings (no torch import here: `--help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dgemma.dtypes import NAMES

MODES = ("diffusion", "autoregressive", "speculative")
SAMPLINGS = ("fast", "reference")
MODE_HELP = ("decode by block diffusion, autoregressively with the encoder, or speculatively (the decoder drafts, "
             "the encoder checks: autoregressive output, several tokens a pass where the drafts hold)")


@dataclass(frozen=True)
class OptIn:
    """A decoding option that changes outputs, off unless asked for: this one declaration makes its CLI flag
    (`--soft-top-k`) and its field of the server's `dgemma_sampling`; the SamplingParams field of the same name
    holds its rule (sampling/params.py), and its name joins DIFFUSION_ONLY there."""

    name: str
    type: type
    metavar: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPT_IN = (
    OptIn("early_commit", int, "N", "stream a canvas's left prefix once each of its positions kept its token for N "
          "steps, before the canvas ends (the text sent never changes)"),
    OptIn("early_commit_cache", bool, "", "with early_commit: the frozen prefix moves into the KV cache (encoded as "
          "the canvas's commit would encode it), so the rest of the canvas is smaller"),
    OptIn("early_first_token", bool, "", "commit the answer's first token before any denoising step: the encoder's "
          "next-token choice after the prompt (the prefill computes it), held as the first canvas's first position"),
    OptIn("early_stop", float, "H", "end a canvas once its mean token entropy is below H, stable or not"),
    OptIn("target_canvas_ms", float, "MS", "each canvas's step budget: the steps that fit MS milliseconds at the "
          "measured step time (at most max_denoising_steps)"),
    OptIn("soft_top_k", int, "K", "the self-conditioning signal over each position's K most likely tokens"),
    OptIn("skip_settled", int, "N", "positions accepted and unchanged for N steps leave the head work"),
    OptIn("settled_kv_reuse", bool, "", "with skip_settled: settled positions leave the body too, their keys and "
          "values reused (approximate)"),
)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_model_options(p: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory, cached Hugging Face repo id, or GGUF file "
                   "of llama.cpp's diffusion-gemma (default: the bundled demo model)")
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
