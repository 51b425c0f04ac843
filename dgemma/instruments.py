"""Instruments for tests and benchmarks, usable on the CPU: host reads (device-to-host synchronisations on an
accelerator) and tensor factories called without a device, as made by dgemma's own code (a TorchFunctionMode),
and the kernels a region launches (aten ops that compute, not views; a TorchDispatchMode), and the peak bytes
of the tensors it creates."""

from __future__ import annotations

import sys
import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "numpy"}
FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "as_tensor",
             "randperm"}


class Recorder(TorchFunctionMode):
    """`reads`: host reads made from files under `roots`; `no_device`: factory calls there without `device=`."""

    def __init__(self, roots: tuple[str, ...] = ("dgemma/engine/", "dgemma/sampling/", "dgemma/model/",
                                                 "dgemma/cache/")):
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


class KernelCounter(TorchDispatchMode):
    """aten ops run inside the region; without `views`, views and metadata-only ops are left out: about one
    kernel launch each on an accelerator."""

    def __init__(self, views: bool = False):
        super().__init__()
        self.views = views
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.views or not _is_view(func):
            self.ops[func.overloadpacket.__name__] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _is_view(func) -> bool:
    schema = func._schema
    return (func.is_view or any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
            or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.lift_fresh))


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensors a region creates and keeps alive at once (its activations: storage that existed
    before, like weights and a preallocated cache, is not counted; nor are buffers inside one kernel)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _is_view(func) and not func._schema.is_mutable:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key, n = storage.data_ptr(), storage.nbytes()
        if not key or key in self._held:
            return
        self._held.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, n)

    def _release(self, key: int, n: int) -> None:
        self.live -= n
        self._held.discard(key)
