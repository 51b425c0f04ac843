"""Training and fine-tuning with the DiffusionGemma objective.

data.py (examples, canvases, batches), objective.py (corruption, canvas choice, self-conditioning, losses),
lora.py (peft adapters), checkpoint.py (resumable states, HF-layout export), trainer.py (the loop),
distributed.py (device, process group, FSDP / data parallel under torchrun), recompute.py (activation
checkpointing), config.py (TrainConfig), command.py (`dgemma train`).
"""

__all__ = ["ObjectiveConfig", "TrainConfig", "Trainer", "compute_losses", "make_config", "train"]
_WHERE = {"ObjectiveConfig": "objective", "compute_losses": "objective", "TrainConfig": "config",
          "make_config": "config", "Trainer": "trainer", "train": "trainer"}


def __getattr__(name: str):
    # Lazy, so that building the `dgemma` argument parser does not import torch.
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"dgemma.train.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dgemma.train' has no attribute {name!r}")
