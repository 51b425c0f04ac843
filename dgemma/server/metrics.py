"""Prometheus text exposition (format 0.0.4), hand-formatted: a few counters and histograms recorded by the
routes (client-side latencies, finish reasons) and by the engine thread (queue time, denoising figures)."""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
STEPS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKENS_PER_FORWARD = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            total += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {total}"]


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None):
        self.name, self.help, self.label = name, help, label
        self.values: dict[str, float] = defaultdict(float)

    def inc(self, label_value: str = "", amount: float = 1) -> None:
        self.values[label_value] += amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if self.label is None:
            return lines + [f"{self.name} {self.values.get('', 0.0)!r}"]
        return lines + [f'{self.name}{{{self.label}="{k}"}} {v!r}' for k, v in sorted(self.values.items())]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("dgemma_time_to_first_token_seconds",
                              "Arrival to the first committed canvas, per choice.", LATENCY)
        self.tpot = Histogram("dgemma_time_per_output_token_seconds",
                              "After the first canvas: (e2e - ttft) / tokens committed after it, per choice.",
                              PER_TOKEN)
        self.e2e = Histogram("dgemma_e2e_request_latency_seconds", "Arrival to the last token, per choice.", LATENCY)
        self.queue = Histogram("dgemma_request_queue_time_seconds",
                               "Submission to the engine until the prompt is prefilled into a batch.", LATENCY)
        self.steps = Histogram("dgemma_denoising_steps_per_canvas", "Denoising steps each committed canvas took.",
                               STEPS)
        self.tpf = Histogram("dgemma_tokens_per_forward", "Committed tokens per decoder pass, per finished request.",
                             TOKENS_PER_FORWARD)
        self.batch = Histogram("dgemma_batch_size", "Sequences denoised together, per engine step.", BATCH)
        self.finished = Counter("dgemma_requests_finished_total", "Choices finished, by reason.", "reason")
        self.rejected = Counter("dgemma_requests_rejected_total", "Requests refused before any model work.", "reason")
        self.prompt_tokens = Counter("dgemma_prompt_tokens_total", "Prompt tokens of admitted choices.")
        self.generation_tokens = Counter("dgemma_generation_tokens_total", "Tokens returned to clients.")
        self.passes = Counter("dgemma_decoder_passes_total", "Decoder passes of the diffusion engine.")
        self.pass_rows = Counter("dgemma_decoder_rows_total", "Rows summed over decoder passes (divided by the "
                                 "passes: rows per pass).")
        self.done_rows = Counter("dgemma_done_rows_total", "Rows carried in a decoder pass although their canvas "
                                 "was already done (0 with per-row canvas clocks).")
        self.done_seconds = Counter("dgemma_done_rows_seconds_total", "Engine-step seconds spent on rows already "
                                    "done: each step's time times its share of done rows.")
        self._seen = (0, 0, 0)  # the engine's (passes, rows, done_rows) at the last step

    # ---- recording: the event loop (choices) and the engine thread (engine figures) both call these --------
    def choice_finished(self, reason: str, e2e: float, ttft: float | None, tpot: float | None, tokens: int) -> None:
        with self._lock:
            self.finished.inc(reason)
            self.generation_tokens.inc(amount=tokens)
            self.e2e.observe(e2e)
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def engine_request_done(self, queue_seconds: float | None, steps_per_canvas: list[int],
                            tokens_per_forward: float | None) -> None:
        with self._lock:
            if queue_seconds is not None:
                self.queue.observe(queue_seconds)
            for steps in steps_per_canvas:
                self.steps.observe(steps)
            if tokens_per_forward is not None:
                self.tpf.observe(tokens_per_forward)

    def engine_step(self, running: int, stats=None, seconds: float = 0.0) -> None:
        """One engine step: `running` sequences; `stats`: the engine's cumulative EngineStats (None for engines
        without decoder-pass counts), `seconds`: the step's wall time."""
        with self._lock:
            if running:
                self.batch.observe(running)
            if stats is not None:
                self._count_passes((stats.passes, stats.rows, stats.done_rows), seconds)

    def _count_passes(self, now: tuple[int, int, int], seconds: float) -> None:
        """Add the step's share of the engine's cumulative counts (a fresh engine starts again from zero)."""
        seen = self._seen if now[0] >= self._seen[0] else (0, 0, 0)
        passes, rows, done = (a - b for a, b in zip(now, seen))
        self._seen = now
        self.passes.inc(amount=passes)
        self.pass_rows.inc(amount=rows)
        self.done_rows.inc(amount=done)
        if rows:
            self.done_seconds.inc(amount=seconds * done / rows)

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens.inc(amount=prompt_tokens)

    def refused(self, reason: str) -> None:
        with self._lock:
            self.rejected.inc(reason)

    def render(self, gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]] | None = None) -> str:
        """Prometheus text: the given gauges and counters (name: (help, value)), then the recorded metrics."""
        lines: list[str] = []
        for kind, values in (("gauge", gauges), ("counter", counters or {})):
            for name, (help, value) in values.items():
                lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {float(value)!r}"]
        with self._lock:
            for metric in (self.ttft, self.tpot, self.e2e, self.queue, self.steps, self.tpf, self.batch,
                           self.finished, self.rejected, self.prompt_tokens, self.generation_tokens, self.passes,
                           self.pass_rows, self.done_rows, self.done_seconds):
                lines += metric.render()
        return "\n".join(lines) + "\n"
