"""The engine thread (server/worker.py) hands a request's first text to the event loop before it takes the cores
for its next step: the step after a first commit starts only once the loop has handled it, and a loop that never
does holds the engine back FIRST_TEXT_WAIT at most. The work that waits for idle time (`tidy`) runs only once the
engine has had nothing to do for IDLE_POLL."""

import asyncio
import time

from dgemma.engine import Event, Request
from dgemma.sampling import SamplingParams
from dgemma.server.metrics import Metrics
from dgemma.server.worker import FIRST_TEXT_WAIT, IDLE_POLL, Submission, Sink, Worker


class StubEngine:
    """Each request: one id at its first step, one more and the end at its second; `log` records, per step,
    whether the request's first commit had been handled (its job's flag) when the step began."""

    def __init__(self, pieces: int = 1):
        self.waiting, self.rows, self.log, self.num_running = [], [], [], 0
        self.jobs, self.tidied, self.order = {}, [], []
        self.pieces, self.on_piece = pieces, {}  # idle-time work left; piece number -> what happens during it

    def tidy(self):
        if self.pieces:
            self.pieces -= 1
            self.tidied.append(time.perf_counter())
            self.order.append("tidy")
            self.on_piece.pop(len(self.tidied), lambda: None)()
        return self.pieces > 0

    def add_request(self, prompt, params, request_id, drafts):
        req = Request(request_id, prompt, params, eos=())
        self.waiting.append(req)
        return req

    def has_work(self):
        return bool(self.waiting or self.rows)

    def abort(self, request_id):
        pass

    def step(self):
        self.order.append("step")
        events = []
        for req in self.rows:
            self.log.append((time.perf_counter(), self.jobs[req.id].first_sent.is_set()))
            req.output.append(6)
            events += [Event(req.id, "commit", [6])]
            req.finish("stop", events)
        self.rows = [r for r in self.rows if not r.finished]
        for req in self.waiting:
            req.stats.t_start = time.perf_counter()
            req.output.append(5)
            events.append(Event(req.id, "commit", [5]))
            self.log.append((time.perf_counter(), None))
        self.rows, self.waiting = self.rows + self.waiting, []
        return events


def _serve(handle_first: bool, engine: StubEngine | None = None, requests: int = 1, pause: float = 0.0) -> list:
    """Requests one after another through a Worker on a stub engine, then `pause` seconds; the loop handles their
    first commits (or never does)."""
    engine = engine or StubEngine()
    worker = Worker(lambda: engine, Metrics())
    worker.start()

    async def one(rid: str):
        queue = asyncio.Queue()
        job = Submission(rid, [1, 2], SamplingParams(), False, Sink(asyncio.get_running_loop(), queue),
                         time.perf_counter())
        engine.jobs[rid] = job
        worker.submit([job])
        while True:
            event = await queue.get()
            if event.kind == "commit" and event.token_ids == [5] and handle_first:
                await asyncio.sleep(0.002)  # sending it
                job.first_sent.set()
            if event.kind == "finish":
                return

    async def main():
        for i in range(requests):
            await one(f"r{i}")
        await asyncio.sleep(pause)

    try:
        asyncio.run(main())
    finally:
        worker.stop()
    return engine.log


def test_the_step_after_a_first_commit_waits_for_the_loop_to_send_it():
    log = _serve(handle_first=True)
    assert [handled for _, handled in log] == [None, True]


def test_a_loop_that_never_sends_it_holds_the_engine_back_a_bounded_time():
    (t1, _), (t2, handled) = _serve(handle_first=False)
    assert handled is False and FIRST_TEXT_WAIT <= t2 - t1 < FIRST_TEXT_WAIT + 0.5


def test_idle_work_waits_until_nothing_came_for_idle_poll():
    """Two requests back to back, then a pause: no tidy between them (the second was not kept waiting), one after
    the pause, at least IDLE_POLL after the last step."""
    engine = StubEngine()
    log = _serve(True, engine, requests=2, pause=3 * IDLE_POLL)
    last_step = log[-1][0]
    assert len(log) == 4 and engine.tidied and all(t >= last_step + IDLE_POLL for t in engine.tidied)


def test_idle_work_runs_a_piece_at_a_time_and_a_request_waits_for_one_piece_at_most():
    """4 pieces of idle-time work; a request arrives during the second: its steps come right after that piece,
    the other two pieces once the engine has been idle for IDLE_POLL again."""
    engine = StubEngine(pieces=4)
    worker = Worker(lambda: engine, Metrics())

    async def main():
        queue = asyncio.Queue()
        job = Submission("r", [1, 2], SamplingParams(), False, Sink(asyncio.get_running_loop(), queue),
                         time.perf_counter())
        job.first_sent.set()
        engine.jobs["r"] = job
        engine.on_piece[2] = lambda: worker.submit([job])
        worker.start()
        while (await queue.get()).kind != "finish":
            pass
        await asyncio.sleep(3 * IDLE_POLL)

    try:
        asyncio.run(main())
    finally:
        worker.stop()
    assert engine.order == ["tidy", "tidy", "step", "step", "tidy", "tidy"]
    assert engine.tidied[2] >= engine.log[-1][0] + IDLE_POLL
