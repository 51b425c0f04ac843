"""Training and fine-tuning with the DiffusionGemma objective.

data.py (examples, canvases, batches), objective.py (corruption, canvas choice, self-conditioning, losses),
lora.py (peft adapters), checkpoint.py (resumable states, HF-layout export), trainer.py (the loop),
config.py (TrainConfig), command.py (`dgemma train`).
"""

from dgemma.train.config import TrainConfig, make_config
from dgemma.train.objective import ObjectiveConfig, compute_losses
from dgemma.train.trainer import Trainer, train

__all__ = ["ObjectiveConfig", "TrainConfig", "Trainer", "compute_losses", "make_config", "train"]
