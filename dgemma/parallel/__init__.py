"""One model across devices: tensor parallelism (attention heads, MLP columns, vocabulary rows) and expert
parallelism (MoE experts) through torch.distributed, every rank running the same engine loop on the same requests
(SPMD).

`group.py` joins torchrun's process group; `shard.py` cuts a loaded model in place; the model's own code holds the
collectives of a pass (`model.layers.all_reduce` after o_proj, down_proj, the experts and the embedding lookups;
the head's gathered logits) and the fused vocabulary step merges its ranks' statistics (sampling/vocab_shards.py).
Decisions that depend on wall time would differ between ranks and are refused here (`check_request`).
"""

from __future__ import annotations

from dgemma.errors import SamplingParamsError
from dgemma.parallel.group import Group, join, leave
from dgemma.parallel.shard import shard, weight_bytes

__all__ = ["Group", "check_request", "join", "leave", "shard", "weight_bytes"]

# Decoding that follows the clock: each rank would measure its own and choose differently.
TIMED_FIELDS = ("target_canvas_ms",)  # the steps a canvas gets follow the measured step time


def check_request(params, mode: str, speculative_pacing: str = "counted") -> None:
    """Refuse what would take the ranks out of lockstep (speculative drafting paced by the clock, `timed`; the
    default counted pacing decides from committed ids, the same on every rank)."""
    if mode == "speculative" and speculative_pacing == "timed":
        raise SamplingParamsError("timed speculative pacing follows wall time, which differs between ranks: not "
                                  "supported under tensor parallelism (the default counted pacing is)", "mode")
    for name in TIMED_FIELDS:
        if getattr(params, name, None) is not None:
            raise SamplingParamsError(f"{name} follows each rank's wall time: not supported under tensor "
                                      "parallelism", name)
