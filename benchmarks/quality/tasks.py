"""The quality harness's tasks: short prompts whose answers are checked exactly, generated deterministically from a
seed, in two sizes (HARNESSES): short answers in a canvas of 10 and longer ones in a canvas of 32. Every answer and
its closing <end_of_turn> fit one canvas of its harness's checkpoint in the bundled tokenizer, where digits and letters
written without spaces are one token each. Sizes are chosen so that the checkpoint learns them in about an hour of
CPU (docs/performance.md, "Quality harness")."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

KEYS = "abcdefghijkmnpqrstuvwxyz"  # no l / o: they read like 1 / 0


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        """The chat form the trainer reads and the evaluation prompts with (the answer is the last turn)."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


@dataclass(frozen=True)
class Sizes:
    """A harness's sizes: its checkpoint's canvas and how long the tasks get. Every answer and its closing
    <end_of_turn> fit one canvas."""
    canvas: int
    digits: tuple[int, int]  # digit strings of copy / reverse / sort / inc (a range)
    pairs: tuple[int, int]  # recall: key-value pairs shown (a range)
    asked: int  # recall: keys asked, their values answered in order, comma-separated
    fields: int  # json: fields


# short: ~5-token answers, about two decoder passes each; long: 5-20-token answers in a canvas of 32, where the
# defaults take many steps per canvas (room for early commit and early stops)
HARNESSES = {"short": Sizes(10, (3, 7), (3, 5), 1, 1), "long": Sizes(32, (10, 20), (6, 10), 3, 3)}
SHORT = HARNESSES["short"]


def _digits(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(rng.randint(low, high)))


def copy(rng: random.Random, size: Sizes) -> tuple[str, str]:
    s = _digits(rng, *size.digits)
    return f"copy {s}", s


def reverse(rng: random.Random, size: Sizes) -> tuple[str, str]:
    s = _digits(rng, *size.digits)
    return f"reverse {s}", s[::-1]


def sort(rng: random.Random, size: Sizes) -> tuple[str, str]:
    s = _digits(rng, *size.digits)
    return f"sort {s}", "".join(sorted(s))


def increment(rng: random.Random, size: Sizes) -> tuple[str, str]:
    """Digit arithmetic without carries: each digit plus one, modulo 10."""
    s = _digits(rng, *size.digits)
    return f"inc {s}", "".join(str((int(d) + 1) % 10) for d in s)


def recall(rng: random.Random, size: Sizes) -> tuple[str, str]:
    """Key-value recall: one-letter keys with one-digit values, then the keys asked for. Written without spaces
    (`b=6,a=6,m=8?a`) so that a key is the same token in its pair and after `?`."""
    keys = rng.sample(KEYS, rng.randint(*size.pairs))
    values = {k: rng.choice(string.digits) for k in keys}
    pairs = ",".join(f"{k}={v}" for k, v in values.items())
    asked = rng.sample(keys, size.asked)
    return f"{pairs}?{','.join(asked)}", ",".join(values[k] for k in asked)


def to_json(rng: random.Random, size: Sizes) -> tuple[str, str]:
    """A JSON object with the given fields, compact, in the order given."""
    keys = rng.sample(KEYS, size.fields)
    values = {k: rng.randint(0, 99) for k in keys}
    fields = ",".join(f"{k}={v}" for k, v in values.items())
    return f"json {fields}", json.dumps(values, separators=(",", ":"))


TASKS = {"copy": copy, "reverse": reverse, "sort": sort, "inc": increment, "recall": recall, "json": to_json}


TRAIN_SEED, VALID_SEED, EVAL_SEED = 0, 1, 2  # train.py's data and evaluate.py's examples
TRAIN_EXAMPLES = 20_000  # train.py's default training set
IDLE_ROUNDS = 50  # held_out gives up after this many seeds in a row bring no new prompt
HARNESS_FILE = "harness.json"  # in a harness checkpoint: which harness it learned, from how many examples


def examples(n: int, seed: int, tasks: tuple[str, ...] = tuple(TASKS), size: Sizes = SHORT) -> list[Example]:
    """n examples cycling through `tasks`; the same (n, seed, tasks, size) always gives the same list."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        prompt, answer = TASKS[task](rng, size)
        out.append(Example(task, prompt, answer))
    return out


def held_out(n: int, seed: int, train: set[str], tasks: tuple[str, ...] = tuple(TASKS),
             size: Sizes = SHORT) -> list[Example]:
    """n examples with distinct prompts, none of them in `train` (a held-out set never repeats a training prompt)."""
    out, seen, offset, idle = [], set(train), 0, 0
    while len(out) < n:
        found = len(out)
        for e in examples(n, seed + offset, tasks, size):
            if e.prompt not in seen and len(out) < n:
                out.append(e)
                seen.add(e.prompt)
        offset += 1
        idle = 0 if len(out) > found else idle + 1
        if idle == IDLE_ROUNDS:  # the training set holds (nearly) every prompt these tasks can make
            raise ValueError(f"only {len(out)} held-out prompts of {', '.join(tasks)} found outside the training "
                             f"set, {n} asked")
    return out


def evaluation_set(per_task: int, names: tuple[str, ...], n_train: int = TRAIN_EXAMPLES,
                   size: Sizes = SHORT, trained: tuple[str, ...] = tuple(TASKS)) -> list[Example]:
    """per_task examples of each task from EVAL_SEED, none of them a prompt of the first n_train training examples
    (of the `trained` tasks: so the harness scores answers, not memory), interleaved task by task."""
    train = {e.prompt for e in examples(n_train, TRAIN_SEED, trained, size)}
    per = [held_out(per_task, EVAL_SEED, train, (t,), size) for t in names]
    return [e for group in zip(*per) for e in group]


class Learned(NamedTuple):
    """What a harness checkpoint learned: its harness, how many training examples, of which tasks."""
    harness: str
    train_examples: int
    tasks: tuple[str, ...]


def write_harness(model_dir: Path, name: str, n_train: int, names: tuple[str, ...] = tuple(TASKS)) -> None:
    """Record in a checkpoint which harness it learned, from how many training examples of which tasks."""
    record = {"harness": name, "train_examples": n_train, "tasks": list(names)}
    (model_dir / HARNESS_FILE).write_text(json.dumps(record) + "\n")


def read_harness(model_dir: Path) -> Learned:
    """What a checkpoint learned; one without the record learned the short harness (records from before the task
    list: every task)."""
    path = Path(model_dir) / HARNESS_FILE
    if not path.is_file():
        return Learned("short", TRAIN_EXAMPLES, tuple(TASKS))
    record = json.loads(path.read_text())
    return Learned(record["harness"], record["train_examples"], tuple(record.get("tasks", TASKS)))


def parse_tasks(text: str) -> tuple[str, ...]:
    """A comma-separated task list; ValueError naming the unknown ones."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if unknown := [t for t in names if t not in TASKS]:
        raise ValueError(f"unknown task(s) {', '.join(unknown)} (known: {', '.join(TASKS)})")
    if not names:
        raise ValueError(f"no task given (known: {', '.join(TASKS)})")
    return names


def is_correct(example: Example, output: str) -> bool:
    """Exact match of the whole answer (surrounding whitespace aside)."""
    return output.strip() == example.answer


def write_jsonl(path: Path, rows: list[Example]) -> None:
    """The trainer's chat format: one {"messages": [...]} object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": e.messages()}) + "\n" for e in rows))
