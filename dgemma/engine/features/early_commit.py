"""Early commit: a row's stable left prefix (sampling/early.py) is committed while its canvas still denoises and
held fixed in the canvas from then on; each step's newly frozen ids go out as a commit event that does not end
the canvas (`Event.ends_canvas`), with their logprobs from that step when the request asks. The canvas's own
commit then sends only the rest (`Request.sent`). A canvas whose frozen prefix fills the row's budget or reaches
a stable EOS is done: its text is decided. Runs before Logprobs, which reads the rows whose canvas ends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.sampling.early import frozen_length, hold_prefix, settled, stable_runs
from dgemma.sampling.logprobs import canvas_logprobs


@dataclass
class History:
    """One row's canvas so far: the last draft [C] and each position's stable run [C]."""

    prev: Tensor
    run: Tensor


class EarlyCommit(Feature):
    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        for r in rows:
            r.sent, r.moved, r.early = 0, 0, None

    def step(self, s: Step) -> None:
        held = [i for i, r in enumerate(s.rows) if r.sent and not r.finished and not s.canvas.done[i]]
        if held:
            index = torch.tensor(held, device=s.out.argmax.device)
            ids = s.out.argmax.index_copy(0, index, torch.stack([s.rows[i].early.prev for i in held]))
            frozen = torch.zeros(len(s.rows), dtype=torch.long, device=ids.device)
            frozen[index] = torch.tensor([s.rows[i].sent for i in held], device=ids.device)
            s.out = hold_prefix(s.out, ids, frozen)

    def settle(self, s: Step) -> None:
        ending = s.ending()
        live = [i for i, r in enumerate(s.rows)
                if r.params.early_commit is not None and not r.finished and not ending[i]]
        if not live:
            return
        index = torch.tensor(live, device=s.canvas.argmax.device)
        argmax = s.canvas.argmax[index]
        frozen, done = _freeze([s.rows[i] for i in live], argmax, s.canvas.accepted[index])
        s.canvas.mark_done([i for i, d in zip(live, done) if d])  # the canvas's commit sends the rest
        grown = [(k, i, n) for k, (i, n, d) in enumerate(zip(live, frozen, done)) if n > s.rows[i].sent and not d]
        if grown:
            _send(s, argmax, grown)


def _freeze(rows: list[Request], argmax: Tensor, accepted: Tensor) -> tuple[list[int], list[bool]]:
    """Update these rows' histories with the step's drafts [K, C]; each row's frozen length and whether its
    canvas is settled (one host read)."""
    prev = torch.stack([torch.full_like(argmax[0], -1) if r.early is None else r.early.prev for r in rows])
    run = torch.stack([torch.zeros_like(argmax[0]) if r.early is None else r.early.run for r in rows])
    run = stable_runs(prev, argmax, accepted, run)
    for r, p, n in zip(rows, argmax, run):
        r.early = History(p, n)
    need = _table([[r.params.early_commit] for r in rows], argmax)[:, 0]
    eos = _table([list(r.eos) for r in rows], argmax)
    limit = _table([[min(r.budget, argmax.shape[1])] for r in rows], argmax)[:, 0]
    frozen = torch.maximum(frozen_length(run, argmax, need, eos, limit),
                           torch.tensor([r.sent for r in rows], device=argmax.device))
    done = settled(run, argmax, need, eos, frozen, limit)
    both = torch.stack([frozen, done.long()]).tolist()
    return both[0], [bool(d) for d in both[1]]


def _send(s: Step, argmax: Tensor, grown: list[tuple[int, int, int]]) -> None:
    """Commit each grown row's newly frozen ids (k: its index among the live rows, i: in the batch, n: frozen)."""
    drafts = argmax[torch.tensor([k for k, _, _ in grown], device=argmax.device)].tolist()
    for (_, i, n), ids in zip(grown, drafts):
        r = s.rows[i]
        logprobs = None if r.params.logprobs is None else canvas_logprobs(
            s.hidden[i, r.sent:n], ids[r.sent:n], s.head, float(s.inv_temp[i]), r.params.logprobs)
        r.send(ids[r.sent:n], logprobs, s.events)


def _table(values: list[list[int]], like: Tensor) -> Tensor:
    """Ragged per-row ints -> [K, width] padded with -1 (no EOS id)."""
    width = max(1, max(len(v) for v in values))
    return torch.tensor([v + [-1] * (width - len(v)) for v in values], device=like.device)
