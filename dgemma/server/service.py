"""Between the routes and the engine thread: readiness, admission, OpenAI options -> per-choice SamplingParams,
and `Generation`, which turns one request's engine events into text deltas, drafts and finish reasons (through
`TextStream`, as `Model.stream` does) and records its latencies."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from dgemma.api import Model
from dgemma.engine import Engine, Event
from dgemma.errors import DgemmaError
from dgemma.sampling import SamplingParams
from dgemma.server.config import ServerConfig
from dgemma.server.errors import ApiError, bad_request, unsupported
from dgemma.server.metrics import Metrics
from dgemma.server.protocol import MAX_SEED, OpenAIRequest
from dgemma.server.worker import Job, Sink, Worker
from dgemma.textstream import TextStream

log = logging.getLogger("dgemma.server")
GREEDY_T = 1e-3  # temperatures below this (0 included) -> a near-greedy schedule from 1e-3 down to 5e-4


def schedule(temperature: float | None) -> dict[str, float]:
    """OpenAI temperature T -> the denoising schedule t_max = T, t_min = T / 2 (None keeps the checkpoint's)."""
    if temperature is None:
        return {}
    t = max(temperature, GREEDY_T)  # below 1e-3 sampling is greedy anyway; 1 / T stays finite
    return {"t_max": t, "t_min": t / 2}


@dataclass
class Plan:
    """One engine request: a choice of a prompt."""

    ids: list[int]
    params: SamplingParams


@dataclass
class Output:
    """What a route turns into a chunk: "text" (a committed delta), "draft", "finish", or "error"."""

    kind: str
    index: int
    text: str = ""
    finish_reason: str | None = None
    draft: dict[str, Any] | None = None
    error: ApiError | None = None


class Service:
    def __init__(self, config: ServerConfig, loader: Callable[[], Model],
                 on_fatal: Callable[[str], None] | None = None):
        self.config = config
        self.metrics = Metrics()
        self.created = int(time.time())
        self._loader, self._on_fatal = loader, on_fatal
        self.model: Model | None = None
        self.worker: Worker | None = None
        self.state = "loading"  # loading -> ready -> draining; or failed
        self.failure: str | None = None
        self.in_use = 0  # admitted choices (running + queued)

    # ---- life cycle -----------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="dgemma-load", daemon=True).start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            model = self._loader()
            if model.tokenizer is None:
                raise DgemmaError(f"{model.directory}: the server needs a tokenizer (tokenizer.json)")
            eos = model.defaults.eos_token_ids or ()
            worker = Worker(lambda: Engine(model.model, eos, model.pad_id, "fast", self.config.max_concurrency),
                            self.metrics)
            worker.start()
        except Exception as e:
            self.failure = str(e) if isinstance(e, DgemmaError) else f"{type(e).__name__}: {e}"
            self.state = "failed"
            log.error("cannot load the model: %s", self.failure)
            if self._on_fatal:
                self._on_fatal(self.failure)
            return
        self.model, self.worker = model, worker
        if self.state == "loading":
            self.state = "ready"
        log.info("model %s ready in %.1fs", self.config.model_name, time.perf_counter() - t0)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests; in-flight ones get `shutdown_timeout` seconds. Signal-handler safe."""
        if self.state in ("draining", "failed"):
            return
        self.state = "draining"
        if self.worker is not None:
            self.worker.drain(self.config.shutdown_timeout)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def unavailable(self) -> ApiError | None:
        """Why requests cannot be served now (503), or None when ready."""
        retry = {"Retry-After": "1"}
        if self.state == "loading":
            return ApiError(503, "the model is still loading", code="model_loading", headers=retry)
        if self.state == "draining":
            return ApiError(503, "the server is shutting down", code="shutting_down")
        if self.state == "failed":
            return ApiError(503, f"the model failed to load: {self.failure}", code="engine_failed")
        if self.worker is None or not self.worker.alive:
            return ApiError(503, "the engine thread has stopped", code="engine_failed")
        return None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.config.model_name!r}",
                           "model", "model_not_found")

    # ---- requests -------------------------------------------------------------------------------------------
    async def generate(self, body: OpenAIRequest, prompts: list[Any], param: str, id_prefix: str) -> Generation:
        """Check `body` (cheap checks first), admit its choices or refuse at once, then encode and submit."""
        t_arrival = time.perf_counter()
        if error := self.unavailable():
            raise error
        self.check_model(body.model)
        if (feature := body.unsupported()) is not None:
            raise unsupported(*feature)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options needs stream=true", "stream_options")
        if body.dgemma_drafts and not body.stream:
            raise bad_request("dgemma_drafts needs stream=true", "dgemma_drafts")
        stops = self._stops(body.stop)
        choices = body.n * len(prompts)
        if choices > self.config.max_n:
            raise bad_request(f"n x prompts = {choices} choices; this server allows at most {self.config.max_n} "
                              "per request", "n")
        lease = self._admit(choices)
        try:
            plans, prompt_tokens = await self._plan(body, prompts, param, stops)
            return Generation(self, f"{id_prefix}-{uuid.uuid4().hex}", plans, prompt_tokens, body.dgemma_drafts,
                              lease, t_arrival)
        except BaseException:
            lease.release()
            raise

    def _stops(self, stop: str | list[str] | None) -> tuple[str, ...]:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stops) > self.config.max_stop:
            raise bad_request(f"{len(stops)} stop strings; this server allows at most {self.config.max_stop}", "stop")
        for s in stops:
            if not s:
                raise bad_request("stop strings must not be empty", "stop")
            if len(s) > self.config.max_stop_chars:
                raise bad_request(f"a stop string has {len(s)} characters; this server allows at most "
                                  f"{self.config.max_stop_chars}", "stop")
        return stops

    def _admit(self, choices: int) -> Lease:
        if self.in_use + choices > self.config.capacity:
            self.metrics.refused("overloaded")
            raise ApiError(429, f"the server is at capacity ({self.config.max_concurrency} running + "
                           f"{self.config.max_queue} queued sequences); retry later", code="server_busy",
                           headers={"Retry-After": "1"})
        self.in_use += choices
        return Lease(self, choices)

    async def _plan(self, body: OpenAIRequest, prompts: list[Any], param: str,
                    stops: tuple[str, ...]) -> tuple[list[Plan], int]:
        model = self.model
        plans, prompt_tokens = [], 0
        max_tokens, tokens_param = body.max_tokens, "max_tokens"
        if getattr(body, "max_completion_tokens", None) is not None:
            max_tokens, tokens_param = body.max_completion_tokens, "max_completion_tokens"
        for prompt in prompts:
            try:
                ids = await asyncio.to_thread(model.encode_prompt, prompt)
            except DgemmaError as e:
                raise bad_request(str(e), param) from None
            limit = self.config.max_prompt_tokens
            if limit is not None and len(ids) > limit:
                raise bad_request(f"the prompt has {len(ids)} tokens; this server allows at most {limit}", param)
            new = self._max_new_tokens(max_tokens, len(ids), param, tokens_param)
            # The starting canvas and the renoising are random even when sampling is near-greedy: seed 0 makes
            # temperature 0 reproducible.
            greedy = body.temperature is not None and body.temperature < GREEDY_T
            base = 0 if body.seed is None and greedy else body.seed
            for i in range(body.n):
                seed = None if base is None else (base + i) % (MAX_SEED + 1)
                try:
                    params = model.params(max_new_tokens=new, seed=seed, stop=stops, sampling="fast",
                                          **schedule(body.temperature))
                    model.check_request(ids, params)
                except DgemmaError as e:
                    raise bad_request(str(e)) from None
                plans.append(Plan(ids, params))
            prompt_tokens += len(ids)
        return plans, prompt_tokens

    def _max_new_tokens(self, requested: int | None, prompt_len: int, param: str, tokens_param: str) -> int:
        context, cap = self.model.max_context, self.config.max_tokens
        if requested is None:
            room = context - prompt_len
            if room < 1:
                raise bad_request(f"the prompt ({prompt_len} tokens) fills the model's context ({context} tokens)",
                                  param)
            return min(self.model.defaults.max_new_tokens, room, cap or room)
        if cap is not None and requested > cap:
            raise bad_request(f"{tokens_param} ({requested}) exceeds this server's limit ({cap})", tokens_param)
        if prompt_len + requested > context:
            raise bad_request(f"the prompt ({prompt_len} tokens) + {tokens_param} ({requested}) exceeds the model's "
                              f"context ({context} tokens)", tokens_param)
        return requested


class Lease:
    """Admitted capacity of one request, given back exactly once."""

    def __init__(self, service: Service, n: int):
        self.service, self.n = service, n

    def release(self) -> None:
        self.service.in_use -= self.n
        self.n = 0


@dataclass
class _Choice:
    index: int
    request_id: str
    stream: TextStream  # its decoder holds the committed ids
    canvases: int = 0
    step: int = 0
    first_tokens: int = 0  # tokens of the first committed canvas
    t_first: float | None = None
    finish_reason: str | None = None
    tokens: int = 0


class Generation:
    """One HTTP request's choices in the engine: engine events in, `Output`s out. `close()` aborts what is left
    and gives back the admission lease (idempotent; routes call it when the response ends for any reason)."""

    def __init__(self, service: Service, id: str, plans: list[Plan], prompt_tokens: int, drafts: bool,
                 lease: Lease, t_arrival: float):
        self.service, self.id, self.lease = service, id, lease
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.t_arrival = t_arrival
        self.tokenizer = service.model.tokenizer
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        sink = Sink(asyncio.get_running_loop(), self.queue)
        self.choices: dict[str, _Choice] = {}
        jobs = []
        for i, plan in enumerate(plans):
            rid = f"{id}-{i}"
            self.choices[rid] = _Choice(i, rid, TextStream(self.tokenizer, plan.params.stop))
            jobs.append(Job(rid, plan.ids, plan.params, drafts, sink, self.t_arrival))
        service.metrics.admitted(sum(len(p.ids) for p in plans))
        service.worker.submit(jobs)

    @property
    def n(self) -> int:
        return len(self.choices)

    def usage(self) -> dict[str, int]:
        completion = sum(c.tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    async def outputs(self) -> AsyncIterator[Output]:
        open_choices = sum(c.finish_reason is None for c in self.choices.values())
        while open_choices:
            event = await self.queue.get()
            choice = self.choices.get(event.request_id)
            if choice is None or choice.finish_reason is not None:
                continue
            for out in self._on_event(choice, event):
                open_choices -= out.kind in ("finish", "error")
                yield out

    async def collect(self) -> list[tuple[str, str]]:
        """Non-streaming: (text, finish_reason) per choice, in order; raises the first error."""
        texts: list[list[str]] = [[] for _ in range(self.n)]
        reasons: list[str] = [""] * self.n
        async for out in self.outputs():
            if out.kind == "error":
                raise out.error
            if out.kind == "text":
                texts[out.index].append(out.text)
            elif out.kind == "finish":
                reasons[out.index] = out.finish_reason
        return [("".join(t), r) for t, r in zip(texts, reasons)]

    def close(self) -> None:
        unfinished = [c for c in self.choices.values() if c.finish_reason is None]
        for c in unfinished:
            self._finish(c, "abort")
        if unfinished:
            self.service.worker.abort([c.request_id for c in unfinished])
        self.lease.release()

    # ---- events -> outputs ------------------------------------------------------------------------------------
    def _on_event(self, c: _Choice, event: Event) -> list[Output]:
        if event.kind == "draft":
            c.step += 1
            ids, committed = event.token_ids, c.stream.decoder.ids
            if ids[:len(committed)] == committed:  # drafts carry the committed ids, then the canvas
                ids = ids[len(committed):]
            draft = {"canvas": c.canvases, "step": c.step, "text": self.tokenizer.decode(ids), "token_ids": ids}
            return [Output("draft", c.index, draft=draft)]
        if event.kind == "commit":
            return self._on_commit(c, event.token_ids)
        reason = event.finish_reason
        if reason in ("stop", "length"):
            tail = c.stream.push([], final=True)  # may complete a stop string held back until now
            reason = "stop" if c.stream.stopped else reason
            return ([Output("text", c.index, tail)] if tail else []) + [self._finish(c, reason)]
        self._finish(c, "abort" if reason == "abort" else "error")
        error = (ApiError(503, "the server is shutting down; the request was aborted", code="shutting_down")
                 if reason == "abort" else ApiError(500, "the engine failed while generating", code="engine_error"))
        return [Output("error", c.index, error=error)]

    def _on_commit(self, c: _Choice, ids: list[int]) -> list[Output]:
        if c.t_first is None:
            c.t_first, c.first_tokens = time.perf_counter(), len(ids)
        c.canvases, c.step = c.canvases + 1, 0
        delta = c.stream.push(ids)
        out = [Output("text", c.index, delta)] if delta else []
        if c.stream.stopped:
            self.service.worker.abort([c.request_id])
            out.append(self._finish(c, "stop"))
        return out

    def _finish(self, c: _Choice, reason: str) -> Output:
        now = time.perf_counter()
        c.finish_reason = reason
        c.tokens = len(c.stream.kept_ids())
        ttft = None if c.t_first is None else c.t_first - self.t_arrival
        later = c.tokens - c.first_tokens
        tpot = (now - c.t_first) / later if c.t_first is not None and later > 0 else None
        self.service.metrics.choice_finished(reason, now - self.t_arrival, ttft, tpot, c.tokens)
        return Output("finish", c.index, finish_reason=reason)
