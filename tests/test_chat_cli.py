"""`dgemma chat` on the bundled model: each input line is a user turn of one conversation, answered as
`Model.generate` answers that conversation without a prefix cache (float32, seed + i for turn i); later turns
continue from the cached earlier ones; /reset, /exit, and Ctrl-C during an answer."""

import io
import re

import pytest

import dgemma
from dgemma.cli import main


@pytest.fixture(scope="module")
def demo():
    return dgemma.load(dtype="float32")


def _chat(monkeypatch, capsys, lines: str, *flags: str) -> tuple[str, list[str]]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--dtype", "float32", "--seed", "1", "--max-new-tokens", "24", *flags]) == 0
    out = capsys.readouterr()
    return out.out, out.err.strip().splitlines()


def test_each_line_is_a_turn_of_one_conversation_and_later_turns_reuse_the_cache(demo, monkeypatch, capsys):
    out, stats = _chat(monkeypatch, capsys, "Hello there\n\nWhat is your name?\n/reset\nCount to three\n")
    first = [{"role": "user", "content": "Hello there"}]
    a1 = demo.generate(first, seed=1, max_new_tokens=24).text
    second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "What is your name?"}]
    a2 = demo.generate(second, seed=2, max_new_tokens=24).text
    a3 = demo.generate([{"role": "user", "content": "Count to three"}], seed=3, max_new_tokens=24).text
    assert out == f"{a1}\n{a2}\n{a3}\n"
    cached = [int(m.group(1)) if (m := re.search(r"(\d+) prompt tokens from the prefix cache", s)) else 0
              for s in stats]
    assert len(stats) == 3 and cached[0] == 0
    assert cached[1] > len(demo.encode_prompt(first))  # the first turn's prompt and part of its answer at least
    assert cached[2] < len(demo.encode_prompt([{"role": "user", "content": "Count to three"}]))


def test_exit_ends_the_chat_and_no_cache_is_kept_with_zero_mib(monkeypatch, capsys):
    out, stats = _chat(monkeypatch, capsys, "Hello there\nAgain\n/exit\nNever answered\n", "--prefix-cache-mb", "0")
    assert len(stats) == 2 and not any("prefix cache" in s for s in stats)


def test_diffusion_options_are_refused_in_another_mode(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--mode", "autoregressive", "--steps", "4"]) == 2
    assert "--steps applies to diffusion decoding" in capsys.readouterr().err


def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on_without_that_turn(demo, monkeypatch, capsys):
    import dgemma.display

    real, calls = dgemma.display.print_stream, []

    def interrupted_once(events, **kw):
        calls.append(1)
        if len(calls) == 1:
            next(iter(events))  # the answer has begun
            raise KeyboardInterrupt
        return real(events, **kw)

    monkeypatch.setattr(dgemma.display, "print_stream", interrupted_once)
    out, stats = _chat(monkeypatch, capsys, "Hello there\nWhat is your name?\n")
    second = [{"role": "user", "content": "What is your name?"}]
    assert out == demo.generate(second, seed=2, max_new_tokens=24).text + "\n"
    assert len(stats) == 2 and stats[0] == "[stopped]" and "tokens" in stats[1]


def test_a_checkpoint_without_a_tokenizer_is_refused_before_reading(tmp_path, monkeypatch, capsys):
    from reference import build_reference

    build_reference("a", tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("never read\n"))
    assert main(["chat", "--model", str(tmp_path)]) == 2
    assert "needs a checkpoint with a tokenizer" in capsys.readouterr().err
