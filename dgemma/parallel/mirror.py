"""Serving under tensor parallelism: rank 0 runs the server, its scheduler and its engine as a `Leader`; every other
rank `follow`s. The leader sends the calls that change its engine (requests added and aborted, a step, the idle-time
tidying, a fresh engine after a failure, the end) to the followers, one broadcast per step with the calls queued
since the last one, and the followers make the same calls on their own engines, so the model's all-reduces meet and
every rank's state stays the same. A request without a seed gets one here, so the ranks draw alike; a request rank 0
refuses is never sent. An image prompt travels with its features (rank 0's vision tower ran once), placed under
rank 0's soft-token ids on every rank."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dgemma.parallel.group import Group
from dgemma.sampling import MAX_SEED

log = logging.getLogger("dgemma.parallel")


class Leader:
    """Rank 0's engine: the worker's calls, made here and sent to the followers (other attributes: the engine's)."""

    def __init__(self, engine: Any, group: Group):
        self.engine, self.group = engine, group
        self._queued: list[tuple[str, Any]] = []

    def add_request(self, prompt: list[int], params: Any, request_id: str | None = None, drafts: bool = False):
        if params.seed is None:
            params = params.replace(seed=secrets.randbelow(MAX_SEED + 1))
        req = self.engine.add_request(prompt, params, request_id=request_id, drafts=drafts)  # refused: not sent
        self._queued.append(("add", (prompt, params, req.id, drafts)))
        return req

    def abort(self, request_id: str) -> None:
        self._queued.append(("abort", request_id))
        self.engine.abort(request_id)

    def step(self):
        self._send("step")
        return self.engine.step()

    def tidy(self) -> bool:
        self._send("tidy")
        return self.engine.tidy()

    def close(self) -> None:
        self._send("stop")

    def _send(self, call: str) -> None:
        calls, self._queued = [*self._queued, (call, None)], []
        dist.broadcast_object_list([calls], src=0, group=self.group.pg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def leading(make_engine: Callable[[], Any], group: Group) -> Callable[[], Leader]:
    """The worker's engine factory on rank 0: its first engine is the followers' first; a later one (after a failed
    step) tells them to make a fresh one too."""
    made = []

    def make() -> Leader:
        leader = Leader(make_engine(), group)
        if made:
            leader._send("reset")
        made.append(True)
        return leader

    return make


def follow(make_engine: Callable[[], Any], group: Group) -> None:
    """A rank > 0 while rank 0 serves: make the leader's calls on an engine of its own until it stops."""
    engine = make_engine()
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group.pg)
        for call, arg in box[0]:
            if call == "stop":
                return
            try:
                engine = _make(engine, call, arg, make_engine)
            except Exception:  # rank 0 made the same call and handles its own failure (a fresh engine: "reset")
                log.exception("rank %d: %s failed", group.rank, call)


def _make(engine: Any, call: str, arg: Any, make_engine: Callable[[], Any]) -> Any:
    if call == "add":
        prompt, params, request_id, drafts = arg
        if getattr(prompt, "held", ()):  # an image prompt: rank 0's soft-token ids with their features
            engine.model.soft_tokens.adopt(prompt, prompt.held)
        engine.add_request(prompt, params, request_id=request_id, drafts=drafts)
    elif call == "abort":
        engine.abort(arg)
    elif call == "step":
        engine.step()
    elif call == "tidy":
        engine.tidy()
    elif call == "reset":
        return make_engine()
    return engine
