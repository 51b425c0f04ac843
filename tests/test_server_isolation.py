"""What one client can learn about another: the prefix cache is partitioned per API key and per `cache_salt`, so
a second key's guess of another key's prompt is never a hit (not in its speed, not in /metrics); and text in a
message stays text, even when it spells a control token."""

import re

import httpx
import pytest

from server_fixtures import build_served_checkpoint, served_checkpoint, start_server

C = "/v1/completions"
SECRET = "The secret code is 4 7 1 9 and nobody else may know it. " * 3


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory), api_keys=("alice", "bob"), metrics_key="ops")
    yield s
    s.stop()


def _reused(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer ops"}).text  # the operator
    return float(re.search(r"^dgemma_prefix_cache_tokens_reused_total (\S+)$", text, re.M).group(1))


def _complete(server, key, prompt, **extra):
    r = httpx.post(server.url + C, json={"prompt": prompt, "max_tokens": 2, "seed": 1, **extra},
                   headers={"authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_key_never_hits_another_keys_prompts(keyed):
    _complete(keyed, "alice", SECRET + "Answer:")
    before = _reused(keyed)
    _complete(keyed, "bob", SECRET + "Answer: and more")  # bob guesses alice's whole prompt
    assert _reused(keyed) == before
    _complete(keyed, "alice", SECRET + "Answer: and more")  # alice's own next request continues from her prompt
    assert _reused(keyed) > before


def test_cache_salt_partitions_within_a_key(keyed):
    _complete(keyed, "alice", "Salted " + SECRET, cache_salt="tenant-1")
    before = _reused(keyed)
    _complete(keyed, "alice", "Salted " + SECRET + " x", cache_salt="tenant-2")
    _complete(keyed, "alice", "Salted " + SECRET + " x")
    assert _reused(keyed) == before
    _complete(keyed, "alice", "Salted " + SECRET + " x", cache_salt="tenant-1")
    assert _reused(keyed) > before
