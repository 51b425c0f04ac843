"""The quality harness's tasks: short prompts whose answers are checked exactly, generated deterministically from a
seed. Every answer and its closing <end_of_turn> fit one canvas of the harness checkpoint (10 positions) in the
bundled tokenizer, where digits and letters written without spaces are one token each. Sizes are chosen so that the
checkpoint learns them in a few tens of CPU-minutes (docs/performance.md, "Quality harness")."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

KEYS = "abcdefghijkmnpqrstuvwxyz"  # no l / o: they read like 1 / 0


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        """The chat form the trainer reads and the evaluation prompts with (the answer is the last turn)."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def _digits(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(rng.randint(low, high)))


def copy(rng: random.Random) -> tuple[str, str]:
    s = _digits(rng, 3, 7)
    return f"copy {s}", s


def reverse(rng: random.Random) -> tuple[str, str]:
    s = _digits(rng, 3, 7)
    return f"reverse {s}", s[::-1]


def sort(rng: random.Random) -> tuple[str, str]:
    s = _digits(rng, 3, 7)
    return f"sort {s}", "".join(sorted(s))


def increment(rng: random.Random) -> tuple[str, str]:
    """Digit arithmetic without carries: each digit plus one, modulo 10."""
    s = _digits(rng, 3, 7)
    return f"inc {s}", "".join(str((int(d) + 1) % 10) for d in s)


def recall(rng: random.Random) -> tuple[str, str]:
    """Key-value recall: 3-5 one-letter keys with one-digit values, then the key asked for. Written without spaces
    (`b=6,a=6,m=8?a`) so that a key is the same token in its pair and after `?`."""
    keys = rng.sample(KEYS, rng.randint(3, 5))
    values = {k: rng.choice(string.digits) for k in keys}
    pairs = ",".join(f"{k}={v}" for k, v in values.items())
    key = rng.choice(keys)
    return f"{pairs}?{key}", values[key]


def to_json(rng: random.Random) -> tuple[str, str]:
    """A JSON object with the given field, compact."""
    keys = rng.sample(KEYS, 1)
    values = {k: rng.randint(0, 99) for k in keys}
    fields = " ".join(f"{k}={v}" for k, v in values.items())
    return f"json {fields}", json.dumps(values, separators=(",", ":"))


TASKS = {"copy": copy, "reverse": reverse, "sort": sort, "inc": increment, "recall": recall, "json": to_json}


TRAIN_SEED, VALID_SEED, EVAL_SEED = 0, 1, 2  # train.py's data and evaluate.py's examples
TRAIN_EXAMPLES = 20_000  # train.py's default training set


def examples(n: int, seed: int, tasks: tuple[str, ...] = tuple(TASKS)) -> list[Example]:
    """n examples cycling through `tasks`; the same (n, seed, tasks) always gives the same list."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        prompt, answer = TASKS[task](rng)
        out.append(Example(task, prompt, answer))
    return out


def held_out(n: int, seed: int, train: set[str], tasks: tuple[str, ...] = tuple(TASKS)) -> list[Example]:
    """n examples with distinct prompts, none of them in `train` (a held-out set never repeats a training prompt)."""
    out, seen, offset = [], set(train), 0
    while len(out) < n:
        for e in examples(n, seed + offset, tasks):
            if e.prompt not in seen and len(out) < n:
                out.append(e)
                seen.add(e.prompt)
        offset += 1
    return out


def evaluation_set(per_task: int, names: tuple[str, ...], n_train: int = TRAIN_EXAMPLES) -> list[Example]:
    """per_task examples of each task from EVAL_SEED, none of them a prompt of the first n_train training examples
    (so the harness scores answers, not memory), interleaved task by task."""
    train = {e.prompt for e in examples(n_train, TRAIN_SEED)}
    per = [held_out(per_task, EVAL_SEED, train, (t,)) for t in names]
    return [e for group in zip(*per) for e in group]


def is_correct(example: Example, output: str) -> bool:
    """Exact match of the whole answer (surrounding whitespace aside)."""
    return output.strip() == example.answer


def write_jsonl(path: Path, rows: list[Example]) -> None:
    """The trainer's chat format: one {"messages": [...]} object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": e.messages()}) + "\n" for e in rows))
