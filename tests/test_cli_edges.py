"""A first hour without surprises (issue 43): `dgemma --version`, a prompt from standard input (`-`), and
`dgemma info` saying whether a checkpoint has a vision tower."""

import io
import json

import pytest

from dgemma.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("dgemma ")


def test_a_prompt_from_standard_input_is_the_same_prompt(capsys, monkeypatch):
    args = ["--max-new-tokens", "6", "--seed", "2", "--json"]
    assert main(["generate", "Once upon a time", *args]) == 0
    direct = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time\n"))  # a pipe's trailing newline is not prompt
    assert main(["generate", "-", *args]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["token_ids"] == direct["token_ids"] and piped["prompt_tokens"] == direct["prompt_tokens"]


def test_info_names_the_vision_tower(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vision_tower"].endswith("in 1 layer(s)") and int(info["vision_tower"].split()[0].replace(",", "")) > 0


def test_written_weights_are_readable_like_every_other_file(tmp_path):
    """safetensors writes 0600; a checkpoint dgemma writes gets the process's default mode (0666 less the umask)."""
    import os

    import dgemma
    from dgemma.weights import save_model

    umask = os.umask(0o022)
    try:
        out = save_model(dgemma.load(dtype="float32").module, tmp_path / "ckpt")
        assert main(["quantize", "--to", "int8", "--out", str(tmp_path / "q")]) == 0
    finally:
        os.umask(umask)
    for f in [out / "model.safetensors", *(tmp_path / "q").glob("*.safetensors")]:
        assert oct(os.stat(f).st_mode & 0o777) == oct(0o644), f


@pytest.mark.parametrize("command", [["info"], ["generate", "x"], ["chat"], ["serve"], ["bench"], ["train"],
                                     ["quantize", "--to", "int8", "--out", "o"]])
def test_every_command_that_runs_the_model_takes_threads(command):
    from dgemma.cli import build_parser

    argv = [*command, "--threads", "3"]
    assert build_parser(argv).parse_args(argv).threads == 3


def test_threads_reach_the_trainer_and_quantize(tmp_path):
    import torch

    from dgemma.cli import build_parser
    from dgemma.train.command import _config_values

    argv = ["train", "--config", "configs/demo.json", "--threads", "1"]
    assert _config_values(build_parser(argv).parse_args(argv))["threads"] == 1  # the file says 2: the flag wins
    before = torch.get_num_threads()
    try:
        assert main(["quantize", "--model", "demo", "--to", "int8", "--out", str(tmp_path / "q"), "--threads",
                     "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):  # a user mistake: argparse's one line, exit 2
        build_parser(["info"]).parse_args(["info", "--threads", "0"])


def test_the_python_api_takes_temperature_as_the_server_does():
    """`temperature` T: the denoising schedule T -> T/2, ar_temperature in the other modes, near-greedy with seed 0
    below 1e-3; with the fields it sets, or negative, it is refused naming `temperature`."""
    import dgemma
    from dgemma.sampling import SamplingParamsError

    m = dgemma.load()
    options = {"seed": 3, "max_new_tokens": 12}
    assert m.generate("Once", temperature=1.2, **options).token_ids == \
        m.generate("Once", t_max=1.2, t_min=0.6, **options).token_ids
    ar = {mode: m.generate("Once", mode=mode, temperature=0.9, **options).token_ids
          for mode in ("autoregressive", "speculative")}
    assert ar["autoregressive"] == ar["speculative"] == \
        m.generate("Once", mode="autoregressive", ar_temperature=0.9, **options).token_ids
    greedy = m.params("diffusion", temperature=0)
    assert (greedy.t_max, greedy.t_min, greedy.seed) == (1e-3, 5e-4, 0)
    for bad in ({"temperature": 1.0, "t_max": 1.0}, {"temperature": -1}):
        with pytest.raises(SamplingParamsError) as e:
            m.generate("Once", **bad, **options)
        assert e.value.param == "temperature"


def test_model_demo_is_the_bundled_model_everywhere(tmp_path, monkeypatch, capsys):
    """The server calls the bundled model `demo`; --model demo names it to every command (a local path of that
    name still wins)."""
    from pathlib import Path

    from dgemma.api.checkpoint import DEMO_MODEL, locate
    from dgemma.bench.command import _model_dir
    from dgemma.server.command import _default_name
    from dgemma.train.trainer import checkpoint_dir

    assert locate("demo") == (DEMO_MODEL, False) and _model_dir("demo") == checkpoint_dir("demo") == DEMO_MODEL
    assert _default_name("demo") == _default_name(None) == "demo"
    assert main(["info", "--json"]) == 0 and main(["info", "--model", "demo", "--json"]) == 0
    default, named = capsys.readouterr().out.splitlines()
    assert json.loads(named) == json.loads(default)
    assert main(["info", "--model", "demo", "--revision", "main"]) == 2
    assert "--revision applies to a Hugging Face repo id" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert locate("demo")[0] == Path("demo")


def test_the_statistics_line_shows_time_to_first_token(capsys):
    """So --early-first-token visibly does something: the line carries the request's own time to first token."""
    import re

    from dgemma.display import print_stream
    from dgemma.engine import Result, StreamEvent

    stats = {"seconds": 0.5, "ttft_seconds": 0.0123, "tokens_per_second": 4.0, "steps_per_canvas": [3],
             "tokens_per_forward": 0.67}
    print_stream([StreamEvent("done", result=Result([5, 6], "ab", "length", stats))])
    assert "[2 tokens, 0.50 s, first token 12 ms, 4.0 tok/s," in capsys.readouterr().err
    assert main(["generate", "Once", "--max-new-tokens", "8", "--seed", "0", "--early-first-token"]) == 0
    line = capsys.readouterr().err
    ttft, total = int(re.search(r"first token (\d+) ms", line)[1]), float(re.search(r"tokens, ([\d.]+) s", line)[1])
    assert 0 <= ttft <= 1000 * total + 5
