"""The block-diffusion engine: `add_request` / `step` / `generate` / `stream` on token ids.

One batch is decoded at a time. `step()` runs one denoising step for every row; when every row's canvas is done
(stable and confident, or out of steps) the canvas is finalised, committed text is emitted, finished requests
leave, waiting requests join (fast sampling), and the next canvas starts. A canvas is committed to the cache by
the encoder lazily, at the start of the next one, so the last canvas of a request is never encoded.

Sampling "reference" reproduces transformers' `generate` draw for draw (one global RNG, a fixed batch, shared
positions); "fast" gives each request its own generator and positions, so its output does not depend on the
rest of the batch, and lets requests join at canvas boundaries.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dgemma.cache import KVCache
from dgemma.engine.request import Event, Request
from dgemma.model import DiffusionGemma
from dgemma.sampling import (
    SamplingParams,
    StableConfidentStopper,
    entropy_bound_accept,
    finalize_canvas,
    freeze_rows,
    make_generator,
    random_tokens,
    reference_step,
    temperature_schedule,
)
from dgemma.sampling.fused import num_uniforms, vocab_step

_ids = itertools.count()


@dataclass
class _Batch:
    rows: list[Request]
    cache: KVCache
    offsets: torch.Tensor  # [B] left padding per row; position = slot - offset (zeros in reference mode)
    pending: torch.Tensor | None = None  # [B, C] finalised canvas not yet committed to the cache
    canvas: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    signal: torch.Tensor | None = None
    done: torch.Tensor | None = None  # [B] canvas finished denoising
    step_index: int = 0
    row_steps: list[int] | None = None  # the step at which each row's canvas finished denoising
    stopper: StableConfidentStopper | None = None


def prefill_groups(rows: list[Request], waste: float = 0.25) -> list[list[Request]]:
    """Rows admitted together, grouped for batched prefill: by prompt length, so that left padding adds at
    most `waste` of the group's real tokens."""
    rows = sorted(rows, key=lambda r: len(r.prompt))
    groups: list[list[Request]] = []
    for r in rows:
        g = groups[-1] if groups else None
        if g and len(r.prompt) * (len(g) + 1) <= (1 + waste) * (sum(len(q.prompt) for q in g) + len(r.prompt)):
            g.append(r)
        else:
            groups.append([r])
    return groups


class Engine:
    def __init__(self, model: DiffusionGemma, eos_ids: tuple[int, ...], pad_id: int = 0,
                 sampling: str = "fast", max_batch: int = 16):
        self.model = model
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.reference = sampling == "reference"
        self.max_batch = max_batch
        self.canvas_length = model.cfg.canvas_length
        self.vocab_size = model.cfg.text.vocab_size
        self.waiting: list[Request] = []
        self.batch: _Batch | None = None
        self._schedules: dict[tuple[int, float, float], torch.Tensor] = {}

    # ---- public API -------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    drafts: bool = False) -> Request:
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.eos_ids
        generator = None if self.reference else make_generator(params.seed, self.model.device)
        req = Request(request_id or f"req-{next(_ids)}", list(prompt), params, tuple(eos), drafts, generator)
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        """Finish a request now (client gone, stop string seen); it leaves the batch at the next step."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return
        if self.batch is not None:
            for req in self.batch.rows:
                if req.id == request_id and not req.finished:
                    self._finish(req, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    @property
    def num_running(self) -> int:
        return 0 if self.batch is None else sum(not r.finished for r in self.batch.rows)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        events: list[Event] = []
        if self.batch is None or self.batch.canvas is None:
            self._boundary(events)
        if self.batch is not None:
            self._denoise_step(events)
        return events

    def stream(self) -> Iterator[Event]:
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if self.reference and plist and plist[0].seed is not None:
            torch.manual_seed(plist[0].seed)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        for _ in self.stream():
            pass
        return reqs

    # ---- canvas boundaries ------------------------------------------------------------------------------
    def _boundary(self, events: list[Event]) -> None:
        b = self.batch
        if b is not None and b.pending is not None:
            self._commit(b)
        self._admit()
        if self.batch is not None:
            self._start_canvas(self.batch)

    def _commit(self, b: _Batch) -> None:
        """Encode the last canvas of the rows that go on; drop the finished ones (fast mode)."""
        keep = [i for i, r in enumerate(b.rows) if not r.finished]
        if not keep:
            self.batch = None
            return
        if not self.reference and len(keep) < len(b.rows):
            b.cache.select(keep)
            b.rows = [b.rows[i] for i in keep]
            b.offsets, b.pending = b.offsets[keep], b.pending[keep]
        start = b.cache.length
        positions = torch.arange(start, start + self.canvas_length, device=b.offsets.device) - b.offsets[:, None]
        self.model.encode(b.pending, b.cache, positions=positions)
        b.pending = None

    def _admit(self) -> None:
        if not self.waiting:
            return
        if self.reference:
            if self.batch is None:
                rows, self.waiting = self.waiting, []
                max_new = max(r.params.max_new_tokens for r in rows)
                cache, offsets = self._prefill(rows, max_new + 2 * self.canvas_length)
                self.batch = _Batch(rows, cache, offsets)
            return
        room = self.max_batch - (0 if self.batch is None else len(self.batch.rows))
        rows, self.waiting = self.waiting[:room], self.waiting[room:]
        if not rows:
            return
        groups = prefill_groups(rows)
        parts = [self._prefill(g, 2 * self.canvas_length) for g in groups]
        caches = ([self.batch.cache] if self.batch is not None else []) + [c for c, _ in parts]
        offsets = ([self.batch.offsets] if self.batch is not None else []) + [o for _, o in parts]
        old_rows = self.batch.rows if self.batch is not None else []
        capacity = max(c.length for c in caches) + 2 * self.canvas_length
        cache, pads = KVCache.merge(caches, capacity)
        pad_rows = torch.tensor(pads, device=cache.valid.device)
        self.batch = _Batch(old_rows + [r for g in groups for r in g], cache, torch.cat(offsets) + pad_rows)

    def _prefill(self, rows: list[Request], room: int) -> tuple[KVCache, torch.Tensor]:
        """One encoder pass over the prompts, left-padded; returns the cache (with `room` free slots) and each
        row's offset. Fast rows keep their own positions (offset = left pad); the reference layout shares
        positions across rows, as transformers does."""
        n = max(len(r.prompt) for r in rows)
        pads = torch.tensor([n - len(r.prompt) for r in rows])
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, n - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
            r.stats.t_start = time.perf_counter()
        device = self.model.device
        valid = (torch.arange(n)[None] >= pads[:, None]).to(device)
        cache = self.model.new_cache(len(rows), n + room)
        if self.reference:
            pads = torch.zeros_like(pads)
            positions = None
        else:
            positions = (torch.arange(n)[None] - pads[:, None]).clamp(min=0).to(device)
        self.model.encode(ids.to(device), cache, valid=valid, positions=positions)
        return cache, pads.to(device)

    def _start_canvas(self, b: _Batch) -> None:
        shape = (len(b.rows), self.canvas_length)
        device = self.model.device
        if self.reference:
            b.canvas = torch.randint(0, self.vocab_size, shape, device=device)
        else:
            b.canvas = random_tokens(shape, self.vocab_size, device, [r.generator for r in b.rows])
        b.argmax, b.signal, b.step_index = b.canvas, None, 0
        b.row_steps = [0] * len(b.rows)
        b.done = torch.zeros(len(b.rows), dtype=torch.bool, device=device)
        b.stopper = self._stopper(b.rows)

    def _stopper(self, rows: list[Request]) -> StableConfidentStopper:
        if self.reference:
            p = rows[0].params
            return StableConfidentStopper(p.stability_threshold, p.confidence_threshold)
        device = self.model.device
        return StableConfidentStopper(
            torch.tensor([r.params.stability_threshold for r in rows], device=device),
            torch.tensor([r.params.confidence_threshold for r in rows], device=device))

    # ---- one denoising step -----------------------------------------------------------------------------
    def _denoise_step(self, events: list[Event]) -> None:
        b = self.batch
        if not self.reference and any(r.finished for r in b.rows):
            if not self._drop_aborted(b):
                return
        start = b.cache.length
        positions = torch.arange(start, start + self.canvas_length, device=b.offsets.device) - b.offsets[:, None]
        finished_before = b.done.clone()
        for r, d in zip(b.rows, finished_before.tolist()):
            r.stats.decoder_passes += not d and not r.finished
        hidden = self.model.denoise(b.canvas, b.cache, b.signal, positions)
        sample = self._sample_reference if self.reference else self._sample_fast
        canvas, argmax, entropy, signal = sample(b, hidden, self._temperatures(b), finished_before.tolist())
        if bool(finished_before.any()):
            argmax = freeze_rows(finished_before, b.argmax, argmax)
            canvas = freeze_rows(finished_before, b.canvas, canvas)
            signal = freeze_rows(finished_before, b.signal, signal) if None not in (b.signal, signal) else signal
        b.done = finished_before | b.stopper.update(argmax, entropy)
        b.canvas, b.argmax, b.signal = canvas, argmax, signal
        b.step_index += 1
        for i, d in enumerate(finished_before.tolist()):
            b.row_steps[i] += not d
        self._emit_drafts(b, events)
        # Reference rows keep denoising after they finish, as in transformers; fast rows stop counting.
        over = [b.step_index >= r.params.max_denoising_steps or (r.finished and not self.reference) for r in b.rows]
        if bool((b.done | torch.tensor(over, device=b.done.device)).all()):
            self._finish_canvas(b, events)

    def _sample_reference(self, b: _Batch, hidden: torch.Tensor, temps: torch.Tensor, frozen: list[bool]):
        """transformers' step, draw for draw: full float32 logits, multinomial, then the renoise draw."""
        processed = self.model.head(hidden) / temps[:, None, None]
        out = reference_step(processed, b.rows[0].params.entropy_bound)
        return out.canvas, out.argmax, out.entropy, self.model.soft_embed(processed)

    def _sample_fast(self, b: _Batch, hidden: torch.Tensor, temps: torch.Tensor, frozen: list[bool]):
        """Fused, chunked vocabulary work with each row's own generator (uniforms, then renoise tokens).
        Frozen rows draw nothing, so a row's random stream does not depend on how long the batch runs."""
        bsz, c, h = hidden.shape
        device = hidden.device
        uniforms = torch.zeros(bsz, c, num_uniforms(self.vocab_size), device=device)
        noise = torch.zeros(bsz, c, dtype=torch.long, device=device)
        for i, r in enumerate(b.rows):
            if not frozen[i]:
                uniforms[i] = torch.rand(uniforms.shape[1:], generator=r.generator, device=device)
        inv_t = (1.0 / temps)[:, None].expand(bsz, c).reshape(-1)
        cfg = self.model.cfg.text
        # on a canvas's last step nobody reads the self-conditioning signal: skip its GEMM
        last = all(f or r.finished or b.step_index + 1 >= r.params.max_denoising_steps for f, r in zip(frozen, b.rows))
        out = vocab_step(hidden.reshape(-1, h), self.model.embed_tokens.weight, cfg.final_logit_softcapping,
                         self.model.embed_scale, inv_t, uniforms.flatten(0, 1), want_signal=not last)
        entropy = out.entropy.view(bsz, c)
        bounds = torch.tensor([r.params.entropy_bound for r in b.rows], device=device)[:, None]
        accept = entropy_bound_accept(entropy, bounds)
        for i, r in enumerate(b.rows):
            if not frozen[i]:
                noise[i] = random_tokens((c,), self.vocab_size, device, r.generator)
        canvas = torch.where(accept, out.sample.view(bsz, c), noise)
        signal = None if out.signal is None else out.signal.view(bsz, c, h)
        return canvas, out.argmax.view(bsz, c), entropy, signal

    def _drop_aborted(self, b: _Batch) -> bool:
        """Aborted rows leave mid-canvas (fast mode) so they stop costing compute; False if none is left."""
        keep = [i for i, r in enumerate(b.rows) if not r.finished]
        if not keep:
            self.batch = None
            return False
        index = torch.tensor(keep, device=b.offsets.device)
        b.cache.select(keep)
        b.rows = [b.rows[i] for i in keep]
        b.row_steps = [b.row_steps[i] for i in keep]
        b.offsets, b.canvas, b.argmax, b.done = b.offsets[index], b.canvas[index], b.argmax[index], b.done[index]
        b.signal = None if b.signal is None else b.signal[index]
        b.stopper.select(index)
        return True

    def _temperatures(self, b: _Batch) -> torch.Tensor:
        temps = []
        for r in b.rows:
            p = r.params
            key = (p.max_denoising_steps, p.t_min, p.t_max)
            if key not in self._schedules:
                self._schedules[key] = temperature_schedule(*key, device=self.model.device)
            temps.append(self._schedules[key][min(b.step_index, p.max_denoising_steps - 1)])
        return torch.stack(temps)

    def _emit_drafts(self, b: _Batch, events: list[Event]) -> None:
        if not any(r.drafts and not r.finished for r in b.rows):
            return
        rows = b.argmax.tolist()
        for r, ids in zip(b.rows, rows):
            if r.drafts and not r.finished:
                events.append(Event(r.id, "draft", r.output + self._visible(ids, r)))

    def _visible(self, ids: list[int], r: Request) -> list[int]:
        """The part of a canvas a request shows: up to its first EOS and within its token budget."""
        cut = next((i for i, t in enumerate(ids) if t in r.eos), len(ids))
        return ids[:min(cut, r.budget)]

    def _finish_canvas(self, b: _Batch, events: list[Event]) -> None:
        """Commit each row's canvas up to its first EOS and within its budget; pad it as transformers does."""
        finished_before = torch.tensor([r.finished for r in b.rows], device=b.argmax.device)
        eos = b.rows[0].eos if self.reference else self.eos_ids
        padded, _ = finalize_canvas(b.argmax, list(eos), self.pad_id, finished_before)
        now = time.perf_counter()
        for r, ids, steps in zip(b.rows, b.argmax.tolist(), b.row_steps):
            if r.finished:
                continue
            r.stats.steps_per_canvas.append(steps)
            hit_eos = any(t in r.eos for t in ids[:r.budget])
            new = self._visible(ids, r)
            r.output.extend(new)
            r.stats.t_first_commit = r.stats.t_first_commit or now
            events.append(Event(r.id, "commit", new))
            if hit_eos:
                r.stats.eos_tokens += 1
                self._finish(r, "stop", events)
            elif r.budget <= 0:
                self._finish(r, "length", events)
        b.pending, b.canvas = padded, None

    def _finish(self, req: Request, reason: str, events: list[Event] | None = None) -> None:
        req.finish_reason = reason
        req.stats.t_end = time.perf_counter()
        if events is not None:
            events.append(Event(req.id, "finish", finish_reason=reason))
