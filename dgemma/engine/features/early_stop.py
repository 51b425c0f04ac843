"""Early stop: a row's canvas ends once its mean token entropy falls below the request's `early_stop`, stable or
not (the rule: sampling/early.py); runs before the features that act on rows whose canvas is done (grammar,
logprobs)."""

from __future__ import annotations

import torch

from dgemma.engine.features.base import Feature, Step
from dgemma.sampling.early import confident


class EarlyStop(Feature):
    name = "early_stop"

    def after_step(self, s: Step) -> None:
        live = [i for i, r in enumerate(s.rows)
                if r.params.early_stop is not None and not r.finished and not s.canvas.done[i]]
        if live:
            index = torch.tensor(live, device=s.out.entropy.device)
            limit = torch.tensor([s.rows[i].params.early_stop for i in live], device=index.device)
            stop = confident(s.out.entropy[index].float(), limit).tolist()
            s.canvas.mark_done([i for i, x in zip(live, stop) if x])
