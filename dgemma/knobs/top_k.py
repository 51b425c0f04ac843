"""top_k: sample from the K most likely tokens only (vLLM's `top_k`; 0 or -1: all). Ties with the K-th are kept,
as transformers' TopKLogitsWarper keeps them."""

from dgemma.errors import SamplingParamsError
from dgemma.knobs.base import PROBS, Knob, knob_option

MAX_TOP_K = 1 << 20


def _check(value, vocab_size=None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value <= MAX_TOP_K:
        raise SamplingParamsError(f"top_k={value!r} must be an integer in [-1, {MAX_TOP_K}] (0 or -1: all tokens)",
                                  "top_k")


def _apply(logits, k, history):
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[:, -1:]
    return logits.masked_fill_(logits < kth, float("-inf"))


KNOB = Knob(knob_option("top_k", int, "K", "sample from the K most likely tokens only (0 or -1: all)", _check),
            PROBS, _apply, off=(0, -1))
