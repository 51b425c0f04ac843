"""Hugging Face Hub: a repo id -> a local snapshot directory, from the cache or downloaded through `huggingface_hub`
(its cache, progress bar and retries; `HF_HOME`, `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` as it reads them).
Only the files the loaders read are fetched, and every failure is one `CheckpointError` line."""

from __future__ import annotations

import json
from pathlib import Path

from dgemma.errors import CheckpointError

# What dgemma reads from a checkpoint directory (weights/hf.py, prequantized.py, tokenizer.py, api/) and what
# `dgemma train` copies next to its output; top-level files only (IGNORED): no `original/` or `onnx/` variants.
CHECKPOINT_FILES = [
    "config.json", "generation_config.json", "hf_quant_config.json",
    "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
]
IGNORED = ["*/*"]
LOGIN = "set HF_TOKEN or run `hf auth login`"


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The checkpoint files of `repo_id` at `revision` (default: the main branch): the cached snapshot when it is
    complete, without asking the hub; else downloaded. A transfer cut mid-file resumes with a Range request
    within the call; after a failed call the next one fetches only the files still missing."""
    cached = _cached(repo_id, revision)
    if cached is not None:
        return cached
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(f"{_name(repo_id, revision)}: no such directory, and not in the local Hugging Face "
                              f"cache ({constants.HF_HUB_CACHE}); HF_HUB_OFFLINE is set, so it is not downloaded")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES,
                                      ignore_patterns=IGNORED))
    except Exception as e:  # the hub's and the HTTP client's errors, told apart in `_error`
        error = _error(e, repo_id, revision)
        if error is None:
            raise
        raise error from None


def _cached(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES,
                                      ignore_patterns=IGNORED, local_files_only=True))
    except LocalEntryNotFoundError:  # also a snapshot the hub's own listing knows to be incomplete
        return None
    except HFValidationError as e:
        raise CheckpointError(f"{repo_id}: no such directory, and not a Hugging Face repo id ({_line(e)})") from None
    return path if _complete(path) else None


def _complete(directory: Path) -> bool:
    """config.json and every weight file: a snapshot cut short (or filled by another tool) is fetched again."""
    index = directory / "model.safetensors.index.json"
    if not (directory / "config.json").is_file():
        return False
    if not index.is_file():
        return (directory / "model.safetensors").is_file()
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return all((directory / shard).is_file() for shard in shards)


def _name(repo_id: str, revision: str | None) -> str:
    return f"{repo_id} (revision {revision})" if revision else repo_id


def _error(e: Exception, repo_id: str, revision: str | None) -> CheckpointError | None:
    """The hub's or the network's exception as one line that says what to do; None for any other."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    hub, where = constants.ENDPOINT, _name(repo_id, revision)
    token = get_token() is not None
    if isinstance(e, GatedRepoError):
        if token:
            return CheckpointError(f"{where}: gated repository, and the token given has no access to it: accept "
                                   f"its terms at {hub}/{repo_id} with that account")
        return CheckpointError(f"{where}: gated repository (HTTP {_status(e)}): accept its terms at "
                               f"{hub}/{repo_id}, then {LOGIN}")
    if isinstance(e, RepositoryNotFoundError):
        access = "or the token given has no access to it" if token else f"or it is private: {LOGIN}"
        return CheckpointError(f"{where}: no such directory, and no such model repository on {hub} ({access})")
    if isinstance(e, RevisionNotFoundError):
        return CheckpointError(f"{where}: the repository has no revision {revision!r} on {hub}")
    if isinstance(e, HfHubHTTPError) and _status(e) in (401, 403):
        return CheckpointError(f"{where}: access refused by {hub} (HTTP {_status(e)}): {LOGIN}")
    if isinstance(e, HfHubHTTPError):
        return CheckpointError(f"{where}: download from {hub} failed (HTTP {_status(e)}); run again to continue")
    if isinstance(e, LocalEntryNotFoundError):  # the hub could not be reached, and the cache has no copy
        cause = f" ({_line(e.__cause__)})" if e.__cause__ is not None else ""
        return CheckpointError(f"{where}: not in the local Hugging Face cache, and {hub} cannot be reached{cause}")
    if isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
        return CheckpointError(f"{where}: download from {hub} failed ({_line(e)}); run again to continue")
    return None


def _status(e) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _line(e: BaseException) -> str:
    """The first line of an exception's message (the hub's run over several), with its type."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
