"""The engine's own thread. The engine is not thread-safe, so everything reaches it through one queue that is
drained between denoising steps (new requests, aborts, drain, stop); its events go back to each request's asyncio
queue with `loop.call_soon_threadsafe`, one call per loop per step. Once idle for IDLE_POLL it runs the work that
waited (`Engine.tidy`: finished answers' last canvases for the prefix cache), a piece at a time with the queue
polled between pieces, so a request waits for one piece at most. After a step that committed a request's first
ids the thread waits (FIRST_TEXT_WAIT at most) until the event loop has sent them: the next step would otherwise
take the cores the loop needs to send the request's first text."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from dgemma.engine import Engine, Event, Request  # Engine or AutoregressiveEngine: the same interface
from dgemma.sampling import SamplingParams
from dgemma.server.metrics import Metrics

log = logging.getLogger("dgemma.server")
IDLE_POLL = 0.05  # seconds an idle worker waits for work before checking its drain deadline again
FIRST_TEXT_WAIT = 0.005  # seconds the engine waits, at most, for the event loop to send a request's first text


@dataclass
class Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # receives engine Events; synthetic "finish" events carry reason "abort" or "error"


@dataclass
class Submission:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    drafts: bool
    sink: Sink
    t_submit: float
    queue_deadline: float | None = None  # perf_counter time: not in the batch by then -> "queue_timeout"
    deadline: float | None = None  # perf_counter time: not finished by then -> "deadline"
    first_sent: threading.Event = field(default_factory=threading.Event)  # set by the loop: first commit handled
    first_seen: bool = False  # the engine committed this request's first ids


class Worker:
    def __init__(self, make_engine: Callable[[], Engine], metrics: Metrics):
        self._make_engine = make_engine
        self.engine = make_engine()
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, Submission] = {}
        self._requests: dict[str, Request] = {}
        self._unstarted: set[str] = set()  # requests not yet in the batch: told "start" when they are
        self._deadline: float | None = None  # while draining: abort whatever still runs after this time
        self._tidying = False  # the engine's idle-time work is under way (the inbox is polled between pieces)
        self._thread = threading.Thread(target=self._run, name="dgemma-engine", daemon=True)
        self.running = 0  # published after each step for /metrics
        self.waiting = 0

    # ---- called from the event loop (or a signal handler: SimpleQueue.put is reentrant) --------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, jobs: list[Submission]) -> None:
        self._inbox.put(("add", jobs))

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(("abort", request_ids))

    def drain(self, timeout: float) -> None:
        """Keep serving what is in flight, but abort it all `timeout` seconds from now."""
        self._inbox.put(("drain", time.perf_counter() + timeout))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and end the thread."""
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException:
            log.exception("the engine thread died")
            self._fail_all("error", touch_engine=False)
            raise
        finally:
            if (close := getattr(self.engine, "close", None)) is not None:  # the other ranks' end (parallel.mirror)
                close()

    def _serve_once(self) -> bool:
        idle = not self.engine.has_work()
        commands = self._commands(block=idle and not self._tidying)
        # idle for IDLE_POLL (or between two pieces of it): a piece of the work that waited for idle time
        self._tidying = idle and not commands and self.engine.tidy()
        for kind, arg in commands:
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "drain":
                self._deadline = arg
            elif kind == "stop":
                self._fail_all("abort")
                return False
        if self._deadline is not None and time.perf_counter() >= self._deadline and self._requests:
            log.warning("shutdown timeout: aborting %d request(s) still in flight", len(self._requests))
            self._fail_all("abort")
        self._expire()
        if self.engine.has_work():
            self._step()
            self._tell_started()
        self.running, self.waiting = self.engine.num_running, len(self.engine.waiting)
        return True

    def _commands(self, block: bool) -> list[tuple[str, object]]:
        out = []
        try:
            out.append(self._inbox.get(timeout=IDLE_POLL) if block else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            return out

    def _add(self, jobs: list[Submission]) -> None:
        for job in jobs:
            try:
                req = self.engine.add_request(job.prompt, job.params, request_id=job.request_id, drafts=job.drafts)
            except Exception:
                log.exception("the engine refused request %s", job.request_id)
                self._deliver([(job.sink, Event(job.request_id, "finish", finish_reason="error"))])
                continue
            req.stats.t_arrival = job.t_submit  # queue time counts from the hand-over, not from this drain
            self._requests[job.request_id] = req
            self._jobs[job.request_id] = job
            self._unstarted.add(job.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        """The client is gone or a stop string was seen: the caller already knows, so nothing is sent back."""
        for rid in request_ids:
            if rid in self._requests:
                self.engine.abort(rid)
                self._retire(rid)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing the %d request(s) in flight and starting a fresh engine",
                          len(self._requests))
            self._fail_all("error")
            self.engine = self._make_engine()
            return
        self.metrics.engine_step(self.engine.num_running, getattr(self.engine, "stats", None),
                                 time.perf_counter() - t0)
        self._deliver([(self._jobs[e.request_id].sink, e) for e in events if e.request_id in self._jobs])
        self._await_first_text(events)
        for e in events:
            if e.kind == "finish" and e.request_id in self._requests:
                self._retire(e.request_id)

    def _await_first_text(self, events: list[Event]) -> None:
        """Wait until the loop has sent the first commit of each request that made one in this step."""
        firsts = [self._jobs[e.request_id] for e in events if e.kind == "commit" and e.request_id in self._jobs
                  and not self._jobs[e.request_id].first_seen]
        deadline = time.perf_counter() + FIRST_TEXT_WAIT
        for job in firsts:
            job.first_seen = True
            job.first_sent.wait(max(0.0, deadline - time.perf_counter()))

    def _fail_all(self, reason: str, touch_engine: bool = True) -> None:
        """Abort every request and tell its client why ("abort": shutting down, "error": the engine failed)."""
        self._end(list(self._requests), reason, touch_engine)

    def _end(self, request_ids: list[str], reason: str, touch_engine: bool = True) -> None:
        out = []
        for rid in request_ids:
            if touch_engine:
                self.engine.abort(rid)
            out.append((self._jobs[rid].sink, Event(rid, "finish", finish_reason=reason)))
            self._retire(rid)
        self._deliver(out)

    def _expire(self) -> None:
        """End requests past their deadlines: still queued after `queue_deadline`, unfinished after `deadline`."""
        now = time.perf_counter()
        queued = [rid for rid in self._unstarted if _past(self._jobs[rid].queue_deadline, now)]
        self._end(queued, "queue_timeout")
        late = [rid for rid, job in self._jobs.items() if _past(job.deadline, now)]
        self._end(late, "deadline")

    def _tell_started(self) -> None:
        started = [rid for rid in self._unstarted if self._requests[rid].stats.t_start is not None]
        self._unstarted.difference_update(started)
        self._deliver([(self._jobs[rid].sink, Event(rid, "start")) for rid in started])

    def _retire(self, rid: str) -> None:
        req = self._requests.pop(rid)
        self._jobs.pop(rid, None)
        self._unstarted.discard(rid)
        s, d = req.stats, req.stats.to_dict(len(req.output))
        self.metrics.engine_request_done(d["queue_seconds"] if s.t_start is not None else None,
                                         list(s.steps_per_canvas),
                                         d["tokens_per_forward"] if s.decoder_passes else None)

    @staticmethod
    def _deliver(items: list[tuple[Sink, Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = defaultdict(list)
        for sink, event in items:
            by_loop[sink.loop].append((sink.queue, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _past(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


def _put_all(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, event in batch:
        q.put_nowait(event)
