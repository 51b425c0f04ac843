"""A latency target's step budget: as many denoising steps as fit a canvas's target time at the measured step
time, within the request's own cap (and at least one)."""

from __future__ import annotations


def step_budget(target_ms: float, step_seconds: float, cap: int) -> int:
    return max(1, min(cap, int(target_ms / (1000.0 * step_seconds))))


def measured(previous: float | None, seconds: float, weight: float = 0.25) -> float:
    """The step time after one more step took `seconds`: an exponential moving average (the first step: itself)."""
    return seconds if previous is None else (1 - weight) * previous + weight * seconds
