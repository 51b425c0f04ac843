"""Prometheus text exposition (format 0.0.4), hand-formatted: a few counters and histograms recorded by the
routes (client-side latencies, finish reasons; server-wide and per API key) and by the engine thread (queue time,
denoising figures). A key's view holds its own series only; the server-wide ones show everyone's traffic."""

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

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]

    def samples(self, labels: str = "") -> list[str]:
        """The sample lines; `labels` ('api_key="0"') go on each."""
        lines, total = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            total += count
            le = _label("le", "+Inf" if bound == math.inf else repr(float(bound)))
            lines.append(f"{self.name}_bucket{_braces(labels, le)} {total}")
        return lines + [f"{self.name}_sum{_braces(labels)} {self.sum!r}", f"{self.name}_count{_braces(labels)} {total}"]

    def render(self) -> list[str]:
        return self.header() + self.samples()


class MetricCounter:
    def __init__(self, name: str, help: str, label: str | None = None):
        self.name, self.help, self.label = name, help, label
        self.values: dict[str, float] = defaultdict(float)

    def inc(self, label_value: str = "", amount: float = 1) -> None:
        self.values[label_value] += amount

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]

    def samples(self, labels: str = "") -> list[str]:
        if self.label is None:
            return [f"{self.name}{_braces(labels)} {self.values.get('', 0.0)!r}"]
        return [f"{self.name}{_braces(labels, _label(self.label, k))} {v!r}" for k, v in sorted(self.values.items())]

    def render(self) -> list[str]:
        return self.header() + self.samples()


def _label(name: str, value: object) -> str:
    return f'{name}="{value}"'


def _braces(*labels: str) -> str:
    """'a="1"', 'b="2"' -> '{a="1",b="2"}'; no labels -> ''."""
    inner = ",".join(label for label in labels if label)
    return "{" + inner + "}" if inner else ""


class Traffic:
    """The series of one client's requests (or of everyone's): admissions, refusals, tokens, finish reasons and
    latencies. Nothing in them depends on anyone else's requests but through the latencies."""

    def __init__(self, prefix: str):
        self.requests = MetricCounter(f"{prefix}requests_total", "Requests admitted.")
        self.finished = MetricCounter(f"{prefix}requests_finished_total", "Choices finished, by reason.", "reason")
        self.rejected = MetricCounter(f"{prefix}requests_rejected_total", "Requests refused before any model work.",
                                "reason")
        self.prompt_tokens = MetricCounter(f"{prefix}prompt_tokens_total", "Prompt tokens of admitted choices.")
        self.generation_tokens = MetricCounter(f"{prefix}generation_tokens_total", "Tokens returned to clients.")
        self.ttft = Histogram(f"{prefix}time_to_first_token_seconds",
                              "Arrival to the first committed canvas, per choice.", LATENCY)
        self.tpot = Histogram(f"{prefix}time_per_output_token_seconds",
                              "After the first canvas: (e2e - ttft) / tokens committed after it, per choice.",
                              PER_TOKEN)
        self.e2e = Histogram(f"{prefix}e2e_request_latency_seconds", "Arrival to the last token, per choice.",
                             LATENCY)

    def families(self) -> tuple[MetricCounter | Histogram, ...]:
        return (self.ttft, self.tpot, self.e2e, self.requests, self.finished, self.rejected, self.prompt_tokens,
                self.generation_tokens)

    def admit(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(amount=prompt_tokens)

    def finish(self, reason: str, e2e: float, ttft: float | None, tpot: float | None, tokens: int) -> None:
        self.finished.inc(reason)
        self.generation_tokens.inc(amount=tokens)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)


class Metrics:
    """Everyone's series (`total`), engine figures, and each API key's own series (`dgemma_key_*`, labelled with
    the key's position among the configured keys, never the key)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = Traffic("dgemma_")
        self.keys: dict[int, Traffic] = {}
        self.queue = Histogram("dgemma_request_queue_time_seconds",
                               "Submission to the engine until the prompt is prefilled into a batch.", LATENCY)
        self.steps = Histogram("dgemma_denoising_steps_per_canvas", "Denoising steps each committed canvas took.",
                               STEPS)
        self.tpf = Histogram("dgemma_tokens_per_forward", "Committed tokens per decoder pass, per finished request.",
                             TOKENS_PER_FORWARD)
        self.batch = Histogram("dgemma_batch_size", "Sequences denoised together, per engine step.", BATCH)
        self.passes = MetricCounter("dgemma_decoder_passes_total", "Decoder passes of the diffusion engine.")
        self.pass_rows = MetricCounter("dgemma_decoder_rows_total", "Rows summed over decoder passes (divided by the "
                                 "passes: rows per pass).")
        self.done_rows = MetricCounter("dgemma_done_rows_total", "Rows carried in a decoder pass although their canvas "
                                 "was already done (0 with per-row canvas clocks).")
        self.done_seconds = MetricCounter("dgemma_done_rows_seconds_total", "Engine-step seconds spent on rows already "
                                    "done: each step's time times its share of done rows.")
        self._seen = (0, 0, 0)  # the engine's (passes, rows, done_rows) at the last step

    # ---- recording: the event loop (requests, choices) and the engine thread (engine figures) call these ------
    def _traffic(self, key: int | None) -> tuple[Traffic, ...]:
        """The series a request of API key `key` (None: a server without keys) counts in."""
        if key is None:
            return (self.total,)
        return self.total, self._own(key)

    def _own(self, key: int) -> Traffic:
        if key not in self.keys:
            self.keys[key] = Traffic("dgemma_key_")
        return self.keys[key]

    def admitted(self, prompt_tokens: int, key: int | None = None) -> None:
        with self._lock:
            for traffic in self._traffic(key):
                traffic.admit(prompt_tokens)

    def refused(self, reason: str, key: int | None = None) -> None:
        with self._lock:
            for traffic in self._traffic(key):
                traffic.rejected.inc(reason)

    def choice_finished(self, reason: str, e2e: float, ttft: float | None, tpot: float | None, tokens: int,
                        key: int | None = None) -> None:
        with self._lock:
            for traffic in self._traffic(key):
                traffic.finish(reason, e2e, ttft, tpot, tokens)

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

    # ---- exposition -----------------------------------------------------------------------------------------
    def render(self, gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]] | None = None) -> str:
        """Everything: the given gauges and counters (name: (help, value)), the recorded series, every key's own."""
        with self._lock:
            lines = _scalars(gauges, counters or {})
            for metric in (*self.total.families(), self.queue, self.steps, self.tpf, self.batch, self.passes,
                           self.pass_rows, self.done_rows, self.done_seconds):
                lines += metric.render()
            lines += self._by_key(sorted(self.keys))
        return "\n".join(lines) + "\n"

    def render_key(self, key: int, gauges: dict[str, tuple[str, float]]) -> str:
        """What API key `key` may see: the given gauges and its own series (zeros before its first request)."""
        with self._lock:
            return "\n".join(_scalars(gauges, {}) + self._by_key([key])) + "\n"

    def _by_key(self, keys: list[int]) -> list[str]:
        """The dgemma_key_* families, each with the series of `keys` (label api_key: the key's position)."""
        lines: list[str] = []
        for family in zip(*(self._own(k).families() for k in keys)):
            lines += family[0].header()
            for key, metric in zip(keys, family):
                lines += metric.samples(_label("api_key", key))
        return lines


def _scalars(gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]]) -> list[str]:
    lines = []
    for kind, values in (("gauge", gauges), ("counter", counters)):
        for name, (help, value) in values.items():
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {float(value)!r}"]
    return lines
