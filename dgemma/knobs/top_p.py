"""top_p: nucleus sampling, the most likely tokens whose probabilities sum to P (at least one), after the
temperature (OpenAI's and vLLM's `top_p`; the rule of transformers' TopPLogitsWarper)."""

from dgemma.knobs.base import PROBS, Knob, knob_option, number_in


def _apply(logits, p, history):
    ordered, order = logits.sort(dim=-1)  # ascending
    mass = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = mass <= 1 - p
    drop[:, -1] = False  # the most likely token stays
    return logits.masked_fill_(drop.scatter(1, order, drop), float("-inf"))


KNOB = Knob(knob_option("top_p", float, "P", "nucleus sampling: the most likely tokens whose probabilities add up to "
                        "P, after the temperature (1: all)", number_in("top_p", 0.0, 1.0, lo_open=True)),
            PROBS, _apply, off=(1, 1.0))
