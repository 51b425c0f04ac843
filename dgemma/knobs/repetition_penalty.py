"""repetition_penalty: a token of the prompt or the output so far has its logit divided by F when positive, multiplied
by F when negative (vLLM's `repetition_penalty`; transformers' RepetitionPenaltyLogitsProcessor; 1: off)."""

from dgemma.knobs.base import LOGITS, Knob, knob_option, number_in


def _apply(logits, f, history):
    seen = history.seen(logits.device)
    picked = logits[:, seen]
    logits[:, seen] = (picked * f).where(picked < 0, picked / f)
    return logits


KNOB = Knob(knob_option("repetition_penalty", float, "F", "tokens of the prompt or the output so far: logit / F "
                        "when positive, x F when negative (1: off)", number_in("repetition_penalty", 0.0, 100.0,
                                                                              lo_open=True)),
            LOGITS, _apply, off=(1, 1.0))
