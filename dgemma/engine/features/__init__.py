"""Request features as parts of the engine: each implements the row-feature contract (features/base.py). A new
feature is one module here and one entry below; the order is the order the hooks run in (a feature comes after those
it `requires`). COUNTERS: every count of work the features declare, which bench/flops.py prices."""

from dgemma.engine.features.base import Counter, Feature, Step, bind, counters
from dgemma.engine.features.drafts import Drafts
from dgemma.engine.features.early_commit import EarlyCommit
from dgemma.engine.features.early_commit_cache import EarlyCommitCache
from dgemma.engine.features.early_first_token import EarlyFirstToken
from dgemma.engine.features.early_stop import EarlyStop
from dgemma.engine.features.grammar import GrammarFeature
from dgemma.engine.features.layout import LayoutFeature
from dgemma.engine.features.logprobs import Logprobs
from dgemma.engine.features.skip_settled import SkipSettled
from dgemma.engine.features.target_canvas_ms import TargetCanvasMs
from dgemma.engine.features.thought_budget import ThoughtBudgetFeature

FEATURES: tuple[Feature, ...] = bind((TargetCanvasMs(), EarlyStop(), LayoutFeature(), ThoughtBudgetFeature(),
                                       GrammarFeature(), EarlyCommit(),
                                       EarlyFirstToken(), Logprobs(), Drafts(), SkipSettled(), EarlyCommitCache()))
COUNTERS: tuple[Counter, ...] = counters(FEATURES)

__all__ = ["COUNTERS", "FEATURES", "Counter", "Feature", "Step", "bind", "counters"]
