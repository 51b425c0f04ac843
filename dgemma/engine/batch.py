"""What the engine and the reference engine share: the prefill of a group of rows, one canvas's state and
per-step bookkeeping (done rows, the stopper, step counts), and the events a canvas produces."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.cache import KVCache
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import (SamplingParams, StableConfidentStopper, StepOutput, finalize_canvas, freeze_rows,
                             temperature_schedule)


def prefill(model: DiffusionGemma, rows: list[Request], pad_id: int, room: int,
            own_positions: bool) -> tuple[KVCache, list[int], Tensor]:
    """The encoder over the rows' prompts, left-padded, in chunks (`DiffusionGemma.prefill`); returns the cache
    (with `room` free slots), each row's left pad and each prompt's last normed hidden state [B, H]. With
    `own_positions` each row's positions start at 0 after its padding; otherwise the batch shares positions, as
    transformers does."""
    device, n = model.device, max(len(r.prompt) for r in rows)
    host_pads = [n - len(r.prompt) for r in rows]
    pads = torch.tensor(host_pads, device=device)
    ids = torch.tensor([[pad_id] * (n - len(r.prompt)) + r.prompt for r in rows], device=device)
    slots = torch.arange(n, device=device)[None]
    positions = (slots - pads[:, None]).clamp(min=0) if own_positions else None
    cache = model.new_cache(len(rows), n + room)
    for r in rows:
        r.stats.t_start = time.perf_counter()
    padded = any(len(r.prompt) < n for r in rows)  # known on the host: no device read to find out
    hidden = model.prefill(ids, cache, valid=slots >= pads[:, None] if padded else None, positions=positions)
    return cache, host_pads, hidden


def _row_table(values: list[list[float]] | list[list[int]], device, dtype, fill) -> Tensor:
    """Ragged per-row lists -> [B, max len], each row padded with `fill` (a value or "last")."""
    width = max(1, max(len(v) for v in values))
    rows = [v + [v[-1] if fill == "last" else fill] * (width - len(v)) for v in values]
    return torch.tensor(rows, dtype=dtype, device=device)


@dataclass
class Canvas:
    """One canvas of a batch of rows being denoised. A row is done when it has nothing left to denoise on this
    canvas (stable and confident, its grammar prefix complete, or out of steps); `done` is the host copy of
    `done_mask`, read once per step."""

    tokens: Tensor  # [B, C] the decoder's next input
    argmax: Tensor  # [B, C] the current draft
    done_mask: Tensor  # [B] bool
    done: list[bool]
    row_steps: list[int]  # denoising steps each row has taken on this canvas
    stopper: StableConfidentStopper
    temperatures: Tensor  # [B, S] each row's schedule, padded with its last entry
    entropy_bound: Tensor  # [B]
    signal: Tensor | None = None
    accepted: Tensor | None = None  # [B, C] bool: positions whose sample the last step kept
    stepped: list[bool] | None = None  # rows the last step moved (not done before it)
    step: int = 0

    @classmethod
    def start(cls, rows: list[Request], tokens: Tensor) -> Canvas:
        device = tokens.device
        schedules = [temperature_schedule(r.params.max_denoising_steps, r.params.t_min, r.params.t_max, device="cpu")
                     for r in rows]  # on the host: one transfer below, no read
        width = max(len(t) for t in schedules)
        stopper = StableConfidentStopper(
            torch.tensor([r.params.stability_threshold for r in rows], device=device),
            torch.tensor([r.params.confidence_threshold for r in rows], device=device))
        return cls(tokens, tokens, torch.zeros(len(rows), dtype=torch.bool, device=device), [False] * len(rows),
                   [0] * len(rows), stopper, torch.cat([_widen(t[None], width) for t in schedules]).to(device),
                   torch.tensor([r.params.entropy_bound for r in rows], device=device))

    def temperature(self, shared_step: bool = False) -> Tensor:
        """[B] this step's temperature per row: at the row's own step on its canvas, or (`shared_step`, the
        reference) at the batch's."""
        last = self.temperatures.shape[1] - 1
        if shared_step:
            return self.temperatures[:, min(self.step, last)]
        index = torch.tensor([min(n, last) for n in self.row_steps], device=self.temperatures.device)
        return self.temperatures.gather(1, index[:, None])[:, 0]

    def advance(self, rows: list[Request], out: StepOutput, signal: Tensor | None) -> None:
        """Take one step's output: rows already done keep their draft, tokens and signal (as transformers
        does), the stopper sees the new drafts, and the host learns which rows are now done."""
        argmax, tokens = out.argmax, out.canvas
        if any(self.done):
            argmax = freeze_rows(self.done_mask, self.argmax, argmax)
            tokens = freeze_rows(self.done_mask, self.tokens, tokens)
            if signal is not None and self.signal is not None:
                signal = freeze_rows(self.done_mask, self.signal, signal)
        for i, (r, f) in enumerate(zip(rows, self.done)):
            r.stats.decoder_passes += not f and not r.finished
            self.row_steps[i] += not f
        self.done_mask = self.done_mask | self.stopper.update(argmax, out.entropy)
        self.tokens, self.argmax, self.signal, self.accepted = tokens, argmax, signal, out.accepted
        self.stepped = [not f for f in self.done]
        self.step += 1
        self.done = self.done_mask.tolist()  # the step's one host read

    def reschedule(self, i: int, params: SamplingParams) -> None:
        """Row i's temperature schedule becomes `params`' (a new step budget); the steps it took keep their place."""
        t = temperature_schedule(params.max_denoising_steps, params.t_min, params.t_max, device="cpu")
        width = max(self.temperatures.shape[1], len(t))
        self.temperatures = _widen(self.temperatures, width)
        self.temperatures[i] = _widen(t[None], width)[0].to(self.temperatures.device)

    def mark_done(self, rows: list[int]) -> None:
        """These rows are done (e.g. their grammar prefix is complete, or they are out of steps)."""
        if rows:
            self.done_mask[torch.tensor(rows, device=self.done_mask.device)] = True
            for i in rows:
                self.done[i] = True

    def all_done(self, rows: list[Request], finished_rows_count: bool) -> bool:
        """Every row is done or out of steps; finished rows (aborted, or ended in an earlier canvas) count as
        done unless `finished_rows_count` (the reference keeps denoising them, as transformers does)."""
        return all(f or n >= r.params.max_denoising_steps or (r.finished and not finished_rows_count)
                   for f, n, r in zip(self.done, self.row_steps, rows))

    def last_step(self, rows: list[Request]) -> bool:
        """No row takes another step after this one: nobody reads this step's self-conditioning signal."""
        return all(f or r.finished or n + 1 >= r.params.max_denoising_steps
                   for f, n, r in zip(self.done, self.row_steps, rows))

    def select(self, index: Tensor, keep: list[int]) -> None:
        """Keep only these rows (index [K] on the device, keep: the same as a list)."""
        self.tokens, self.argmax, self.done_mask = self.tokens[index], self.argmax[index], self.done_mask[index]
        self.signal = None if self.signal is None else self.signal[index]
        self.temperatures, self.entropy_bound = self.temperatures[index], self.entropy_bound[index]
        self.accepted = None if self.accepted is None else self.accepted[index]
        self.done = [self.done[i] for i in keep]
        self.stepped = None if self.stepped is None else [self.stepped[i] for i in keep]
        self.row_steps = [self.row_steps[i] for i in keep]
        self.stopper.select(index)

    def drafts(self, rows: list[Request], events: list[Event]) -> None:
        """A draft event (the visible part of the current canvas not committed yet, so committed text + draft is
        the answer as it stands, and which of its positions the step accepted) for each live row that asked for
        drafts and moved this step: a done row's draft would repeat itself."""
        live = [i for i, r in enumerate(rows) if r.drafts and not r.finished and self.stepped[i]]
        if live:
            c = self.argmax.shape[1]
            both = torch.cat([self.argmax, self.accepted.long()], dim=1).tolist()  # one device read
            for i in live:
                early = rows[i].committed_early  # ids of this canvas committed early (early commit) are not repeated
                ids = rows[i].visible(both[i][:c])[early:]
                accepted = both[i][c + early:c + early + len(ids)]
                events.append(Event(rows[i].id, "draft", ids, accepted=[a == 1 for a in accepted]))

    def put(self, rows: list[int], fresh: Canvas) -> None:
        """These rows start their next canvas: `fresh` (`Canvas.start` of those rows) replaces their state."""
        index = torch.tensor(rows, device=self.tokens.device)
        self.tokens = self.tokens.index_copy(0, index, fresh.tokens)
        self.argmax = self.argmax.index_copy(0, index, fresh.argmax)
        self.done_mask = self.done_mask.index_copy(0, index, fresh.done_mask)
        width = max(self.temperatures.shape[1], fresh.temperatures.shape[1])
        self.temperatures = _widen(self.temperatures, width).index_copy(0, index, _widen(fresh.temperatures, width))
        self.entropy_bound = self.entropy_bound.index_copy(0, index, fresh.entropy_bound)
        if self.signal is not None:  # a zero signal is the first step's: the MLP maps it to exactly zero
            self.signal = self.signal.index_fill(0, index, 0)
        for i in rows:
            self.done[i], self.row_steps[i] = False, 0
        self.stopper.put(index, fresh.stopper)

    def extend(self, fresh: Canvas) -> None:
        """`fresh`'s rows (joining requests) go on after these."""
        width = max(self.temperatures.shape[1], fresh.temperatures.shape[1])
        self.temperatures = torch.cat([_widen(self.temperatures, width), _widen(fresh.temperatures, width)])
        self.tokens, self.argmax = torch.cat([self.tokens, fresh.tokens]), torch.cat([self.argmax, fresh.argmax])
        self.done_mask = torch.cat([self.done_mask, fresh.done_mask])
        self.entropy_bound = torch.cat([self.entropy_bound, fresh.entropy_bound])
        if self.signal is not None:
            self.signal = torch.cat([self.signal, self.signal.new_zeros(len(fresh.done), *self.signal.shape[1:])])
        if self.accepted is not None:
            self.accepted = torch.cat([self.accepted, fresh.tokens.new_zeros(fresh.tokens.shape, dtype=torch.bool)])
        self.done, self.row_steps = self.done + fresh.done, self.row_steps + fresh.row_steps
        self.stepped = None if self.stepped is None else self.stepped + [False] * len(fresh.done)
        self.stopper.extend(fresh.stopper)

    def commit(self, rows: list[Request], pad_id: int, events: list[Event], index: list[int] | None = None) -> Tensor:
        """Commit the draft of each live row (of `index`, default all) up to its first EOS and within its budget;
        returns those rows' canvas padded as transformers does (each row with its own EOS ids), ready to encode."""
        argmax = self.argmax
        if index is not None:
            argmax, rows = argmax[torch.tensor(index, device=argmax.device)], [rows[i] for i in index]
        steps = self.row_steps if index is None else [self.row_steps[i] for i in index]
        finished = [r.finished for r in rows]
        commits = [None if f else r.commit(ids, n, events)
                   for r, f, ids, n in zip(rows, finished, argmax.tolist(), steps)]
        # a row whose rule keeps its EOS ids inside the canvas (a layout: an EOS ends a hole only) is not cut
        eos = _row_table([list(r.eos) if c is None or c.cut else [] for r, c in zip(rows, commits)], argmax.device,
                         torch.long, -1)
        return finalize_canvas(argmax, eos, pad_id, torch.tensor(finished, device=argmax.device))


def _widen(table: Tensor, width: int) -> Tensor:
    """A [B, S] schedule table padded to [B, width] with each row's last entry."""
    return table if table.shape[1] == width else torch.cat([table, table[:, -1:].expand(-1, width - table.shape[1])], 1)
