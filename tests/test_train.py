"""Training: corruption, canvas selection, masks and losses against hand-computed cases; the training decoder
path against the inference path; exact resume; LoRA; checkpoints through the transformers round trip; the CLI."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dgemma.errors import DgemmaError
from dgemma.train.config import make_config
from dgemma.train.data import Example, Loader, TextWindows, canvases_of, collate, read_chat
from dgemma.train.objective import (ObjectiveConfig, autoregressive_loss, compute_losses, corrupt, diffusion_loss,
                                    gather_canvas, sample_noise_level, select_canvas)
from dgemma.train.trainer import Trainer, lr_factor

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
CHARS = list("abcdefghijklmnop") + ["=", " ", "\n", "."]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% else %}"
                 "{{ m['content'] }}<end_of_turn>{% endif %}{% endfor %}")
TINY = {"canvas_length": 4, "text_config": {
    "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 16,
    "num_global_key_value_heads": 1, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16, "max_position_embeddings": 512,
    "eos_token_id": [1, 5]}}


def make_tokenizer(directory: Path) -> Path:
    """A character-level tokenizer with the Gemma-style special ids 0..5 and a one-line chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    return directory


def write_text(path: Path, docs: int = 6, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = lambda n: " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(1, 6)))  # noqa: E731
                               for _ in range(n))
    path.write_text("\n\n\n".join(words(rng.randint(10, 30)) + "." for _ in range(docs)))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    make_tokenizer(d / "tok")
    write_text(d / "train.txt")
    write_text(d / "valid.txt", docs=2, seed=1)
    return d


def tiny_config(workdir: Path, out: Path, **over):
    values = dict(model_config=TINY, tokenizer=str(workdir / "tok"), train_data=str(workdir / "train.txt"),
                  valid_data=str(workdir / "valid.txt"), out=str(out), canvases=2, max_prompt=6, batch_size=3,
                  steps=4, lr=1e-2, warmup=1, eval_every=0, save_every=0, save_minutes=1e9, precision="float32",
                  eval_batches=1)
    values.update(over)
    return make_config(values)


# ---- data and masks -------------------------------------------------------------------------------------------

def test_canvases_fill_with_eos():
    assert canvases_of([7, 8, 9], 4, eos=1) == [7, 8, 9, 1]
    assert canvases_of([7, 8, 9, 6], 4, eos=1) == [7, 8, 9, 6]  # exact fit: no extra canvas
    assert canvases_of([7] * 5, 4, eos=1) == [7] * 5 + [1, 1, 1]
    assert canvases_of([], 4, eos=1) == [1, 1, 1, 1]


def test_collate_hand_computed():
    text = Example(prompt=[2, 10, 11], response=[20, 21, 22, 23, 24], ar_prompt=True)
    chat = Example(prompt=[2, 12], response=[30, 31], ar_prompt=False)
    b = collate([text, chat], canvas_length=4, eos=1)
    assert b.ids.tolist() == [[2, 10, 11, 20, 21, 22, 23, 24, 1, 1, 1],
                              [2, 12, 30, 31, 1, 1, 0, 0, 0, 0, 0]]
    assert b.valid.tolist() == [[True] * 11, [True] * 6 + [False] * 5]
    assert b.prompt_len.tolist() == [3, 2] and b.n_canvases.tolist() == [2, 1]
    # text: every next token from position 0 through the first EOS of the fill (target index 8)
    assert b.ar_mask[0].tolist() == [True] * 8 + [False] * 3
    # chat: only the response (targets 2, 3) and its first EOS (target 4)
    assert b.ar_mask[1].tolist() == [False, True, True, True] + [False] * 7
    assert b.tokens == 17


def test_collate_response_ending_in_eos_scores_no_fill():
    b = collate([Example([2], [7, 1])], canvas_length=4, eos=1)
    assert b.ids.tolist() == [[2, 7, 1, 1, 1]]
    assert b.ar_mask[0].tolist() == [True, True, False, False, False]


def test_text_windows_cover_every_token_once():
    docs = [list(range(10, 23)), list(range(40, 45))]
    w = TextWindows(docs, canvas_length=2, canvases=2, max_prompt=5, bos=2, eos=1, seed=0)
    spans = [w.get(i, epoch=0) for i in range(len(w))]
    assert [t for ex in spans[:4] for t in ex.response] == docs[0] + [1]
    assert [t for ex in spans[4:] for t in ex.response] == docs[1] + [1]
    for i, ex in enumerate(spans):
        d, start = w.index[i]
        assert ex.prompt[0] == 2 and len(ex.prompt) <= 5
        assert ex.prompt[1:] == w.docs[d][start - len(ex.prompt) + 1:start]  # the text right before the window
    assert [w.get(i, 0) for i in range(len(w))] == spans  # deterministic


def test_loader_resumes_at_the_same_position():
    ds = TextWindows([list(range(10, 60))], 2, 2, 4, 2, 1, seed=0)
    a = Loader(ds, 3, 2, 1, seed=5)
    for _ in range(7):  # crosses an epoch boundary (13 windows)
        a.next()
    b = Loader(ds, 3, 2, 1, seed=5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next().ids, b.next().ids)


def test_chat_jsonl(workdir, tmp_path):
    from dgemma.tokenizer import Tokenizer

    tok = Tokenizer(workdir / "tok")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "abc"},
                                             {"role": "assistant", "content": "cba"}]}) + "\n\n")
    (ex,) = read_chat(path, tok, max_prompt=64, max_response=64)
    assert tok.decode(ex.prompt) == "abc=" and ex.prompt[0] == 2
    assert ex.response == tok.encode("cba", add_bos=False) + [5] and not ex.ar_prompt
    for bad, message in [("{not json", "invalid JSON"), ("[1]", "expected an object"),
                         ('{"messages": [{"role": "user", "content": "x"}]}', "the last message must be an assistant")]:
        path.write_text(bad + "\n")
        with pytest.raises(DgemmaError, match=f"chat.jsonl:1: {message}"):
            read_chat(path, tok, 64, 64)


# ---- objective ------------------------------------------------------------------------------------------------

def test_noise_level_and_canvas_selection():
    g = torch.Generator().manual_seed(0)
    t = sample_noise_level(10_000, 1e-3, g)
    assert t.min() >= 1e-3 and t.max() <= 1 - 1e-3 and abs(t.mean() - 0.5) < 0.02
    n = torch.tensor([1, 3, 2] * 3000)
    s = select_canvas(n, g)
    assert (s[n == 1] == 0).all() and (s < n).all() and (s >= 0).all()
    counts = torch.bincount(s[n == 3], minlength=3).float() / 3000
    assert torch.allclose(counts, torch.full((3,), 1 / 3), atol=0.03)


def test_corruption():
    g = torch.Generator().manual_seed(0)
    x0 = torch.arange(4 * 2000).reshape(4, 2000) % 50 + 100  # ids 100..149, none below 100
    t = torch.tensor([0.0, 1.0, 0.25, 0.75])
    noisy = corrupt(x0, t, vocab_size=100, generator=g)
    assert torch.equal(noisy[0], x0[0])  # t = 0 keeps everything
    assert (noisy[1] < 100).all()  # t = 1 replaces everything (noise ids are < vocab_size = 100 here)
    for row, level in ((2, 0.25), (3, 0.75)):
        assert abs((noisy[row] != x0[row]).float().mean() - level) < 0.04
    # the replacements are uniform over the vocabulary
    hist = torch.bincount(noisy[1], minlength=100).float() / 2000
    assert hist.max() < 0.025 and hist.min() > 0.0
    g2 = torch.Generator().manual_seed(0)
    replace = torch.rand(x0.shape, generator=g2) < t[:, None]
    expected = torch.where(replace, torch.randint(0, 100, x0.shape, generator=g2), x0)
    assert torch.equal(noisy, expected)


def test_losses_hand_computed():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]])
    ids = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[True, False, False]])  # only position 0 -> target ids[1] = 1
    expected = -math.log(math.exp(0) / (math.exp(2) + 2))
    assert autoregressive_loss(logits, ids, mask).item() == pytest.approx(expected)
    x0 = torch.tensor([[0, 1, 2]])
    per = [-math.log(math.exp(2) / (math.exp(2) + 2)), -math.log(math.e / (math.e + 2)),
           -math.log(math.exp(3) / (math.exp(3) + 2))]
    assert diffusion_loss(logits, x0).item() == pytest.approx(sum(per) / 3)
    assert torch.equal(gather_canvas(torch.arange(20).view(2, 10), torch.tensor([1, 6]), 3),
                       torch.tensor([[1, 2, 3], [16, 17, 18]]))


def _tiny_model(seed=0):
    from dgemma.config import ModelConfig
    from dgemma.model import DiffusionGemma
    from dgemma.train.trainer import init_weights

    torch.manual_seed(seed)
    model = DiffusionGemma(ModelConfig.from_hf({"model_type": "diffusion_gemma", **TINY}))
    init_weights(model, 0.3)
    return model


@pytest.mark.parametrize("self_cond", [0.0, 1.0])
def test_training_decoder_matches_inference_path(self_cond):
    """The training pass (full clean sequence encoded, decoder limited by `context`) equals inference: encode only
    the prompt and the canvases before s, then denoise canvas s; with self-conditioning from a first pass."""
    model = _tiny_model()
    c = model.cfg.canvas_length
    examples = [Example([2, 9, 10, 11, 12, 13, 14, 15], list(range(16, 27))), Example([2, 7], [20, 21, 22])]
    batch = collate(examples, c, eos=1)
    seed = 3
    with torch.no_grad():
        losses = compute_losses(model, batch, ObjectiveConfig(self_cond_prob=self_cond, ar_weight=1.0),
                                torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        t = sample_noise_level(2, 1e-3, g)
        s = select_canvas(batch.n_canvases, g)
        torch.rand(2, generator=g)  # the self-conditioning draw
        context = batch.prompt_len + s * c
        x0 = gather_canvas(batch.ids, context, c)
        noisy = corrupt(x0, t, model.cfg.text.vocab_size, g)
        total_diff, total_ar, n_ar = 0.0, 0.0, 0
        for b in range(2):
            n = int(context[b])
            cache = model.new_cache(1, 64)
            model.encode(batch.ids[b:b + 1, :n], cache)
            signal = None
            if self_cond:
                first = model.head(model.denoise(noisy[b:b + 1], cache))
                signal = model.soft_embed(first)
            logits = model.head(model.denoise(noisy[b:b + 1], cache, signal))
            total_diff += F.cross_entropy(logits[0], x0[b], reduction="sum").item()
            length = int(batch.valid[b].sum())
            enc = model.head(model.encode(batch.ids[b:b + 1, :length], model.new_cache(1, 64)))
            m = batch.ar_mask[b, :length - 1]
            total_ar += F.cross_entropy(enc[0, :-1][m], batch.ids[b, 1:length][m], reduction="sum").item()
            n_ar += int(m.sum())
    assert losses.diffusion == pytest.approx(total_diff / (2 * c), rel=1e-5)
    assert losses.autoregressive == pytest.approx(total_ar / n_ar, rel=1e-5)
    assert losses.total.item() == pytest.approx(losses.diffusion + losses.autoregressive, rel=1e-5)


def test_decoder_loss_reaches_the_encoder_through_the_cache():
    """With ar_weight 0 the encoder's input still gets gradient: the decoder reads its keys / values in the graph."""
    model = _tiny_model()
    captured = []
    embed = model.embed

    def spy(ids):
        out = embed(ids)
        out.retain_grad()
        captured.append(out)
        return out

    model.embed = spy
    batch = collate([Example([2, 9, 10], list(range(16, 24)))], 4, eos=1)
    losses = compute_losses(model, batch, ObjectiveConfig(ar_weight=0.0, self_cond_prob=0.0),
                            torch.Generator().manual_seed(0))
    losses.total.backward()
    encoder_input = captured[0]
    assert encoder_input.shape[1] == batch.ids.shape[1]
    assert encoder_input.grad is not None and encoder_input.grad.abs().sum() > 0


def test_lr_schedule():
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)


# ---- trainer --------------------------------------------------------------------------------------------------

def test_resume_gives_the_same_next_loss(workdir, tmp_path):
    straight = Trainer(tiny_config(workdir, tmp_path / "a"), progress=False)
    losses = [straight.train_step()["loss"] for _ in range(4)]
    first = Trainer(tiny_config(workdir, tmp_path / "b"), progress=False)
    assert [first.train_step()["loss"] for _ in range(2)] == losses[:2]
    first.save()
    del first
    resumed = Trainer(tiny_config(workdir, tmp_path / "b"), progress=False)
    assert resumed.step == 2
    assert [resumed.train_step()["loss"] for _ in range(2)] == losses[2:]
    fresh = Trainer(tiny_config(workdir, tmp_path / "b", resume=False), progress=False)
    assert fresh.step == 0


def test_resume_follows_a_changed_learning_rate(workdir, tmp_path):
    first = Trainer(tiny_config(workdir, tmp_path, steps=10), progress=False)
    first.train_step()
    first.save()
    resumed = Trainer(tiny_config(workdir, tmp_path, steps=10, lr=1e-3), progress=False)
    resumed.train_step()
    expected = 1e-3 * lr_factor(2, 1, 10, resumed.cfg.min_lr / 1e-3)  # the new lr's cosine at step 2
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [pytest.approx(expected)] * len(
        resumed.optimizer.param_groups)


def test_interrupted_save_keeps_the_last_checkpoint(workdir, tmp_path, monkeypatch):
    from dgemma.train import checkpoint

    trainer = Trainer(tiny_config(workdir, tmp_path), progress=False)
    trainer.train_step()
    good = trainer.save()
    trainer.train_step()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "replace_dir", boom)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    assert checkpoint.latest_state(tmp_path / "checkpoints") == good
    monkeypatch.undo()
    assert Trainer(tiny_config(workdir, tmp_path), progress=False).step == 1


def _logits(model, ids):
    """Encoder logits and decoder logits with a self-conditioning signal, for comparing weights."""
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        enc = model.head(model.encode(ids, cache))
        previous = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
        dec = model.head(model.denoise(torch.tensor([[3, 7, 9, 11]]), cache, model.soft_embed(previous)))
    return enc, dec


def test_run_exports_a_checkpoint_transformers_loads(workdir, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    from dgemma.weights import load_model
    from reference import reference_logits

    cfg = tiny_config(workdir, tmp_path, steps=2, eval_every=1, save_every=1)
    final = Trainer(cfg, progress=False).run()
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (final / name).is_file(), name
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert any("eval_diffusion" in r and "eval_ar" in r for r in log)
    ours = load_model(final)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(final).eval()
    prompt = torch.tensor([[2, 9, 10, 11, 12, 13, 14, 15, 16]])
    canvas = torch.tensor([[3, 7, 9, 11]])
    with torch.no_grad():
        ref_out = reference_logits(ref, prompt, [canvas])
        cache = ours.new_cache(1, 32)
        enc = ours.head(ours.encode(prompt, cache))
        dec = ours.head(ours.denoise(canvas, cache))
    assert torch.allclose(ref_out[0], enc, atol=1e-5) and torch.allclose(ref_out[1], dec, atol=1e-5)
    gen = DiffusionGemmaGenerationConfig.from_pretrained(final)
    assert gen.eos_token_id == [1, 5] and gen.sampler_config.entropy_bound == 0.1


def test_lora_trains_only_adapters_and_merges(workdir, tmp_path):
    from dgemma.train.command import add_arguments, run
    from dgemma.weights import load_model

    base = tmp_path / "base"
    Trainer(tiny_config(workdir, tmp_path / "scratch", steps=1), progress=False).run()
    (tmp_path / "scratch" / "final").rename(base)
    cfg = make_config(dict(model=str(base), train_data=str(workdir / "train.txt"), out=str(tmp_path / "lora"),
                           lora=True, lora_r=4, lora_alpha=8, lora_targets=["attention", "mlp", "experts"],
                           steps=2, batch_size=2, lr=5e-2, warmup=1, eval_every=0, save_minutes=1e9,
                           precision="float32", canvases=2, max_prompt=6))
    trainer = Trainer(cfg, progress=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("experts" in n for n in trainable) and any("q_proj" in n for n in trainable)
    final = trainer.run()
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trainable
    adapter = tmp_path / "lora" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    prompt = torch.tensor([[2, 9, 10, 11, 12]])
    adapted = _logits(trainer.model, prompt)
    base_logits = _logits(load_model(base), prompt)
    assert not torch.allclose(adapted[1], base_logits[1], atol=1e-4)  # the adapter does something
    for merged_dir in (final, tmp_path / "merged"):
        if merged_dir != final:
            parser = argparse.ArgumentParser()
            add_arguments(parser)
            assert run(parser.parse_args(["--merge-adapter", str(adapter), "--model", str(base),
                                          "--out", str(merged_dir)])) == 0
        merged = _logits(load_model(merged_dir), prompt)
        for a, m in zip(adapted, merged):
            assert torch.allclose(a, m, atol=1e-4)


def test_command_errors(workdir, tmp_path):
    from dgemma.train.command import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": 0, "train_data": "x", "model": "y"}')
    threads = tmp_path / "threads.json"
    threads.write_text('{"threads": 0, "train_data": "x", "model": "y"}')
    both = tmp_path / "both.json"
    both.write_text('{"train_data": "x", "model": "y", "model_config": {}}')
    cases = [([], "no training data"),
             (["--config", str(tmp_path / "nope.toml")], "config file not found"),
             (["--config", str(bad)], "steps=0 must be a positive integer"),
             (["--config", str(threads)], "threads=0 must be a positive integer"),  # was torch's RuntimeError
             (["--data", str(workdir / "train.txt")], r"nothing to train: give --model .* or --config with a file "
                                                      "whose model_config"),
             (["--config", str(both)], "sets both model .* and model_config"),
             (["--data", str(tmp_path / "none.txt"), "--model", str(tmp_path)], "no tokenizer.json")]
    for argv, message in cases:
        with pytest.raises(DgemmaError, match=message):
            run(parser.parse_args(argv))
    toml = tmp_path / "c.toml"
    toml.write_text('steps = 1\ntrain_data = "x"\nmodel = "y"\nbogus = 1\n')
    with pytest.raises(DgemmaError, match="unknown training option.*bogus"):
        run(parser.parse_args(["--config", str(toml)]))


def test_merge_adapter_errors_are_one_line(workdir, tmp_path):
    """A missing, malformed or mismatched adapter is a user mistake: a DgemmaError, and nothing is written."""
    from dgemma.train.command import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = tmp_path / "base"
    Trainer(tiny_config(workdir, tmp_path / "scratch", steps=1), progress=False).run()
    (tmp_path / "scratch" / "final").rename(base)
    garbled, empty, wrong = tmp_path / "garbled", tmp_path / "empty", tmp_path / "wrong"
    for d in (garbled, empty, wrong):
        d.mkdir()
    (garbled / "adapter_config.json").write_text("{not json")
    (wrong / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["no_such_module"]}))
    out = tmp_path / "merged"
    cases = [([str(empty), "--model", str(base)], "not a LoRA adapter directory"),
             ([str(garbled)], "not a valid adapter config"),
             ([str(garbled), "--model", str(base)], "cannot apply the adapter"),
             ([str(wrong), "--model", str(base)], "cannot apply the adapter")]
    for argv, message in cases:
        with pytest.raises(DgemmaError, match=message):
            run(parser.parse_args(["--merge-adapter", *argv, "--out", str(out)]))
        assert not out.exists()


def test_bf16_autocast_keeps_fp32_master_weights(workdir, tmp_path):
    trainer = Trainer(tiny_config(workdir, tmp_path, precision="bfloat16"), progress=False)
    assert trainer.amp == torch.bfloat16
    stats = trainer.train_step()
    assert math.isfinite(stats["loss"])
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())


def test_precision_and_save_dtype_use_the_dtype_vocabulary(workdir, tmp_path):
    from dgemma.errors import ConfigError

    for field, old in (("precision", "fp32"), ("precision", "bf16"), ("save_dtype", "bf16")):
        with pytest.raises(ConfigError, match=rf"^{field}='{old}' must be one of (auto, )?float32, bfloat16$"):
            tiny_config(workdir, tmp_path, **{field: old})
    assert tiny_config(workdir, tmp_path, precision="auto", save_dtype="bfloat16").precision == "auto"


def test_generation_config_comes_from_sampling_params(workdir, tmp_path):
    from dgemma.errors import CheckpointError, ConfigError
    from dgemma.sampling.params import SamplingParams
    from dgemma.train.checkpoint import generation_config

    default = SamplingParams()
    cfg = generation_config([1, 5], 0, 2)
    assert (cfg["max_new_tokens"], cfg["max_denoising_steps"], cfg["t_min"], cfg["t_max"]) == \
        (default.max_new_tokens, default.max_denoising_steps, default.t_min, default.t_max)
    assert cfg["sampler_config"] == {"entropy_bound": default.entropy_bound, "_cls_name": "EntropyBoundSamplerConfig"}
    assert cfg["eos_token_id"] == [1, 5]
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"t_max": 0.7, "sampler_config": {"entropy_bound": 0.3}, "return_dict_in_generate": True}))
    cfg = generation_config([1], 0, 2, {"t_min": 0.1}, tmp_path)
    assert (cfg["t_min"], cfg["t_max"], cfg["sampler_config"]["entropy_bound"]) == (0.1, 0.7, 0.3)
    assert cfg["return_dict_in_generate"] is True
    with pytest.raises(ConfigError, match="generation: unknown key"):
        tiny_config(workdir, tmp_path, generation={"temperature": 1.0})
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        generation_config([1], 0, 2, None, tmp_path)


def test_config_file_and_flags(workdir, tmp_path):
    from dgemma.train.command import _config_values, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    toml = tmp_path / "c.toml"
    toml.write_text(f'train_data = "{workdir / "train.txt"}"\nmodel = "m"\nsteps = 5\nlr = 1e-3\n'
                    'lora_targets = ["attention"]\n')
    values = _config_values(parser.parse_args(["--config", str(toml), "--steps", "7", "--lora",
                                               "--lora-targets", "attention,experts"]))
    cfg = make_config(values)
    assert (cfg.steps, cfg.lr, cfg.lora, cfg.lora_targets) == (7, 1e-3, True, ["attention", "experts"])
    assert cfg.lora_target_names() == (["q_proj", "k_proj", "v_proj", "o_proj"],
                                       ["experts.gate_up_proj", "experts.down_proj"])
    (tmp_path / "bad.toml").write_text("steps = \n")
    with pytest.raises(DgemmaError, match="invalid TOML"):
        _config_values(parser.parse_args(["--config", str(tmp_path / "bad.toml")]))


DEMO = Path(__file__).resolve().parent.parent / "dgemma" / "assets" / "demo"


@pytest.mark.skipif(not any(DEMO.glob("*.safetensors")), reason="the bundled demo model is not built")
def test_bundled_demo_model_matches_transformers():
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma.weights import load_model
    from reference import reference_logits

    assert sum(f.stat().st_size for f in DEMO.iterdir()) <= 30 * 2**20
    ours = load_model(DEMO, dtype=torch.float32)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(DEMO, dtype=torch.float32).eval()
    prompt = torch.tensor([[2, 1300, 200, 77, 3000, 15]])
    canvas = torch.randint(6, 4096, (1, ours.cfg.canvas_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference_logits(ref, prompt, [canvas])
        cache = ours.new_cache(1, 64)
        enc = ours.head(ours.encode(prompt, cache))
        dec = ours.head(ours.denoise(canvas, cache))
    assert torch.allclose(expected[0], enc, atol=1e-4) and torch.allclose(expected[1], dec, atol=1e-4)


def test_the_demo_config_builds_its_missing_corpus_and_tokenizer_first(tmp_path, monkeypatch, capsys):
    """A fresh clone has neither data/corpus nor data/tokenizer: `--config configs/demo.json` runs the checkout's
    scripts for what is missing (with a message naming it), once; a flag's own data or a failing script do not."""
    import shutil

    from dgemma.train.config import read_config_file
    from dgemma.train.demo_inputs import build_missing

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "configs").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "configs" / "demo.json", tmp_path / "configs" / "demo.json")
    log = tmp_path / "ran.txt"
    stub = ("import sys, pathlib\nargs = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
            f"open({str(log)!r}, 'a').write(pathlib.Path(sys.argv[0]).name + ' ' + ' '.join(sys.argv[1:]) + '\\n')\n"
            "out = pathlib.Path(args['--out']); out.mkdir(parents=True, exist_ok=True)\n")
    (tmp_path / "scripts" / "build_corpus.py").write_text(
        stub + "(out / 'train.txt').write_text('a'); (out / 'valid.txt').write_text('b')\n")
    (tmp_path / "scripts" / "train_tokenizer.py").write_text(stub + "(out / 'tokenizer.json').write_text('{}')\n")
    monkeypatch.chdir(tmp_path)
    values = read_config_file("configs/demo.json")
    build_missing("configs/demo.json", values | {"train_data": "mine.txt"})  # the user's data: nothing built
    assert not log.exists()
    build_missing("configs/demo.json", values)
    assert log.read_text().splitlines() == [
        "build_corpus.py --out data/corpus",
        "train_tokenizer.py --corpus data/corpus/train.txt --valid data/corpus/valid.txt --out data/tokenizer"]
    err = capsys.readouterr().err
    assert "data/corpus/train.txt is missing: building the demo corpus" in err
    assert "data/tokenizer/tokenizer.json is missing: training the demo tokenizer" in err
    build_missing("configs/demo.json", values)  # built: nothing runs again
    assert len(log.read_text().splitlines()) == 2
    (tmp_path / "data" / "tokenizer" / "tokenizer.json").unlink()
    (tmp_path / "scripts" / "train_tokenizer.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(DgemmaError, match=r"scripts/train_tokenizer.py failed \(exit status 3"):
        build_missing("configs/demo.json", values)
