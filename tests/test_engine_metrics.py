"""/metrics reports the diffusion engine's decoder passes, rows per pass and rows already done (with the time
spent on them): per-step shares of the engine's cumulative counts, a fresh engine starting again from zero."""

import httpx

from dgemma.engine.engine import EngineStats
from dgemma.server.metrics import Metrics
from server_fixtures import served_checkpoint, start_server


def _values(text: str) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("dgemma_d") and "{" not in line}


def test_step_shares_of_the_engine_counts():
    m = Metrics()
    m.engine_step(4, EngineStats(passes=1, rows=4, done_rows=1), 2.0)  # a quarter of 2 s on a done row
    m.engine_step(4, EngineStats(passes=2, rows=8, done_rows=1), 1.0)  # none done this step
    m.engine_step(2, EngineStats(passes=1, rows=2, done_rows=2), 3.0)  # a fresh engine (after a failure)
    m.engine_step(0, None, 1.0)  # an engine without pass counts (autoregressive)
    v = _values(m.render({}))
    assert (v["dgemma_decoder_passes_total"], v["dgemma_decoder_rows_total"], v["dgemma_done_rows_total"]) == \
        (3.0, 10.0, 3.0)
    assert v["dgemma_done_rows_seconds_total"] == 0.5 + 3.0


def test_a_served_request_counts_passes_and_no_done_rows(tmp_path_factory):
    server = start_server(served_checkpoint(tmp_path_factory))
    try:
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 6}, timeout=60)
            assert r.status_code == 200, r.text
        v = _values(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        server.stop()
    assert v["dgemma_decoder_passes_total"] >= 2 and v["dgemma_decoder_rows_total"] >= v["dgemma_decoder_passes_total"]
    assert v["dgemma_done_rows_total"] == 0 and v["dgemma_done_rows_seconds_total"] == 0
