"""The one reader of a checkpoint's (or a run's) JSON object files: one-line errors for broken ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dgemma.errors import CheckpointError


def read_json(path: Path, required: bool = False) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file is absent, unless `required` (then an error)."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.parent}: missing {path.name}")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
