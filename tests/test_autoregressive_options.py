"""Autoregressive decoding takes the options it can honour (temperature, seed) and refuses, in one line, the
ones that belong to diffusion decoding (and the other way round), instead of ignoring them."""

import json

import pytest

from dgemma.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["--mode", "autoregressive", "--t-max", "1.5"], "--t-max"),
    (["--mode", "autoregressive", "--steps", "4"], "--steps"),
    (["--mode", "autoregressive", "--sampling", "reference"], "--sampling reference"),
    (["--mode", "autoregressive", "--soft-top-k", "8"], "--soft-top-k"),
    (["--mode", "autoregressive", "--skip-settled", "2"], "--skip-settled"),
    (["--mode", "speculative", "--early-commit", "1"], "--early-commit"),
    (["--mode", "autoregressive", "--early-first-token"], "--early-first-token"),
    (["--ar-temperature", "1.0"], "--ar-temperature"),
])
def test_options_of_the_other_mode_are_refused(capsys, argv, flag):
    assert main(["generate", "Hello", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag} applies to") and len(err.splitlines()) == 1


def test_autoregressive_cli_samples_with_its_temperature_and_seed(capsys):
    """The bundled model: greedy, then two seeds at a high temperature (different), then one of them again."""
    def run(*extra):
        assert main(["generate", "Hello", "--mode", "autoregressive", "--max-new-tokens", "8", "--json",
                     *extra]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    greedy = run()
    hot = [run("--ar-temperature", "1.5", "--seed", str(s)) for s in (1, 2, 1)]
    assert hot[0] == hot[2] and hot[0] != hot[1] and greedy not in hot
