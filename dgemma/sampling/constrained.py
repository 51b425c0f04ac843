"""The valid-prefix rule on the fast denoising step, for the rows of a batch that carry a grammar (the rule itself
is described in `constraints.py`). Rows without a grammar are untouched, so constrained and unconstrained
requests share a batch. One host read of the constrained rows per step; grammar masks only where a sample is
refused (the frontier) and where a canvas ends before its prefix is complete."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor

from dgemma.model.head import Head
from dgemma.sampling.constraints import RowGrammar
from dgemma.sampling.processing import Processor
from dgemma.sampling.samplers import StepOutput, random_tokens

Rows = list[RowGrammar | None]
Failed = Callable[[int, BaseException], None] | None  # told of a row whose own work raised
Knobs = Callable[[list[int]], Processor | None]  # a row's sampling knobs after its locked ids (None: it has none)


def masked_token(logits: Tensor, allowed: Tensor, inv_temp: float | None, generator: torch.Generator | None) -> int:
    """A token from grammar-masked logits [V]: drawn at temperature 1 / inv_temp, or the argmax when inv_temp is
    None. allowed: bool [V] (any device)."""
    logits = logits.masked_fill(~allowed.to(logits.device), -math.inf)
    if inv_temp is None:
        return int(logits.argmax())
    probs = torch.softmax(logits * inv_temp, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def start_canvas(grammars: Rows, budgets: list[int], canvas_length: int) -> None:
    for g, budget in zip(grammars, budgets):
        if g is not None:
            g.start_canvas(min(canvas_length, budget), budget)


def constrain_step(grammars: Rows, out: StepOutput, hidden: Tensor, head: Head, inv_temp: Tensor,
                   generators: list[torch.Generator], done: list[bool], fail: Failed = None,
                   knobs: list[Knobs] | None = None) -> StepOutput:
    """Apply the rule to one step's output (in place) for the live constrained rows: the frontier from masked
    logits (processed by the row's sampling `knobs`), then the run of accepted samples the grammar allows; the rest
    renoised. hidden [B, C, H]. A row whose grammar raises is handed to `fail` (else the error propagates) and left
    out; the others go on."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not done[i] and not g.complete]
    if not rows:
        return out
    index = torch.tensor(rows, device=out.canvas.device)
    samples, accepted, temps = out.canvas[index].tolist(), out.accepted[index].tolist(), inv_temp[index].tolist()
    failed = set()
    for j, i in enumerate(rows):
        with _own(i, fail, failed):
            _constrain_row(grammars[i], samples[j], accepted[j], hidden[i], head, temps[j], generators[i],
                           knobs[i] if knobs is not None else None)
    rows = [i for i in rows if i not in failed]
    if not rows:
        return out
    index = torch.tensor(rows, device=out.canvas.device)
    noise = torch.stack([random_tokens(out.canvas.shape[1:], head.vocab_size, out.canvas.device,
                                       generators[i]) for i in rows])
    prefix, inside = _prefixes([grammars[i] for i in rows], out.canvas.shape[1], out.canvas.device)
    out.canvas[index] = torch.where(inside, prefix, noise)
    out.argmax[index] = torch.where(inside, prefix, out.argmax[index])
    out.accepted[index] = inside
    return out


def _constrain_row(g: RowGrammar, samples: list[int], accepted: list[bool], hidden: Tensor, head: Head,
                   inv_temp: float, generator: torch.Generator, knobs: Knobs | None) -> None:
    """One row's frontier and accepted run (hidden [C, H])."""
    p = len(g.locked)
    if not (accepted[p] and g.extend([samples[p]])):
        logits = head.logits(hidden[p:p + 1])
        process = knobs(g.locked) if knobs is not None else None
        if process is not None:  # the temperature is the processor's, as in the fused step
            logits, inv_temp = process(logits, inv_temp), 1.0
        draw = masked_token(logits[0], g.allowed(), inv_temp, generator)
        if not g.extend([draw]):
            g.give_up()  # the budget refused the draw: the token it reserves
    run = next((k for k, a in enumerate(accepted[p + 1:]) if not a), len(accepted) - p - 1)
    g.extend(samples[p + 1:p + 1 + run])


def complete_rows(grammars: Rows, argmax: Tensor, hidden: Tensor, head: Head, ending: list[bool],
                  fail: Failed = None) -> list[int]:
    """Rows whose grammar prefix is complete, after completing greedily those whose canvas ends now
    (`ending`: done or out of steps); their locked prefix is written into `argmax` [B, C], the canvas that
    commits. Returns the complete rows (the engine marks them done); a row whose grammar raises goes to `fail`."""
    complete, failed = [], set()
    for i, g in enumerate(grammars):
        if g is None or g.written or not (g.complete or ending[i]):
            continue
        with _own(i, fail, failed):
            _complete_row(g, argmax, hidden[i], head, i)
            complete.append(i)
    return complete


def _complete_row(g: RowGrammar, argmax: Tensor, hidden: Tensor, head: Head, i: int) -> None:
    draft, start = argmax[i].tolist(), len(g.locked)
    logits = head.logits(hidden[start:g.limit]) if not g.complete else None  # one GEMM for the rest
    while not g.complete:
        p = len(g.locked)
        if not (g.extend([draft[p]]) or
                g.extend([masked_token(logits[p - start], g.allowed(), None, None)])):
            g.give_up()
    g.written = True
    prefix, inside = _prefixes([g], argmax.shape[1], argmax.device)
    argmax[i] = torch.where(inside[0], prefix[0], argmax[i])


@contextmanager
def _own(i: int, fail: Failed, failed: set[int]):
    """Row i's work: an error in it is row i's (`fail(i, error)`), unless there is no one to tell."""
    try:
        yield
    except Exception as e:
        if fail is None:
            raise
        failed.add(i)
        fail(i, e)


def _prefixes(grammars: list[RowGrammar], width: int, device) -> tuple[Tensor, Tensor]:
    """Locked prefixes as [R, width] ids (0 past the prefix) and the bool mask of prefix positions."""
    prefix = torch.zeros(len(grammars), width, dtype=torch.long)
    for r, g in enumerate(grammars):
        prefix[r, :len(g.locked)] = torch.tensor(g.locked, dtype=torch.long)
    lengths = torch.tensor([len(g.locked) for g in grammars])
    inside = torch.arange(width)[None] < lengths[:, None]
    return prefix.to(device), inside.to(device)
