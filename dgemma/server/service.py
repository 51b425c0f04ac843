"""Between the routes and the engine thread: readiness, admission, OpenAI options -> per-choice SamplingParams
(validated by SamplingParams, whose errors become 400s naming the OpenAI field), and `Generation`, which turns
one request's engine events into text deltas, drafts, tool calls, finish reasons and Results (through
`OutputStream`, as the Python API does) and records its latencies."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dgemma.api import Model
from dgemma.chat.tools import ToolUse
from dgemma.engine import Event, OutputStream, PrefixCache, Result, StreamEvent
from dgemma.errors import DgemmaError
from dgemma.images import has_parts
from dgemma.sampling import MAX_SEED, SamplingParams, SamplingParamsError
from dgemma.server.config import ServerConfig
from dgemma.server.errors import ApiError, bad_request, unsupported
from dgemma.server.formats import SEEDED_PARAMS
from dgemma.server.metrics import Metrics
from dgemma.server.protocol import OpenAIRequest
from dgemma.server.worker import Job, Sink, Worker

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
        self._tokenizing = asyncio.Semaphore(config.tokenizer_threads)
        self._imaging = asyncio.Semaphore(config.image_threads)  # image requests wait here, not for text threads
        self._image_pool = ThreadPoolExecutor(config.image_threads, "dgemma-image", initializer=_lower_priority)
        self.prefix_cache = PrefixCache(config.prefix_cache_mb << 20) if config.prefix_cache_mb else None

    # ---- life cycle -----------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="dgemma-load", daemon=True).start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            model = self._loader()
            if model.tokenizer is None:
                raise DgemmaError(f"{model.directory}: the server needs a tokenizer (tokenizer.json)")
            model.image_limits = replace(self.config.images, local_files=False)  # a client's paths: never
            model.defaults = self.config.limits.clamp(model.defaults)  # defaults within the fairness caps
            worker = Worker(lambda: model.runner(self.config.mode, "fast", self.config.max_concurrency,
                                                 self.prefix_cache), self.metrics)
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
        self._image_pool.shutdown(wait=False, cancel_futures=True)

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
    async def generate(self, body: OpenAIRequest, prompts: list[Any], param: str, id_prefix: str,
                       key: int | None = None) -> Generation:
        """Check `body` (cheap checks first), admit its choices or refuse at once, then encode and submit. `key`:
        which API key the client sent; it and `cache_salt` pick the request's prefix-cache partition."""
        t_arrival = time.perf_counter()
        if error := self.unavailable():
            raise error
        self.check_model(body.model)
        if (feature := body.unsupported()) is not None:
            raise unsupported(*feature)
        for name in ("stream_options", "dgemma_drafts"):
            if getattr(body, name) and not body.stream:
                raise bad_request(f"{name} needs stream=true", name)
        if self.config.mode != "diffusion" and (feature := _diffusion_only(body)) is not None:
            raise unsupported(feature, f"{feature} in {self.config.mode} mode (--mode {self.config.mode})")
        if body.temperature is not None and {"t_min", "t_max"} & _overrides(body).keys():
            raise bad_request("temperature and dgemma_sampling.t_min / t_max both set the schedule; send one",
                              "dgemma_sampling")
        choices = body.n * len(prompts)
        if choices > self.config.max_n:
            raise bad_request(f"n x prompts = {choices} choices; this server allows at most {self.config.max_n} "
                              "per request", "n")
        lease = self._admit(choices, key)
        try:
            plans, prompt_tokens = await self._within(_earliest(body.dgemma_timeout, self.config.request_timeout),
                                                      t_arrival, self._plan(body, prompts, param, key))
            return Generation(self, f"{id_prefix}-{uuid.uuid4().hex}", plans, prompt_tokens, body.dgemma_drafts,
                              lease, t_arrival, body.dgemma_timeout, body.tool_use(), key)
        except BaseException:
            lease.release()
            raise

    @staticmethod
    async def _within(timeout: float | None, t_arrival: float, work: Any) -> Any:
        """Await the preparation `work` within the request's deadline (408 when it passes first)."""
        if timeout is None:
            return await work
        try:
            return await asyncio.wait_for(work, max(0.0, t_arrival + timeout - time.perf_counter()))
        except TimeoutError:
            raise ApiError(408, f"the request's deadline ({timeout:g} s) passed while its prompt was prepared",
                           "dgemma_timeout", code="deadline_exceeded") from None

    async def _off_loop(self, fn: Callable, *args: Any, images: bool = False) -> Any:
        """`fn(*args)` in a worker thread, at most --tokenizer-threads at once (`images`: in the image threads, at
        most --image-threads at once). A cancelled caller (client gone, deadline passed) stops waiting at once; its
        thread keeps its place until it ends, so the cap holds."""
        gate = self._imaging if images else self._tokenizing
        await gate.acquire()
        try:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(self._image_pool, fn, *args) if images else \
                asyncio.ensure_future(asyncio.to_thread(fn, *args))
        except BaseException:
            gate.release()
            raise
        future.add_done_callback(lambda _: gate.release())
        return await asyncio.shield(future)

    def _admit(self, choices: int, key: int | None) -> Lease:
        if self.in_use + choices > self.config.capacity:
            self.metrics.refused("overloaded", key)
            raise ApiError(429, f"the server is at capacity ({self.config.max_concurrency} running + "
                           f"{self.config.max_queue} queued sequences); retry later", code="server_busy",
                           headers={"Retry-After": "1"})
        self.in_use += choices
        return Lease(self, choices)

    async def _plan(self, body: OpenAIRequest, prompts: list[Any], param: str,
                    key: int | None) -> tuple[list[Plan], int]:
        """One Plan per choice; every check is SamplingParams' (through `Model.check_request`)."""
        plans, prompt_tokens = [], 0
        renamed = body.renamed()
        names = {"prompt": param, "t_max": "temperature", "ar_temperature": "temperature"} | renamed
        names |= {k: f"dgemma_sampling.{k}" for k in _overrides(body)} | SEEDED_PARAMS
        limit = self.model.prompt_limit(self.config.limits)
        for prompt in prompts:
            try:
                # the loop never tokenizes (nor compiles a grammar, nor builds a seeded layout): one hop does it all
                ids, params = await self._off_loop(self._prepare, body, prompt, limit, _partition(key, body.cache_salt),
                                                   images=has_parts(prompt))
                plans += [Plan(ids, p) for p in params]
            except SamplingParamsError as e:  # a field is named as the client named it
                message = re.sub(rf"\b{e.param}\b", renamed[e.param], str(e)) if e.param in renamed else str(e)
                raise bad_request(message, names.get(e.param, e.param)) from None
            except DgemmaError as e:
                raise bad_request(str(e), param) from None
            prompt_tokens += len(ids)
        return plans, prompt_tokens

    def _prepare(self, body: OpenAIRequest, prompt: Any, limit: int,
                 partition: str | None) -> tuple[list[int], list[SamplingParams]]:
        ids = self.model.encode_prompt(prompt, limit, body.tool_use(), partition)
        return ids, self._choice_params(body, ids, partition)

    def _choice_params(self, body: OpenAIRequest, ids: list[int], partition: str | None) -> list[SamplingParams]:
        """The n choices of a prompt: choice i has seed + i. The starting canvas and the renoising are random
        even when sampling is near-greedy, so temperature 0 without a seed uses seed 0 (reproducible)."""
        model = self.model
        new = getattr(body, body.renamed()["max_new_tokens"])
        room = max(1, model.max_context - len(ids))
        new = min(model.defaults.max_new_tokens, room, self.config.max_tokens or room) if new is None else new
        greedy = body.temperature is not None and body.temperature < GREEDY_T
        base = 0 if body.seed is None and greedy else body.seed
        sampling = schedule(body.temperature) if self.config.mode == "diffusion" else \
            {"ar_temperature": body.temperature} if body.temperature is not None else {}
        first = model.params(max_new_tokens=new, seed=base, stop=body.stop, grammar=body.grammar(),
                             logprobs=body.logprob_count(), **sampling, **_overrides(body), cache_salt=partition,
                             layout_limit=min(room, self.config.max_tokens or room), **body.seeded())
        model.check_request(ids, first, self.config.limits, self.config.mode)
        if base is None:
            return [first] * body.n
        return [first] + [first.replace(seed=(base + i) % (MAX_SEED + 1)) for i in range(1, body.n)]

    def defaults(self) -> dict[str, Any] | None:
        """What a request gets for the sampling fields it leaves out (None until the model is loaded)."""
        if self.model is None:
            return None
        d = self.model.defaults
        return {"max_tokens": min(d.max_new_tokens, self.config.max_tokens or d.max_new_tokens),
                "max_denoising_steps": d.max_denoising_steps, "entropy_bound": d.entropy_bound, "t_min": d.t_min,
                "t_max": d.t_max, "canvas_length": self.model.module.cfg.canvas_length}


def _overrides(body: OpenAIRequest) -> dict[str, Any]:
    """The dgemma_sampling fields set; temperatures in [0, GREEDY_T / 2) count as GREEDY_T / 2, the floor
    `schedule` gives `temperature` (sampling is greedy there; 1 / T stays finite). Negative ones stay refused."""
    out, floor = body.dgemma_sampling.overrides() if body.dgemma_sampling is not None else {}, GREEDY_T / 2
    return out | {k: floor for k, v in out.items() if k in ("t_min", "t_max") and 0 <= v < floor}


def _diffusion_only(body: OpenAIRequest) -> str | None:
    """The first field set that autoregressive (and speculative) decoding cannot honour: a nucleus cut (top_p < 1;
    no mode has one, but diffusion documents it as accepted), the denoising options, drafts."""
    if body.top_p is not None and body.top_p < 1:
        return "top_p"
    if body.dgemma_sampling is not None and body.dgemma_sampling.overrides():
        return "dgemma_sampling"
    return "dgemma_drafts" if body.dgemma_drafts else None


def _lower_priority() -> None:
    """An image thread yields the CPU to the engine and to text prompts (Linux: a thread's own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: same priority
        pass


def _partition(key: int | None, salt: str | None) -> str | None:
    """The prefix-cache partition of a request: its API key's position and its cache_salt (None: the shared one,
    for a server without keys and a request without a salt)."""
    return None if key is None and salt is None else json.dumps([key, salt])


def _earliest(*timeouts: float | None) -> float | None:
    return min((t for t in timeouts if t is not None), default=None)


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
    output: OutputStream
    logprobs: bool
    first_sent: threading.Event = field(default_factory=threading.Event)  # its first commit was handled (sent)
    first_tokens: int = 0  # tokens of the first committed canvas
    t_first: float | None = None
    tokens: int = 0


class Generation:
    """One HTTP request's choices in the engine: engine events in, (choice index, StreamEvent) out, as the Python
    API's `stream` gives them. `close()` aborts what is left and gives back the admission lease (idempotent; routes
    call it when the response ends for any reason)."""

    def __init__(self, service: Service, id: str, plans: list[Plan], prompt_tokens: int, drafts: bool,
                 lease: Lease, t_arrival: float, timeout: float | None = None, tools: ToolUse | None = None,
                 key: int | None = None):
        self.service, self.id, self.lease = service, id, lease
        self.key = key  # the API key's position: its own /metrics series
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.t_arrival = t_arrival
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        sink = Sink(asyncio.get_running_loop(), self.queue)
        self.choices: dict[str, _Choice] = {}
        self.errors: dict[int, ApiError] = {}  # why a choice failed (its "done" event has no result)
        self._feeding = threading.Lock()  # one event at a time into the choices' OutputStreams
        self.timeout = _earliest(timeout, service.config.request_timeout)
        deadlines = [t_arrival + t if t is not None else None for t in (service.config.max_queue_seconds,
                                                                           self.timeout)]
        jobs = []
        for i, plan in enumerate(plans):
            rid = f"{id}-{i}"
            output = OutputStream(service.model.tokenizer, plan.params.stop, tools)
            self.choices[rid] = _Choice(i, rid, output, plan.params.logprobs is not None)
            jobs.append(Job(rid, plan.ids, plan.params, drafts, sink, self.t_arrival, *deadlines,
                            first_sent=self.choices[rid].first_sent))
        service.metrics.admitted(sum(len(p.ids) for p in plans), key)
        service.worker.submit(jobs)

    @property
    def n(self) -> int:
        return len(self.choices)

    def usage(self) -> dict[str, int]:
        completion = sum(c.tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """Each choice's StreamEvents, and "start" when it enters the batch. A "done" event carries the choice's
        Result when it ended normally; else `errors[index]` says why not."""
        open_choices = sum(c.output.finish_reason is None for c in self.choices.values())
        while open_choices:
            event = await self.queue.get()
            choice = self.choices.get(event.request_id)
            if choice is None or choice.output.finish_reason is not None:
                continue
            if event.kind == "start":
                yield choice.index, StreamEvent("start")
                continue
            # committed text and finishes are detokenized (and a stop's kept ids found) off the event loop
            items = self._on_event(choice, event) if event.kind == "draft" else \
                await asyncio.to_thread(self._on_event, choice, event)
            for item in items:
                open_choices -= item.kind == "done"
                yield choice.index, item
            if event.kind == "commit":
                choice.first_sent.set()  # its text is out (a stream sends a chunk before asking for the next)

    async def collect(self) -> list[Result]:
        """Non-streaming: each choice's Result, in order; raises the first error."""
        results: list[Result] = [None] * self.n
        async for index, item in self.events():
            if item.kind == "done" and item.result is None:
                raise self.errors[index]
            results[index] = item.result
        return results

    def close(self) -> None:
        with self._feeding:  # a choice's event may still be in a worker thread
            unfinished = [c for c in self.choices.values() if c.output.finish_reason is None]
            for c in unfinished:
                c.output.feed(Event(c.request_id, "finish", finish_reason="abort"))
                self._record(c)
        if unfinished:
            self.service.worker.abort([c.request_id for c in unfinished])
        self.lease.release()

    # ---- engine events -> StreamEvents ------------------------------------------------------------------------
    def _on_event(self, c: _Choice, event: Event) -> list[StreamEvent]:
        with self._feeding:
            items = c.output.feed(event)
            for item in items:
                if item.kind == "text" and c.t_first is None and item.token_ids:
                    c.t_first, c.first_tokens = time.perf_counter(), len(item.token_ids)
                if item.kind != "done":
                    continue
                if c.output.stopped:
                    self.service.worker.abort([c.request_id])  # harmless when the engine already finished it
                self._record(c)
                if item.finish_reason in ("stop", "length", "tool_calls"):
                    item.result = c.output.result(0, c.logprobs)
                else:
                    self.errors[c.index] = self._error(item.finish_reason, c.tokens)
            return items

    def _error(self, reason: str, tokens: int) -> ApiError:
        if reason == "abort":
            return ApiError(503, "the server is shutting down; the request was aborted", code="shutting_down")
        if reason == "queue_timeout":
            return ApiError(503, f"the request waited {self.service.config.max_queue_seconds:g} s for a batch row "
                            "(--max-queue-seconds); retry later", code="queue_timeout", headers={"Retry-After": "1"})
        if reason == "deadline":
            return ApiError(408, f"the request's deadline ({self.timeout:g} s) passed after {tokens} tokens; it was "
                            "aborted", "dgemma_timeout", code="deadline_exceeded")
        return ApiError(500, "the engine failed while generating", code="engine_error")

    def _record(self, c: _Choice) -> None:
        now = time.perf_counter()
        c.tokens = len(c.output.kept_ids())
        ttft = None if c.t_first is None else c.t_first - self.t_arrival
        later = c.tokens - c.first_tokens
        tpot = (now - c.t_first) / later if c.t_first is not None and later > 0 else None
        self.service.metrics.choice_finished(c.output.finish_reason, now - self.t_arrival, ttft, tpot, c.tokens,
                                             self.key)
