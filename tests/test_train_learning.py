"""Learning must happen: a tiny model trained from scratch on a reversal task (chat JSONL, answers spanning two
canvases) reaches high exact-match accuracy when sampled with dgemma's own diffusion generation. A broken loss,
mask, corruption or canvas context would not get there."""

from __future__ import annotations

import json
import random

import pytest

from test_train import make_tokenizer

ALPHABET = "abcdefgh"
LENGTH = 5  # + <end_of_turn> = 6 response tokens: two canvases of 4, the second with EOS fill
MODEL = {"canvas_length": 4, "text_config": {
    "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
    "num_global_key_value_heads": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32, "max_position_embeddings": 256,
    "eos_token_id": [1, 5]}}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(LENGTH))


def _chat(word: str) -> dict:
    return {"messages": [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]}


@pytest.mark.slow
def test_reversal_is_learned_and_generated(tmp_path):
    import dgemma
    from dgemma.train.config import make_config
    from dgemma.train.trainer import train

    rng = random.Random(0)
    make_tokenizer(tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(_chat(_word(rng))) for _ in range(3000)))
    tests = [_word(rng) for _ in range(32)]
    cfg = make_config(dict(model_config=MODEL, tokenizer=str(tmp_path / "tok"),
                           train_data=str(tmp_path / "train.jsonl"), out=str(tmp_path / "run"), canvases=2,
                           max_prompt=16, steps=300, batch_size=32, lr=3e-3, min_lr=3e-4, warmup=20,
                           weight_decay=0.0, betas=(0.9, 0.98), eval_every=0, save_minutes=1e9, precision="float32",
                           seed=0, init_std=0.05))
    final = train(cfg, progress=False)

    model = dgemma.load(final)
    tok = model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": w}]) for w in tests]
    results = model.generate(prompts, max_new_tokens=8, max_denoising_steps=8, t_max=0.2, t_min=0.05, seed=0)
    answers = []
    for r in results:
        ids = r.token_ids
        cut = next((i for i, t in enumerate(ids) if t in (1, 5)), len(ids))
        answers.append(tok.decode(ids[:cut]))
    accuracy = sum(a == w[::-1] for a, w in zip(answers, tests)) / len(tests)
    print(f"reversal exact match {accuracy:.2f}")
    assert accuracy >= 0.85, list(zip(tests, answers))
