"""One measured configuration (engine, dtype, batch and generation settings), which crosses the process boundary
as JSON; and the progress log and device sync every bench module uses."""

from __future__ import annotations

import sys
from dataclasses import dataclass

ENGINES = ("dgemma", "reference", "autoregressive", "speculative")
TOKEN_ENGINES = ("autoregressive", "speculative")  # the encoder's next-token ids: batch 1, no denoising steps
FIXED_STEPS_THRESHOLD = 1e-30  # mean token entropy never gets this low: no canvas stops before --steps


@dataclass
class Job:
    engine: str
    dtype: str
    batch: int
    model: str
    device: str
    prompt_len: int
    max_new_tokens: int
    steps: int | None  # None: the checkpoint's adaptive defaults; N: exactly N denoising steps per canvas
    repeats: int
    warmup: int
    seed: int
    sampling: str
    ignore_eos: bool
    threads: int | None = None
    quantize: str | None = None  # dgemma: weight-only quantization on load (int8, int4, ...)

    @property
    def label(self) -> str:
        q = f"+{self.quantize}" if self.quantize else ""
        return f"{self.engine} {self.dtype}{q} batch {self.batch}"

    @property
    def diffusion(self) -> bool:
        return self.engine not in TOKEN_ENGINES

    def overrides(self) -> dict:
        """What this job changes in the checkpoint's generation defaults (SamplingParams fields)."""
        out: dict = {"seed": self.seed, "max_new_tokens": self.max_new_tokens}
        if self.ignore_eos:
            out["eos_token_ids"] = ()
        if self.diffusion and self.steps is not None:
            out.update(max_denoising_steps=self.steps, confidence_threshold=FIXED_STEPS_THRESHOLD)
        return out

    def decoding(self) -> dict:
        """The `generate` switches: mode, and the sampling path of dgemma's diffusion."""
        return {"mode": self.engine} if not self.diffusion else {"sampling": self.sampling}


def log(msg: str) -> None:
    """Progress goes to stderr: stdout is the table and the JSON line."""
    print(msg, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    """Wait for queued GPU work, so that a timer sees it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
