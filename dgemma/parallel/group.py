"""This rank's place in a tensor-parallel run: joining torchrun's process group (gloo on CPUs, NCCL on CUDA GPUs,
one GPU per local rank) and the few collectives outside the model's own all-reduces (a seed rank 0 draws)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from dgemma.errors import ConfigError


@dataclass(frozen=True)
class Group:
    """Rank `rank` of `world`; `pg` the process group the model's all-reduces use (None: no collectives, as when
    the shards are only measured)."""

    rank: int
    world: int
    pg: object = None

    def shared_seed(self, seed: int | None) -> int | None:
        """The seed every rank uses: rank 0's, drawn there when none was given (every rank calls this together)."""
        if seed is not None or self.pg is None:
            return seed
        import torch.distributed as dist

        t = torch.tensor([random.SystemRandom().randrange(2**62) if self.rank == 0 else 0], device=_device(self.pg))
        dist.broadcast(t, 0, group=self.pg)
        return int(t.item())


    def from_rank0(self, value):
        """Rank 0's `value` on every rank (what only rank 0 reads: standard input); every rank calls this together."""
        if self.pg is None:
            return value
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]


def _device(pg) -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")


def launch_environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun (or any env:// launcher) sets them; (0, 1, 0) without one."""
    try:
        return tuple(int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None


def resolve_backend(backend: str, device_type: str) -> str:
    return ("nccl" if device_type == "cuda" else "gloo") if backend == "auto" else backend


def join(size: int, device: torch.device) -> tuple[Group, torch.device]:
    """This process's Group of a `size`-way tensor-parallel run launched by torchrun, and its device (cuda:LOCAL_RANK
    for a CUDA device)."""
    rank, world, local_rank = launch_environment()
    if world != size:
        raise ConfigError(f"tensor parallel size {size} needs {size} processes, this run has {world}: launch it with "
                          f"`torchrun --nproc-per-node {size} -m dgemma ...` (or without torchrun: dgemma starts it)")
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(resolve_backend("auto", device.type),
                                device_id=device if device.type == "cuda" else None)
    return Group(rank, world, dist.group.WORLD), device


def leave() -> None:
    """Tear the process group down once every rank is done with it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
