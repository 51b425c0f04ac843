"""OpenAI's `temperature`, one rule for the server and the Python API: in diffusion mode T sets the denoising
schedule t_max = T -> t_min = T / 2; in the autoregressive and speculative modes it is `ar_temperature`."""

from __future__ import annotations

from dgemma.sampling.params import SamplingParamsError

GREEDY_T = 1e-3  # temperatures below this (0 included) -> a near-greedy schedule from 1e-3 down to 5e-4
SETS = {"diffusion": ("t_min", "t_max")}  # the fields T sets per mode; the other modes: ar_temperature


def temperature_fields(temperature: float | None, mode: str, given: dict | None = None) -> dict[str, float]:
    """The SamplingParams fields temperature T sets in `mode` (None: none); `given`: the caller's other fields, none
    of which may set the same ones (refused naming `temperature`)."""
    if temperature is None:
        return {}
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise SamplingParamsError(f"temperature={temperature!r} must be a number >= 0", "temperature")
    names = SETS.get(mode, ("ar_temperature",))
    if clash := [k for k in names if (given or {}).get(k) is not None]:
        raise SamplingParamsError(f"temperature and {' / '.join(clash)} both set the sampling temperature; give "
                                  "one", "temperature")
    if mode != "diffusion":
        return {"ar_temperature": float(temperature)}
    t = max(temperature, GREEDY_T)  # below 1e-3 sampling is greedy anyway; 1 / T stays finite
    return {"t_max": t, "t_min": t / 2}


def is_greedy(temperature: float | None) -> bool:
    """A near-greedy temperature: the server's (and the API's) requests without a seed then use seed 0, since the
    starting canvas and the renoising are random even when sampling is near-greedy."""
    return temperature is not None and temperature < GREEDY_T
