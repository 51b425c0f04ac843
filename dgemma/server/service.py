"""The server between the routes and the engine thread: loading, readiness and draining, admission (capacity
leases, the tokenizer and image threads, the preparation deadline), and each request's way in: checked and planned
(planning.py), then run as a `Generation` (generation.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from dgemma.api import Model
from dgemma.engine import PrefixCache
from dgemma.errors import DgemmaError
from dgemma.images import has_parts
from dgemma.parallel.mirror import leading
from dgemma.sampling import SamplingParamsError
from dgemma.server import planning
from dgemma.server.config import ServerConfig
from dgemma.server.errors import ApiError, bad_request
from dgemma.server.generation import Generation
from dgemma.server.metrics import Metrics
from dgemma.server.planning import Plan
from dgemma.server.protocol import ChatCompletionRequest, OpenAIRequest
from dgemma.server.worker import Worker

log = logging.getLogger("dgemma.server")


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
        self.tokens_in_use = 0  # their prompt tokens + max_tokens: the load a router reads at /get_load
        self._tokenizing = asyncio.Semaphore(config.tokenizer_threads)
        self._imaging = asyncio.Semaphore(config.image_threads)  # image requests wait here, not for text threads
        self._image_pool = ThreadPoolExecutor(config.image_threads, "dgemma-image", initializer=_lower_priority)
        self.prefix_cache = prefix_cache_for(config)

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
            worker = Worker(engine_factory(model, self.config, self.prefix_cache), self.metrics)
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
        self._check(body, len(prompts))
        lease = self._admit(body.n * len(prompts), key)
        timeout = _earliest(body.dgemma_timeout, self.config.request_timeout)
        try:
            plans, prompt_tokens = await self._within(timeout, t_arrival, self._plan(body, prompts, param, key))
            lease.hold_tokens(prompt_tokens + sum(p.params.max_new_tokens for p in plans))
            return Generation(self, f"{id_prefix}-{uuid.uuid4().hex}", plans, prompt_tokens, body.dgemma_drafts,
                              lease, t_arrival, timeout, body.turn(), key)
        except BaseException:
            lease.release()
            raise

    async def render(self, body: OpenAIRequest, prompts: list[Any], param: str, key: int | None = None) -> list[Plan]:
        """What `generate` would submit for each prompt (its ids, its first choice's SamplingParams), checked the
        same way, without admitting or running it: the render routes' pure preprocessing."""
        t_arrival = time.perf_counter()
        self._check(body, len(prompts))
        timeout = _earliest(body.dgemma_timeout, self.config.request_timeout)
        plans, _ = await self._within(timeout, t_arrival, self._plan(body, prompts, param, key))
        return plans[::body.n]

    def chat_prompt(self, body: ChatCompletionRequest) -> list[dict[str, Any]]:
        """A chat's messages; its tools, tool_choice and template arguments checked first (the loaded tokenizer
        picks the call syntax): a 400 before any model work."""
        try:
            body.turn(self.model.tokenizer if self.model is not None else None, self.config.template_defaults)
            return body.chat()
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None

    def _check(self, body: OpenAIRequest, prompts: int) -> None:
        if error := self.unavailable():
            raise error
        self.check_model(body.model)
        planning.check(body, self.config, prompts)

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

    async def off_loop(self, fn: Callable, *args: Any, images: bool = False) -> Any:
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
        limit = self.model.prompt_limit(self.config.limits)
        part = planning.partition(key, body.cache_salt)
        for prompt in prompts:
            try:
                # the loop never tokenizes (nor compiles a grammar, nor builds a layout): one hop does it all
                ids, params = await self.off_loop(planning.prepare, self.model, self.config, body, prompt, limit,
                                                   part, images=has_parts(prompt))
                plans += [Plan(ids, p) for p in params]
            except SamplingParamsError as e:  # a field is named as the client named it
                raise planning.client_error(e, body, param) from None
            except DgemmaError as e:
                raise bad_request(str(e), param) from None
            prompt_tokens += len(ids)
        return plans, prompt_tokens

    def defaults(self) -> dict[str, Any] | None:
        """What a request gets for the sampling fields it leaves out (None until the model is loaded)."""
        if self.model is None:
            return None
        d = self.model.defaults
        return {"max_tokens": min(d.max_new_tokens, self.config.max_tokens or d.max_new_tokens),
                "max_denoising_steps": d.max_denoising_steps, "entropy_bound": d.entropy_bound, "t_min": d.t_min,
                "t_max": d.t_max, "canvas_length": self.model.module.cfg.canvas_length}


def _lower_priority() -> None:
    """An image thread yields the CPU to the engine and to text prompts (Linux: a thread's own nice value), and
    its torch ops (the vision tower) use half the cores at most (torch's thread count is per thread)."""
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: same priority
        pass


def _earliest(*timeouts: float | None) -> float | None:
    return min((t for t in timeouts if t is not None), default=None)


class Lease:
    """Admitted capacity of one request, given back exactly once."""

    def __init__(self, service: Service, n: int):
        self.service, self.n, self.tokens = service, n, 0

    def hold_tokens(self, tokens: int) -> None:
        self.service.tokens_in_use += tokens
        self.tokens += tokens

    def release(self) -> None:
        self.service.in_use -= self.n
        self.service.tokens_in_use -= self.tokens
        self.n = self.tokens = 0


def prefix_cache_for(config: ServerConfig) -> PrefixCache | None:
    """The server's prefix cache (--prefix-cache-mb; 0: none); every tensor-parallel rank keeps its own alike."""
    return PrefixCache(config.prefix_cache_mb << 20) if config.prefix_cache_mb else None


def engines(model: Model, config: ServerConfig, prefix_cache: PrefixCache | None) -> Callable[[], Any]:
    """The server's engine for `model`, made anew after a failed step (every rank makes the same)."""
    model.speculative_pacing = config.speculative_pacing
    return lambda: model.runner(config.mode, "fast", config.max_concurrency, prefix_cache)


def engine_factory(model: Model, config: ServerConfig, prefix_cache: PrefixCache | None) -> Callable[[], Any]:
    """The worker's engines; under tensor parallelism rank 0's lead the other ranks' (`parallel.mirror`)."""
    make, group = engines(model, config, prefix_cache), model.module.parallel
    return make if group is None else leading(make, group)

