"""/metrics shows a key only what it may see: with API keys, each key reads its own series (dgemma_key_*, labelled
by the key's position) and nothing about anyone else's traffic; the --metrics-key reads everything and nothing
but /metrics; a server without keys keeps one open view."""

import argparse

import httpx
import pytest

from dgemma.errors import ConfigError
from dgemma.server.config import METRICS_KEY_ENV, ServerConfig
from dgemma.server.metrics import Metrics
from server_fixtures import served_checkpoint, start_server

C = "/v1/completions"
PROMPT = [5, 6, 7, 8, 9, 10, 11]  # ids: its length is the prompt's token count


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = start_server(checkpoint, api_keys=("k1", "k2"), metrics_key="ops")
    yield s
    s.stop()


def _get(server, token: str | None, path: str = "/metrics") -> httpx.Response:
    return httpx.get(server.url + path, headers={"authorization": f"Bearer {token}"} if token else {}, timeout=10)


def _scrape(server, token: str) -> dict[str, float]:
    """{series (name and labels): value} of the view `token` gets."""
    r = _get(server, token)
    assert r.status_code == 200, r.text
    return {s: float(v) for s, v in (line.rsplit(" ", 1) for line in r.text.splitlines() if not line.startswith("#"))}


def _complete(server, token: str) -> dict:
    r = httpx.post(server.url + C, json={"prompt": PROMPT, "max_tokens": 3, "seed": 1},
                   headers={"authorization": f"Bearer {token}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_key_sees_its_own_traffic_and_nothing_of_anothers(server):
    k2_before, ops_before = _get(server, "k2").text, _scrape(server, "ops")
    assert _scrape(server, "k2")['dgemma_key_prompt_tokens_total{api_key="1"}'] == 0
    usage = _complete(server, "k1")
    assert usage["prompt_tokens"] == len(PROMPT)

    assert _get(server, "k2").text == k2_before  # not a figure moved in key 2's view
    k1 = _scrape(server, "k1")
    assert k1['dgemma_key_prompt_tokens_total{api_key="0"}'] == len(PROMPT)
    assert k1['dgemma_key_generation_tokens_total{api_key="0"}'] == usage["completion_tokens"]
    assert k1['dgemma_key_requests_total{api_key="0"}'] == 1
    assert k1['dgemma_key_requests_finished_total{api_key="0",reason="length"}'] == 1
    assert k1['dgemma_key_e2e_request_latency_seconds_count{api_key="0"}'] == 1
    for view in (k1, _scrape(server, "k2")):  # only own series and the figures that show no traffic
        others = {s for s in view if not s.startswith("dgemma_key_")}
        assert others == {"dgemma_admission_capacity", "dgemma_ready"}
    assert not any('api_key="1"' in s for s in k1) and not any('api_key="0"' in s for s in _scrape(server, "k2"))

    ops = _scrape(server, "ops")  # the operator: everyone's totals, and each key's series
    assert ops["dgemma_prompt_tokens_total"] - ops_before["dgemma_prompt_tokens_total"] == len(PROMPT)
    assert ops['dgemma_key_prompt_tokens_total{api_key="0"}'] == len(PROMPT)
    assert ops['dgemma_key_prompt_tokens_total{api_key="1"}'] == 0
    for name in ("dgemma_requests_running", "dgemma_requests_waiting", "dgemma_decoder_passes_total",
                 "dgemma_prefix_cache_lookups_total"):
        assert name in ops

    k1_before = _get(server, "k1").text  # and the other way round
    _complete(server, "k2")
    assert _get(server, "k1").text == k1_before
    assert _scrape(server, "k2")['dgemma_key_prompt_tokens_total{api_key="1"}'] == len(PROMPT)


def test_every_family_is_declared_once_in_the_operators_view(server):
    _complete(server, "k2")
    types = [line.split()[2] for line in _get(server, "ops").text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) and "dgemma_key_prompt_tokens_total" in types


def test_who_may_read_metrics(server):
    for token in (None, "wrong", "k1x", "opss"):
        r = _get(server, token)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _get(server, "ops", "/v1/models").status_code == 401  # the metrics key reads /metrics only
    r = httpx.post(server.url + C, json={"prompt": PROMPT, "max_tokens": 1}, headers={"authorization": "Bearer ops"})
    assert r.status_code == 401


def test_a_metrics_key_without_api_keys_guards_metrics_only(checkpoint):
    s = start_server(checkpoint, metrics_key="ops")
    try:
        assert httpx.post(s.url + C, json={"prompt": PROMPT, "max_tokens": 1}, timeout=60).status_code == 200
        assert _get(s, None).status_code == 401 and _get(s, "k1").status_code == 401
        assert _scrape(s, "ops")["dgemma_prompt_tokens_total"] == len(PROMPT)
    finally:
        s.stop()


def test_traffic_counts_in_the_totals_and_its_own_keys_series_only():
    m = Metrics()
    m.admitted(4)  # a server without keys: the totals only
    m.refused("overloaded", key=1)
    text = m.render({})
    assert "dgemma_prompt_tokens_total 4.0" in text
    assert 'dgemma_requests_rejected_total{reason="overloaded"} 1.0' in text
    assert 'dgemma_key_requests_rejected_total{api_key="1",reason="overloaded"} 1.0' in text
    assert 'api_key="0"' not in text and 'reason="overloaded"' not in m.render_key(0, {})
    assert 'dgemma_key_prompt_tokens_total{api_key="0"} 0.0' in m.render_key(0, {})


def test_the_metrics_key_setting(monkeypatch):
    from dgemma.server.command import add_arguments, config_from_args

    with pytest.raises(ConfigError, match="--metrics-key"):
        ServerConfig(api_keys=("k1", "ops"), metrics_key="ops")
    with pytest.raises(ConfigError, match="--metrics-key"):
        ServerConfig(metrics_key="")
    monkeypatch.setenv(METRICS_KEY_ENV, "from-env")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).metrics_key == "from-env"
    assert "from-env" not in repr(config_from_args(parser.parse_args([])))
