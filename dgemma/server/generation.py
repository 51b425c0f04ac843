"""One admitted HTTP request in the engine: `Generation` submits its Plans to the worker and turns its engine
events into text deltas, drafts, tool calls, finish reasons and Results (through `OutputStream`, as the Python API
does), the errors of choices that did not end normally, and each choice's latencies in the metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dgemma.chat.turn import ChatTurn
from dgemma.engine import Event, OutputStream, Result, StreamEvent
from dgemma.server.errors import ApiError
from dgemma.server.planning import Plan
from dgemma.server.worker import Sink, Submission

if TYPE_CHECKING:
    from dgemma.server.service import Lease, Service


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
    call it when the response ends for any reason). `timeout`: seconds from arrival to the request's deadline
    (dgemma_timeout within --request-timeout; None: none)."""

    def __init__(self, service: Service, id: str, plans: list[Plan], prompt_tokens: int, drafts: bool,
                 lease: Lease, t_arrival: float, timeout: float | None = None, turn: ChatTurn | None = None,
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
        self.timeout = timeout
        deadlines = [t_arrival + t if t is not None else None for t in (service.config.max_queue_seconds,
                                                                           self.timeout)]
        jobs = []
        for i, plan in enumerate(plans):
            rid = f"{id}-{i}"
            output = OutputStream(service.model.tokenizer, plan.params.stop, turn)
            self.choices[rid] = _Choice(i, rid, output, plan.params.logprobs is not None)
            jobs.append(Submission(rid, plan.ids, plan.params, drafts, sink, self.t_arrival, *deadlines,
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
