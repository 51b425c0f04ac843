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
