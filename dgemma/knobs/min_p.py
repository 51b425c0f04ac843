"""min_p: drop the tokens less likely than P times the most likely one, after the temperature (vLLM's `min_p`;
the rule of transformers' MinPLogitsWarper)."""

from dgemma.knobs.base import PROBS, Knob, knob_option, number_in


def _apply(logits, p, history):
    probs = logits.softmax(dim=-1)
    floor = p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < floor, float("-inf"))


KNOB = Knob(knob_option("min_p", float, "P", "drop tokens less likely than P x the most likely one, after the "
                        "temperature (0: none)", number_in("min_p", 0.0, 1.0)), PROBS, _apply, off=(0, 0.0))
