"""Tensor files written with the modes every other file gets: safetensors (and peft through it) create their files
0600, so a checkpoint written by `quantize`, `train` or `--merge-adapter` was unreadable to other users."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    readable(path)


def readable(path: str | Path) -> None:
    """A file, or every file in a folder, given the process's default mode (0666 less the umask)."""
    umask = _umask()
    path = Path(path)
    for f in (p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        os.chmod(f, 0o666 & ~umask)


def _umask() -> int:
    """The process's umask, read (Linux) rather than set and restored: setting it, even for a moment, changes the
    mode of files other threads create meanwhile."""
    try:
        return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("Umask:")), 8)
    except (OSError, StopIteration):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask
