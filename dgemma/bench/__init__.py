"""`dgemma bench`: time dgemma diffusion, the `transformers` reference and autoregressive decoding of one checkpoint.

command (arguments, plan, run) -> trials (one configuration per process) -> flops (FLOP model, matmul peak)
-> report (ratios, table, JSON). Only `command` is imported here, and it imports torch lazily, so that
`dgemma --help` stays cheap.
"""

from dgemma.bench.command import add_arguments, run

__all__ = ["add_arguments", "run"]
