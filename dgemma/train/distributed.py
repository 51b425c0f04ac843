"""Where training runs: the device, the process group and how the model is spread over the ranks (the one place
that decides them).

Without torchrun (no WORLD_SIZE in the environment, or 1) nothing here does anything: one process, the configured
device, the model as built. Under `torchrun --nproc-per-node N -m dgemma train ...` every rank joins one process
group (gloo on CPUs, NCCL on CUDA GPUs, one GPU per local rank) and the model is spread with `parallel`:

- fsdp: PyTorch FSDP2 (`fully_shard`), one unit per layer plus the root (embeddings, final norm, self-conditioning);
  weights, gradients and optimizer state are sharded over the ranks. With bf16 precision, parameters are
  all-gathered in bfloat16 and gradients reduced in float32 (the float32 master weights stay sharded).
- ddp: every rank holds the whole model (LoRA when the base fits on each device) and the trainable gradients are
  averaged with one all-reduce per optimizer step.

Every rank builds the same global batch and scores its own rows of it (`data.rows_of_rank`), so the examples, the
noise and the global batch are the ones a single process would use, and each example is seen once per epoch
across the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgemma.errors import ConfigError
from dgemma.parallel.group import launch_environment, resolve_backend

@dataclass(frozen=True)
class Parallel:
    device: torch.device
    rank: int = 0
    world: int = 1
    strategy: str | None = None  # None: one process

    @property
    def main(self) -> bool:
        """The rank that writes logs, the training state's small files and the exported model."""
        return self.rank == 0

    @property
    def part(self) -> tuple[int, int] | None:
        """(rank, world) for compute_losses, or None in one process."""
        return (self.rank, self.world) if self.world > 1 else None

    def mean(self, values: list[float]) -> list[float]:
        """The mean over the ranks of each value (the values themselves in one process)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def check(cfg, world: int, local_rank: int) -> None:
    """One-line errors for a launch that cannot work, before any process group or model exists."""
    if world == 1:
        return
    device_type = torch.device(cfg.device).type
    backend = resolve_backend(cfg.backend, device_type)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend nccl needs CUDA GPUs and this machine has none; train on --device cpu (gloo)")
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError(f"backend nccl moves CUDA tensors; use --device cuda (or --backend gloo for {cfg.device})")
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                          "start at most that many processes per node")
    if cfg.batch_size % world:
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by the {world} ranks (batch_size is the "
                          "global micro-batch; each rank takes batch_size / ranks examples)")


def setup(cfg) -> Parallel:
    """Join torchrun's process group (if launched by it) and pick this rank's device."""
    rank, world, local_rank = launch_environment()
    check(cfg, world, local_rank)
    device = torch.device(cfg.device)
    if world == 1:
        return Parallel(device)
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = resolve_backend(cfg.backend, device.type)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Parallel(device, rank, world, cfg.parallel)


def close(par: Parallel) -> None:
    if par.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while another still talks to it (rank abort seen under load)
            dist.destroy_process_group()


def spread(model: torch.nn.Module, par: Parallel, amp: torch.dtype | None) -> torch.nn.Module:
    """Shard (fsdp) or replicate (ddp) the built model over the ranks; returns it (the same object)."""
    if par.world == 1:
        return model
    if par.strategy == "ddp":
        _broadcast_trainable(model)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(par.device.type, (par.world,))
    # bf16: all-gather bf16 copies, reduce in float32; compute dtypes stay the trainer's autocast
    mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32, cast_forward_inputs=False) \
        if amp is not None else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # the objective calls encode / denoise / head, never forward; the root keeps its weights gathered from the
    # first of these calls until backward (FSDP2 does not reshard the root after forward), so head can use them
    for name in ("encode", "denoise"):
        register_fsdp_forward_method(model, name)
    return model


def _broadcast_trainable(model: torch.nn.Module) -> None:
    """Ranks build the same model from the same seed; make it certain for what they train."""
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, 0)


def average_gradients(params: list[torch.nn.Parameter], par: Parallel) -> None:
    """ddp: the mean over the ranks of every trainable gradient, in one all-reduce (fsdp reduces its own). Every
    rank runs the same passes, so the same parameters have gradients everywhere."""
    if par.world == 1 or par.strategy != "ddp":
        return
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= par.world
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def local(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a sharded DTensor (a collective: every rank calls it), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def after_eval(model: torch.nn.Module) -> None:
    """FSDP keeps the root gathered after forward for the backward that follows; a no-grad pass has none."""
    if hasattr(model, "reshard"):
        model.reshard()


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The trainable weights and the optimizer state by parameter name, sharded as this run holds them (DCP saves
    and loads it; the names do not depend on the number of ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {"model": {k: v for k, v in weights.items() if k in trainable}, "optimizer": optim}


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def load_whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                     optim: dict) -> None:
    """A one-process training state (whole tensors; optimizer state keyed by parameter index) into this run's
    sharded or replicated model and optimizer: every rank read the files and keeps its part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]  # index -> name
    by_name = {"state": {order[i]: s for i, s in optim["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False))


def gathered_state(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Whole tensors on the main rank's CPU (empty elsewhere): a collective, every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    if trainable_only:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trainable}
    return state


def plain_model(cfg, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A DiffusionGemma holding `state` (a gathered full state), for the export."""
    from dgemma.model import DiffusionGemma

    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    model.load_state_dict(state, assign=True)
    return model
