"""Fetch by name: a repo id not in the local cache is downloaded through huggingface_hub from a local stand-in for
the hub (`hub_server.py`, reached through HF_ENDPOINT). Each fetch runs in a fresh process, because
huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported, as users set them."""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import Hub, checkpoint_files, serve_hub
from server_fixtures import build_served_checkpoint

FETCH = """
import sys
from dgemma.errors import DgemmaError
from dgemma.weights import resolve_checkpoint
for target in sys.argv[1:]:
    repo, _, revision = target.partition("@")
    try:
        print("ok", resolve_checkpoint(repo, revision or None), flush=True)
    except DgemmaError as e:
        print("error", e, flush=True)
"""
EXTRAS = {"README.md": b"# tiny\n", ".gitattributes": b"*.safetensors filter=lfs\n", "pytorch_model.bin": b"x" * 64,
          "original/model.safetensors": b"y" * 64, "onnx/model.onnx": b"z" * 64}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_served_checkpoint(tmp_path_factory.mktemp("hub_src") / "ckpt")


def _env(hub: Hub, home: Path, **extra: str) -> dict[str, str]:
    """A clean hub environment: no proxy, no token, no offline switch from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("HF_", "HUGGING", "TRANSFORMERS_"))
           and not k.lower().endswith("_proxy")}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": hub.url, **extra}


def fetch(hub: Hub, home: Path, *targets: str, **env: str) -> list[str]:
    """resolve_checkpoint of each "repo[@revision]" in one process: "ok PATH" or "error MESSAGE" lines."""
    r = subprocess.run([sys.executable, "-c", FETCH, *targets], env=_env(hub, home, **env), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(targets), (r.stdout, r.stderr)
    return lines


def _path(line: str) -> Path:
    assert line.startswith("ok "), line
    return Path(line[3:])


def _commit(revision: str) -> str:
    return hashlib.sha1(revision.encode()).hexdigest()


def test_download_by_repo_id_loads_like_the_directory(ckpt, tmp_path):
    import dgemma

    files = checkpoint_files(ckpt)
    v1 = {**files, "generation_config.json": b'{"max_new_tokens": 3, "eos_token_id": []}'}
    with serve_hub(Hub()) as hub:
        hub.add("acme/tiny", {**files, **EXTRAS}, v1=v1)
        main, tagged = fetch(hub, tmp_path, "acme/tiny", "acme/tiny@v1")
        # nothing outside the checkpoint's files; v1 shares the blobs of main but one
        assert sorted(hub.resolved("GET")) == sorted([*files, "generation_config.json"])
        n = len(hub.requests)
        # cached: resolved without asking the hub, online or offline
        assert fetch(hub, tmp_path, "acme/tiny", "acme/tiny@v1", HF_HUB_OFFLINE="1") == [main, tagged]
        assert fetch(hub, tmp_path, "acme/tiny") == [main]
        assert len(hub.requests) == n

    directory = _path(main)
    assert directory == tmp_path / "hub" / "models--acme--tiny" / "snapshots" / _commit("main")
    assert sorted(p.name for p in directory.iterdir()) == sorted(files)
    assert all((directory / name).read_bytes() == data for name, data in files.items())
    assert (_path(tagged) / "generation_config.json").read_bytes() == v1["generation_config.json"]
    a = dgemma.load(directory).generate([5, 6, 7], max_new_tokens=6, seed=0)
    b = dgemma.load(ckpt).generate([5, 6, 7], max_new_tokens=6, seed=0)
    assert a.token_ids == b.token_ids


def test_revision_is_a_model_option():
    from dgemma.options import add_model_options

    p = argparse.ArgumentParser()
    add_model_options(p)
    assert p.parse_args(["--model", "acme/tiny", "--revision", "v1"]).revision == "v1"
    assert p.parse_args([]).revision is None


def test_revision_of_a_directory_is_refused(ckpt):
    from dgemma.errors import CheckpointError
    from dgemma.weights import resolve_checkpoint

    with pytest.raises(CheckpointError, match="applies to a Hugging Face repo id only"):
        resolve_checkpoint(ckpt, revision="v1")


def test_interrupted_file_resumes_with_a_range_request(tmp_path):
    """The client keeps what it received in whole 10 MiB chunks (huggingface_hub's DOWNLOAD_CHUNK_SIZE) and asks
    for the rest with a Range request: a file over that size, cut after 11 MiB."""
    weights = os.urandom(12 << 20)
    with serve_hub(Hub(drop_after={"model.safetensors": 11 << 20})) as hub:
        hub.add("acme/big", {"config.json": b"{}", "model.safetensors": weights})
        (line,) = fetch(hub, tmp_path, "acme/big")
    ranges = [r.headers.get("Range") for r in hub.requests if r.method == "GET" and r.path.endswith(".safetensors")]
    assert ranges == [None, f"bytes={10 << 20}-"]
    assert (_path(line) / "model.safetensors").read_bytes() == weights


def test_failed_download_continues_on_the_next_call(ckpt, tmp_path):
    files = checkpoint_files(ckpt)
    with serve_hub(Hub(fail_once={"model.safetensors"})) as hub:
        hub.add("acme/tiny", files)
        (first,) = fetch(hub, tmp_path, "acme/tiny")
        assert first.startswith("error acme/tiny: download from") and "HTTP 500" in first and "run again" in first
        fetched = hub.resolved("GET")
        n = len(hub.requests)
        (second,) = fetch(hub, tmp_path, "acme/tiny")
        again = hub.resolved("GET")[len(fetched):]
    assert set(fetched) == set(files)  # every file was asked for; all but the weights arrived
    assert again == ["model.safetensors"], hub.requests[n:]  # the files already cached are not fetched again
    assert (_path(second) / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_gated_repo(ckpt, tmp_path):
    files = checkpoint_files(ckpt)
    with serve_hub(Hub()) as hub:
        hub.add("acme/gated", files, token="hf_secret")
        r = subprocess.run([sys.executable, "-m", "dgemma", "info", "--model", "acme/gated"], capture_output=True,
                           text=True, env=_env(hub, tmp_path / "a", HF_HUB_DISABLE_PROGRESS_BARS="1"), timeout=120)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert r.stderr.strip().count("\n") == 0, r.stderr
        assert "acme/gated: gated repository (HTTP 401)" in r.stderr
        assert f"accept its terms at {hub.url}/acme/gated, then set HF_TOKEN or run `hf auth login`" in r.stderr
        (wrong,) = fetch(hub, tmp_path / "b", "acme/gated", HF_TOKEN="hf_wrong")
        assert wrong.startswith("error acme/gated: gated repository, and the token given has no access")
        n = len(hub.requests)
        (line,) = fetch(hub, tmp_path / "c", "acme/gated", HF_TOKEN="hf_secret")
    resolves = [r for r in hub.requests[n:] if "/resolve/" in r.path]
    assert resolves and all(r.headers.get("Authorization") == "Bearer hf_secret" for r in resolves)
    assert sorted(p.name for p in _path(line).iterdir()) == sorted(files)


def test_offline_without_a_cached_copy_makes_no_request(tmp_path):
    with serve_hub(Hub()) as hub:
        hub.add("acme/tiny", {"config.json": b"{}"})
        (line,) = fetch(hub, tmp_path, "acme/tiny", HF_HUB_OFFLINE="1")
    assert hub.requests == []
    assert line.startswith("error acme/tiny: no such directory, and not in the local Hugging Face cache")
    assert line.endswith("HF_HUB_OFFLINE is set, so it is not downloaded")


def test_missing_repo_revision_and_unreachable_hub(tmp_path):
    with serve_hub(Hub()) as hub:
        hub.add("acme/tiny", {"config.json": b"{}"})
        missing, revision = fetch(hub, tmp_path, "acme/absent", "acme/tiny@nope")
    assert missing == (f"error acme/absent: no such directory, and no such model repository on {hub.url} (or it is "
                       "private: set HF_TOKEN or run `hf auth login`)")
    assert revision == f"error acme/tiny (revision nope): the repository has no revision 'nope' on {hub.url}"
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        hub.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        (unreachable,) = fetch(hub, tmp_path, "acme/tiny")
    assert unreachable.startswith(f"error acme/tiny: not in the local Hugging Face cache, and {hub.url} cannot be "
                                  "reached (ConnectError")


def test_a_revision_needs_a_repo_id():
    """--revision with the demo model or a local directory is one error, not silently ignored."""
    import dgemma
    from dgemma.api import DEMO_MODEL
    from dgemma.errors import DgemmaError

    for where in (None, DEMO_MODEL):
        with pytest.raises(DgemmaError, match="revision applies to a Hugging Face repo id"):
            dgemma.load(where, revision="v1")
