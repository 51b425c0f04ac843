"""Training past one process: the data split, activation checkpointing (identical gradients, cache writes once),
2 gloo ranks under torchrun against one process (FSDP full fine-tuning, LoRA under FSDP and DDP), sharded
checkpoints resumed on 1 and 2 ranks, and the bad-input errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dgemma.errors import ConfigError, DgemmaError
from dgemma.train import distributed
from dgemma.train.config import make_config
from dgemma.train.data import Example, collate, rows_of_rank
from dgemma.train.objective import ObjectiveConfig, compute_losses
from dgemma.train.trainer import Trainer
from test_train import TINY, _tiny_model, make_tokenizer, write_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    make_tokenizer(d / "tok")
    write_text(d / "train.txt", docs=12)
    write_text(d / "valid.txt", docs=3, seed=1)
    return d


def values(workdir: Path, out: Path, **over) -> dict:
    v = dict(model_config=TINY, tokenizer=str(workdir / "tok"), train_data=str(workdir / "train.txt"),
             valid_data=str(workdir / "valid.txt"), out=str(out), canvases=2, max_prompt=6, batch_size=4, steps=4,
             lr=1e-2, warmup=1, eval_every=2, eval_batches=2, save_every=2, save_minutes=1e9, precision="float32",
             log_every=1)
    v.update(over)
    return v


def torchrun(world: int, config: dict, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node world -m dgemma train --config ...` on this machine (gloo)."""
    path = Path(config["out"]).with_suffix(".json")
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), "-m", "dgemma", "train", "--config", str(path), "--no-progress", *flags],
                          capture_output=True, text=True, env=env, timeout=900)
    if check and proc.returncode != 0 and not teardown_abort_only(proc, config):
        raise AssertionError(proc.stderr[-4000:])
    return proc


def teardown_abort_only(proc: subprocess.CompletedProcess, config: dict) -> bool:
    """A rank aborted by C++ after the run had written everything (the exported model, the last step's log): seen
    once in CI ("terminate called without an active exception", no Python traceback), never reproduced here in 30
    runs. What these tests compare was done, so they go on to compare it; the abort is reported as a warning."""
    out = Path(config["out"])
    if "terminate called" not in proc.stderr or not (out / "final" / "model.safetensors").is_file():
        return False
    if max(losses(out)["train"], default=0) != config["steps"]:
        return False
    warnings.warn(f"torchrun exited {proc.returncode}: a rank aborted after the run finished\n{proc.stderr[-1500:]}")
    return True


def losses(out: Path) -> dict[int, tuple[float, ...]]:
    """step -> (loss, diffusion, ar) or (eval_diffusion, eval_ar) from log.jsonl (last record per step wins)."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    train = {r["step"]: (r["loss"], r["diffusion"], r["ar"]) for r in records if "loss" in r}
    evals = {r["step"]: (r["eval_diffusion"], r["eval_ar"]) for r in records if "eval_diffusion" in r}
    return {"train": train, "eval": evals}


def assert_same_curve(a: dict, b: dict, steps) -> None:
    for kind in ("train", "eval"):
        for step in steps:
            if step in a[kind] or step in b[kind]:
                for x, y in zip(a[kind][step], b[kind][step]):
                    assert x == pytest.approx(y, rel=1e-5, abs=2e-5), (kind, step, a[kind][step], b[kind][step])


# ---- in one process ---------------------------------------------------------------------------------------------

def test_rows_of_rank_split_every_row_once():
    for batch in (1, 4, 7, 8):
        for world in (1, 2, 3, 4):
            rows = [i for r in range(world) for i in range(batch)[rows_of_rank(batch, r, world)]]
            assert rows == list(range(batch))


def test_ranks_losses_average_to_the_global_loss_and_gradient():
    """compute_losses with part=(rank, 2): the mean of the two ranks' losses and gradients is the whole batch's,
    with rows of different lengths (different encoder-loss token counts per rank)."""
    batch = collate([Example([2, 9, 10, 11], list(range(16, 27))), Example([2, 7], [20, 21, 22]),
                     Example([2], [12, 13]), Example([2, 3, 4, 5, 6, 7], list(range(8, 20)))], 4, eos=1)
    cfg = ObjectiveConfig(self_cond_prob=0.5)
    model = _tiny_model()
    whole = compute_losses(model, batch, cfg, torch.Generator().manual_seed(2))
    expected = torch.autograd.grad(whole.total, list(model.parameters()), allow_unused=True)
    parts = [compute_losses(model, batch, cfg, torch.Generator().manual_seed(2), part=(r, 2)) for r in range(2)]
    grads = [torch.autograd.grad(p.total, list(model.parameters()), allow_unused=True) for p in parts]
    assert sum(p.diffusion for p in parts) / 2 == pytest.approx(whole.diffusion, rel=1e-6)
    assert sum(p.autoregressive for p in parts) / 2 == pytest.approx(whole.autoregressive, rel=1e-6)
    for e, g0, g1 in zip(expected, *grads):
        if e is not None:
            assert torch.allclose((g0 + g1) / 2, e, rtol=1e-4, atol=1e-5 * float(e.abs().max()))


def test_activation_checkpointing_gives_identical_gradients_and_writes_the_cache_once(monkeypatch):
    from dgemma.cache import KVCache
    from dgemma.train.recompute import enable

    batch = collate([Example([2, 9, 10, 11], list(range(16, 27))), Example([2, 7], [20, 21, 22])], 4, eos=1)
    results = []
    for checkpointed in (False, True):
        model = _tiny_model()
        if checkpointed:
            enable(model)
        writes = []
        original = KVCache.view  # in training only the encoder writes (the decoder reads the cache in its graph)
        monkeypatch.setattr(KVCache, "view", lambda self, *a: (writes.append(a[0]), original(self, *a))[1])
        out = compute_losses(model, batch, ObjectiveConfig(self_cond_prob=1.0, ar_weight=0.5),
                             torch.Generator().manual_seed(1))
        out.total.backward()
        monkeypatch.undo()
        assert writes == list(range(model.cfg.text.num_hidden_layers))  # the encoder's, once per layer
        results.append((out.total.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(g is not None for g in grads_b.values())
    for name, g in grads_a.items():
        assert torch.allclose(g, grads_b[name], rtol=1e-5, atol=1e-7), name


def test_bad_launches_are_one_line_errors(workdir, tmp_path, monkeypatch):
    cfg = make_config(values(workdir, tmp_path / "x", batch_size=3))
    with pytest.raises(ConfigError, match="batch_size=3 is not divisible by the 2 ranks"):
        distributed.check(cfg, 2, 0)
    distributed.check(cfg, 1, 0)  # one process: any batch size
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="nccl needs CUDA GPUs and this machine has none"):
        distributed.check(make_config(values(workdir, tmp_path / "x", backend="nccl")), 2, 0)
    with pytest.raises(ConfigError, match="parallel='zero3' must be one of fsdp, ddp"):
        make_config(values(workdir, tmp_path / "x", parallel="zero3"))
    first = Trainer(make_config(values(workdir, tmp_path / "r", steps=1)), progress=False)
    first.train_step()
    first.save()
    with pytest.raises(DgemmaError, match=r"was trained with batch_size=4 \(now 2\)"):
        Trainer(make_config(values(workdir, tmp_path / "r", batch_size=2)), progress=False)


def test_interrupted_sharded_save_keeps_the_last_complete_state(tmp_path, monkeypatch):
    """A rank killed (here: Ctrl-C) while a sharded state is written leaves `latest` on the previous one."""
    from dgemma.train import checkpoint

    par = distributed.Parallel(torch.device("cpu"))
    root = tmp_path / "checkpoints"
    state = {"model": {"w": torch.arange(4.0)}}
    good = checkpoint.save_sharded_state(root, 1, state, {"x": 1}, {"step": 1}, 2, par)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "replace_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_sharded_state(root, 2, {"model": {"w": torch.zeros(4)}}, {"x": 2}, {"step": 2}, 2, par)
    assert checkpoint.latest_state(root) == good
    loaded = {"model": {"w": torch.zeros(4)}}
    checkpoint.load_sharded_state(good, loaded)
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))
    with pytest.raises(DgemmaError, match="does not fit this model / LoRA setup"):
        checkpoint.load_sharded_state(good, {"model": {"w": torch.zeros(5)}})


# ---- 2 gloo ranks under torchrun ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_runs(workdir):
    """The same 4-step full fine-tuning in one process and on 2 FSDP ranks (checkpoints at steps 2 and 4)."""
    one = workdir / "one"
    Trainer(make_config(values(workdir, one)), progress=False).run()
    two = workdir / "two"
    torchrun(2, values(workdir, two))
    return one, two


@pytest.mark.slow
def test_two_fsdp_ranks_follow_the_one_process_loss_curve(full_runs):
    from safetensors.torch import load_file

    one, two = full_runs
    assert_same_curve(losses(one), losses(two), range(1, 5))
    assert (two / "checkpoints" / "step-0000004" / "sharded").is_dir()  # sharded state
    assert not (one / "checkpoints" / "step-0000004" / "sharded").exists()  # one process: as before
    a, b = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-3) for k in a)  # 4 steps at lr 1e-2 from float rounding


def resumable_at_step_2(source: Path, out: Path) -> Path:
    shutil.copytree(source / "checkpoints", out / "checkpoints")
    shutil.rmtree(out / "checkpoints" / "step-0000004")
    (out / "checkpoints" / "latest").write_text("step-0000002\n")
    return out


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_ranks(workdir, full_runs):
    one, _ = full_runs
    out = resumable_at_step_2(one, workdir / "resume-one-on-2")
    torchrun(2, values(workdir, out))
    assert_same_curve(losses(one), losses(out), (3, 4))


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_and_two_ranks(workdir, full_runs):
    _, two = full_runs
    expected = losses(two)
    for ranks in (1, 2):
        out = resumable_at_step_2(two, workdir / f"resume-{ranks}")
        if ranks == 1:
            trainer = Trainer(make_config(values(workdir, out)), progress=False)
            assert trainer.step == 2
            trainer.fit()
        else:  # and with activation checkpointing, which must not change a number
            torchrun(2, values(workdir, out), "--activation-checkpointing")
        assert_same_curve(expected, losses(out), (3, 4))
    with pytest.raises(DgemmaError, match="does not fit this model"):  # another architecture
        wider = {**TINY, "text_config": {**TINY["text_config"], "intermediate_size": 48}}
        Trainer(make_config(values(workdir, workdir / "resume-2", model_config=wider)), progress=False)


@pytest.mark.slow
def test_lora_under_fsdp_and_ddp_follow_one_process(workdir):
    from safetensors.torch import load_file

    base = workdir / "base"
    if not base.exists():
        Trainer(make_config(values(workdir, workdir / "scratch", steps=1, eval_every=0)), progress=False).run()
        (workdir / "scratch" / "final").rename(base)
    lora = dict(model=str(base), model_config=None, lora=True, lora_r=4, lora_alpha=8, steps=2, save_every=0,
                lora_targets=["attention", "mlp", "experts"], lr=5e-2, eval_every=2)
    one = workdir / "lora-one"
    Trainer(make_config(values(workdir, one, **lora)), progress=False).run()
    reference = load_file(one / "adapter" / "adapter_model.safetensors")
    for parallel in ("fsdp", "ddp"):
        out = workdir / f"lora-{parallel}"
        torchrun(2, values(workdir, out, **lora, parallel=parallel))
        assert_same_curve(losses(one), losses(out), range(1, 3))
        adapter = load_file(out / "adapter" / "adapter_model.safetensors")
        assert adapter.keys() == reference.keys()
        assert all(torch.allclose(adapter[k], reference[k], atol=1e-4) for k in adapter)
        assert (out / "final" / "model.safetensors").is_file()
