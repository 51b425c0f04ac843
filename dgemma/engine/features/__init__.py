"""Request features as parts of the engine: each implements the row-feature contract (features/base.py). A new
feature is one module here and one entry below; the order is the order the hooks run in (a feature comes after those
it `requires`). COUNTERS: every count of work the features declare, which bench/flops.py prices."""

from dgemma.engine.features.base import Counter, Feature, Step, bind, counters
from dgemma.engine.features.drafts import Drafts
from dgemma.engine.features.early_cache import EarlyCommitCache
from dgemma.engine.features.early_commit import EarlyCommit
from dgemma.engine.features.early_stop import EarlyStop
from dgemma.engine.features.first_token import FirstToken
from dgemma.engine.features.grammar import Grammar
from dgemma.engine.features.infill import Infill
from dgemma.engine.features.latency import LatencyTarget
from dgemma.engine.features.logprobs import Logprobs
from dgemma.engine.features.settled import Settled

FEATURES: tuple[Feature, ...] = bind((LatencyTarget(), EarlyStop(), Infill(), Grammar(), EarlyCommit(), FirstToken(),
                                       Logprobs(), Drafts(), Settled(), EarlyCommitCache()))
COUNTERS: tuple[Counter, ...] = counters(FEATURES)

__all__ = ["COUNTERS", "FEATURES", "Counter", "Feature", "Step", "bind", "counters"]
