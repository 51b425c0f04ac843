"""Deployment caps on what one request may cost the others (`dgemma serve --max-denoising-steps`,
`--max-temperature`, `--max-token-steps`): the one validator refuses a request beyond them naming the field
(an OpenAI 400 through the server), checkpoint defaults above a cap are lowered to it, and `--help` lists them."""

import subprocess
import sys

import httpx
import pytest

from dgemma.sampling import SamplingParams, SamplingParamsError
from dgemma.sampling.params import Limits
from server_fixtures import served_checkpoint, start_server

CAPS = Limits(max_denoising_steps=20, max_temperature=1.0, max_token_steps=20 * 30)


@pytest.mark.parametrize("fields, param", [
    ({"max_denoising_steps": 21}, "max_denoising_steps"),
    ({"t_min": 0.5, "t_max": 1.5}, "t_max"),
    ({"ar_temperature": 1.01}, "ar_temperature"),
    ({"max_new_tokens": 31, "max_denoising_steps": 20}, "max_new_tokens"),  # 620 token-steps > 600
])
def test_beyond_a_cap_is_refused_naming_the_field(fields, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**({"max_new_tokens": 8, "max_denoising_steps": 8} | fields)).validate(limits=CAPS)
    assert e.value.param == param


def test_at_the_caps_is_accepted_and_no_caps_by_default():
    SamplingParams(max_new_tokens=30, max_denoising_steps=20, t_min=1.0, t_max=1.0, ar_temperature=1.0).validate(
        limits=CAPS)
    SamplingParams(max_new_tokens=1000, max_denoising_steps=10_000, t_max=50.0).validate()


def test_defaults_are_lowered_to_the_caps():
    d = CAPS.clamp(SamplingParams(max_denoising_steps=48, t_min=0.4, t_max=2.0, ar_temperature=3.0))
    assert (d.max_denoising_steps, d.t_min, d.t_max, d.ar_temperature) == (20, 0.4, 1.0, 1.0)
    assert Limits().clamp(SamplingParams()) == SamplingParams()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory), max_denoising_steps=4, max_temperature=1.0,
                     max_token_steps=4 * 8)
    yield s
    s.stop()


@pytest.mark.parametrize("body, param", [
    ({"dgemma_sampling": {"max_denoising_steps": 5}, "max_tokens": 2}, "dgemma_sampling.max_denoising_steps"),
    ({"temperature": 1.5, "max_tokens": 2}, "temperature"),
    ({"dgemma_sampling": {"t_max": 1.5}, "max_tokens": 2}, "dgemma_sampling.t_max"),
    ({"max_tokens": 9}, "max_tokens"),  # 9 x 4 steps > 32 token-steps
])
def test_the_server_answers_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"} | body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_request_within_the_caps_runs_with_lowered_defaults(server):
    """The checkpoint's default is 12 steps; the cap is 4, so a request leaving steps out gets 4."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["dgemma_defaults"]["max_denoising_steps"] == 4


def test_serve_help_lists_the_caps():
    out = subprocess.run([sys.executable, "-m", "dgemma.server.command", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert all(flag in out for flag in ("--max-denoising-steps", "--max-temperature", "--max-token-steps"))
