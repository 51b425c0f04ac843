"""presence_penalty: the logit of every token that occurs in the output so far lowered by F (OpenAI's formula;
vLLM's `presence_penalty`; negative values favour repeats)."""

from dgemma.knobs.base import LOGITS, Knob, knob_option, number_in


def _apply(logits, f, history):
    return logits.sub_(f * (history.counts(logits.shape[-1], logits.device) > 0))


KNOB = Knob(knob_option("presence_penalty", float, "F", "lower the logit of each token already in the output by F "
                        "(in [-2, 2]; 0: off)", number_in("presence_penalty", -2.0, 2.0)),
            LOGITS, _apply, off=(0, 0.0))
