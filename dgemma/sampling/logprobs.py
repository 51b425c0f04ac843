"""Log-probabilities of committed tokens. A diffusion model has no left-to-right conditional per token; dgemma
reports, for each committed token, its log-probability under the distribution its canvas's draft was read from:
the temperature-scaled logits of the denoising step at which that row's canvas ended (it became stable and
confident, its grammar prefix completed, or it ran out of steps), with the `top` most likely alternatives of that
distribution. Computed once per canvas for the rows that ask, from that step's hidden states."""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.model.head import Head

Entry = tuple[int, float, list[tuple[int, float]]]  # token id, log-probability, [(id, log-probability)] * top
CHUNK = 32  # positions per GEMM: bounds the [positions, vocabulary] temporaries


def canvas_logprobs(hidden: Tensor, ids: list[int], head: Head, inv_temp: float, top: int) -> list[Entry]:
    """hidden [C, H], ids [C] (the canvas's draft) -> one Entry per position."""
    out: list[Entry] = []
    for lo in range(0, len(ids), CHUNK):
        # + 0.0 turns -0.0 (a certain token, as some kernels round it) into 0.0, so it never prints as -0.0
        logp = torch.log_softmax(head.logits(hidden[lo:lo + CHUNK]) * inv_temp, dim=-1) + 0.0
        chosen = logp.gather(1, torch.tensor(ids[lo:lo + CHUNK], device=logp.device)[:, None])[:, 0].tolist()
        if top:
            values, indices = logp.topk(top, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            tops = [[] for _ in chosen]
        out += [(t, lp, alts) for t, lp, alts in zip(ids[lo:lo + CHUNK], chosen, tops)]
    return out
