"""Test instruments: host reads (device-to-host synchronisations on an accelerator) and tensor factories called
without a device, as made by dgemma's own code; recorded with a TorchFunctionMode, so they work on the CPU."""

from __future__ import annotations

import sys

from torch.overrides import TorchFunctionMode

HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "numpy"}
FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "as_tensor",
             "randperm"}


class Recorder(TorchFunctionMode):
    """`reads`: host reads made from files under `roots`; `no_device`: factory calls there without `device=`."""

    def __init__(self, roots: tuple[str, ...] = ("dgemma/engine/", "dgemma/sampling/", "dgemma/model/",
                                                 "dgemma/cache.py")):
        super().__init__()
        self.roots = roots
        self.reads: list[str] = []
        self.no_device: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name in FACTORIES and kwargs.get("device") is None):
            frame = sys._getframe(1)
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            if any(r in where.replace("\\", "/") for r in self.roots):
                (self.reads if name in HOST_READS else self.no_device).append(f"{name} at {where}")
        return func(*args, **kwargs)
