"""Early commit (`SamplingParams.early_commit`): a row's stable left prefix (sampling/early.py) is committed while its
canvas still denoises and kept fixed in the canvas from then on; each step's newly early-committed ids go out as a
commit event that does not end the canvas (`Event.ends_canvas`), with their logprobs from that step when the request
asks. The row's slot keeps its canvas's history and how many ids it committed early (`committed_early`, which the
canvas's own commit does not repeat). A canvas whose early-committed prefix fills the row's budget or reaches a stable
EOS is done: its text is decided. Other features commit through it (`commit_early`, `begin_with`:
early_first_token). Runs before Logprobs, which reads the rows whose canvas is done."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.engine.features.base import Feature, Step
from dgemma.engine.request import Event, Request
from dgemma.sampling.early import decided, early_length, hold_prefix, stable_runs
from dgemma.sampling.logprobs import Entry, canvas_logprobs


@dataclass
class CanvasHistory:
    """One row's canvas so far: the last draft [C] and each position's stable run [C]."""

    prev: Tensor
    run: Tensor


@dataclass
class EarlyCommitState:
    """A row's early-committed prefix on its current canvas."""

    committed_early: int = 0  # ids committed ahead of the canvas's end
    history: CanvasHistory | None = None


class EarlyCommit(Feature):
    name = "early_commit"

    def committed_early(self, req: Request) -> int:
        st = self.of(req)
        return 0 if st is None else st.committed_early

    def commit_early(self, req: Request, ids: list[int], logprobs: list[Entry] | None, events: list[Event]) -> None:
        """Commit the next `ids` of the row's canvas before it ends; its own commit appends them to the output with
        the rest and sends only the rest."""
        st = self.of(req) or self.put(req, EarlyCommitState())
        st.committed_early += len(ids)
        req.stats.t_first_commit = req.stats.t_first_commit or time.perf_counter()
        events.append(Event(req.id, "commit", ids, logprobs=logprobs, ends_canvas=False))

    def begin_with(self, req: Request, tokens: Tensor, ids: list[int], logprobs: list[Entry] | None,
                   events: list[Event]) -> None:
        """The row's new canvas `tokens` [C] starts with `ids`, written there: commit them now and hold them from its
        first step (its history starts at this canvas)."""
        self.put(req, EarlyCommitState(history=CanvasHistory(tokens.clone(), torch.zeros_like(tokens))))
        self.commit_early(req, ids, logprobs, events)

    def start(self, rows: list[Request], tokens: Tensor, events: list[Event]) -> None:
        for r in rows:
            self.drop(r)

    def step(self, s: Step) -> None:
        early = [i for i, r in enumerate(s.rows) if self.committed_early(r) and not r.finished and not s.canvas.done[i]]
        if early:
            index = torch.tensor(early, device=s.out.argmax.device)
            prev = torch.stack([self.of(s.rows[i]).history.prev for i in early])
            ids = s.out.argmax.index_copy(0, index, prev)
            frozen = torch.zeros(len(s.rows), dtype=torch.long, device=ids.device)
            frozen[index] = torch.tensor([self.committed_early(s.rows[i]) for i in early], device=ids.device)
            s.out = hold_prefix(s.out, ids, frozen)

    def after_step(self, s: Step) -> None:
        done_now = s.done_now()
        live = [i for i, r in enumerate(s.rows)
                if r.params.early_commit is not None and not r.finished and not done_now[i]]
        if not live:
            return
        index = torch.tensor(live, device=s.canvas.argmax.device)
        argmax = s.canvas.argmax[index]
        states = [self.of(s.rows[i]) or self.put(s.rows[i], EarlyCommitState()) for i in live]
        frozen, done = _freeze([s.rows[i] for i in live], states, argmax, s.canvas.accepted[index])
        s.canvas.mark_done([i for i, d in zip(live, done) if d])  # the canvas's commit sends the rest
        grown = [(k, i, n) for k, (i, n, d) in enumerate(zip(live, frozen, done))
                 if n > states[k].committed_early and not d]
        if grown:
            self._send_grown(s, argmax, grown)

    def _send_grown(self, s: Step, argmax: Tensor, grown: list[tuple[int, int, int]]) -> None:
        """Commit each grown row's newly early-committed ids (k: its index among the live rows, i: in the batch, n:
        its early-committed length)."""
        drafts = argmax[torch.tensor([k for k, _, _ in grown], device=argmax.device)].tolist()
        for (_, i, n), ids in zip(grown, drafts):
            r, early = s.rows[i], self.committed_early(s.rows[i])
            logprobs = None if r.params.logprobs is None else canvas_logprobs(
                s.hidden[i, early:n], ids[early:n], s.head, float(s.inv_temp[i]), r.params.logprobs)
            self.commit_early(r, ids[early:n], logprobs, s.events)


def _freeze(rows: list[Request], states: list[EarlyCommitState], argmax: Tensor,
            accepted: Tensor) -> tuple[list[int], list[bool]]:
    """Update these rows' histories with the step's drafts [K, C]; each row's frozen length and whether its
    canvas is settled (one host read)."""
    prev = torch.stack([torch.full_like(argmax[0], -1) if st.history is None else st.history.prev for st in states])
    run = torch.stack([torch.zeros_like(argmax[0]) if st.history is None else st.history.run for st in states])
    run = stable_runs(prev, argmax, accepted, run)
    for st, p, n in zip(states, argmax, run):
        st.history = CanvasHistory(p, n)
    need = _table([[r.params.early_commit] for r in rows], argmax)[:, 0]
    eos = _table([list(r.eos) for r in rows], argmax)
    limit = _table([[min(r.budget, argmax.shape[1])] for r in rows], argmax)[:, 0]
    frozen = torch.maximum(early_length(run, argmax, need, eos, limit),
                           torch.tensor([st.committed_early for st in states], device=argmax.device))
    done = decided(run, argmax, need, eos, frozen, limit)
    both = torch.stack([frozen, done.long()]).tolist()
    return both[0], [bool(d) for d in both[1]]


def _table(values: list[list[int]], like: Tensor) -> Tensor:
    """Ragged per-row ints -> [K, width] padded with -1 (no EOS id)."""
    width = max(1, max(len(v) for v in values))
    return torch.tensor([v + [-1] * (width - len(v)) for v in values], device=like.device)
