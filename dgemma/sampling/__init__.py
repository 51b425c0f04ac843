"""Sampling: per-request parameters, the denoising-step samplers, and stopping rules."""

from dgemma.sampling.constraints import Grammar
from dgemma.sampling.params import MAX_SEED, Limits, SamplingParams, SamplingParamsError
from dgemma.sampling.samplers import (
    StepOutput,
    entropy_bound_accept,
    exponential_race,
    make_generator,
    random_tokens,
    reference_step,
    renoise,
    sample_next,
    temperature_schedule,
    token_entropy,
)
from dgemma.sampling.stopping import (
    StableConfidentStopper,
    finalize_canvas,
    freeze_rows,
    stop_holdback,
    truncate_at_stop_strings,
)

__all__ = [
    "Grammar",
    "Limits",
    "MAX_SEED",
    "SamplingParams",
    "SamplingParamsError",
    "StableConfidentStopper",
    "StepOutput",
    "entropy_bound_accept",
    "exponential_race",
    "finalize_canvas",
    "freeze_rows",
    "make_generator",
    "random_tokens",
    "reference_step",
    "renoise",
    "sample_next",
    "stop_holdback",
    "temperature_schedule",
    "token_entropy",
    "truncate_at_stop_strings",
]
