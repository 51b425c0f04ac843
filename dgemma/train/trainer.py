"""The training loop: full fine-tuning or LoRA, AdamW with warmup + cosine, clipping, accumulation, bf16
autocast (over float32 master weights, or a bfloat16 frozen LoRA base), periodic held-out loss, exact resume and
an HF-layout export (LoRA merged on the CPU); in one process or on the ranks of torchrun (distributed.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from dgemma.config import ModelConfig
from dgemma.dtypes import native_bf16, parse_dtype
from dgemma.errors import DgemmaError
from dgemma.train import checkpoint as ckpt
from dgemma.train import distributed
from dgemma.train.config import TrainConfig
from dgemma.train.data import Loader, collate, load_dataset
from dgemma.train.objective import ObjectiveConfig, compute_losses

log = logging.getLogger(__name__)


def init_weights(model: torch.nn.Module, std: float) -> None:
    """From-scratch initialisation (the reference's): normal(0, std) matrices and experts, unit norms and scales."""
    from dgemma.model.layers import RMSNorm
    from dgemma.model.moe import Experts, Router

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, std)
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, Router):
                module.scale.fill_(1.0)
                module.per_expert_scale.fill_(1.0)
            elif isinstance(module, RMSNorm) and module.weight is not None:
                module.weight.fill_(1.0)


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The training compute dtype: `auto` is bfloat16 where bf16 matmuls are native, else float32."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device.type) else torch.float32
    return parse_dtype(precision, "precision")


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to 1, then cosine decay to `floor` (= min_lr / lr) at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, cfg: TrainConfig, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.par = distributed.setup(cfg)
        self.device = self.par.device
        self.out = Path(cfg.out)
        self.model_dir = checkpoint_dir(cfg.model) if cfg.model else None
        self.tokenizer_dir = Path(cfg.tokenizer) if cfg.tokenizer else self.model_dir
        self.tokenizer = _load_tokenizer(self.tokenizer_dir)
        dtype = compute_dtype(cfg.precision, self.device)
        self.amp = dtype if dtype != torch.float32 else None  # bf16 autocast
        self.model, self.peft = self._build_model(dtype)
        if cfg.activation_checkpointing:
            from dgemma.train.recompute import enable

            enable(self.model)
        distributed.spread(self.model, self.par, self.amp)
        self.model_cfg: ModelConfig = self.model.cfg
        self._check_vocab()
        self._load_data()
        self.objective = ObjectiveConfig(cfg.t_eps, cfg.self_cond_prob, cfg.ar_weight)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = _optimizer(self.params, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.tokens_seen = 0
        self.elapsed = 0.0
        self.history: list[dict[str, Any]] = []
        if cfg.resume and (state := ckpt.latest_state(self.out / "checkpoints")) is not None:
            self._restore(state)

    # -- setup ---------------------------------------------------------------------------------------------------

    def _build_model(self, dtype: torch.dtype):
        """Full training keeps float32 master weights; LoRA holds its frozen base in the compute dtype (bf16 halves
        it) and its adapters in float32 (peft's autocast_adapter_dtype)."""
        from dgemma.model import DiffusionGemma
        from dgemma.quant import parse_quantize
        from dgemma.weights import load_model

        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the from-scratch initialisation and peft's LoRA A matrices
        if cfg.model_config is not None:
            hf = {"model_type": "diffusion_gemma", **cfg.model_config}
            model = DiffusionGemma(ModelConfig.from_hf(hf))
            init_weights(model, cfg.init_std)
            model = model.to(self.device)
        else:
            model = load_model(self.model_dir, dtype=dtype if cfg.lora else torch.float32, device=self.device,
                               quantize=parse_quantize(cfg.quantize))
        model.train()
        model.requires_grad_(not cfg.lora)
        peft = None
        if cfg.lora:
            from dgemma.train.lora import apply_lora

            modules, params = cfg.lora_target_names()
            peft = apply_lora(model, cfg.lora_r, cfg.lora_alpha, modules, params)
        return model, peft

    def _load_data(self) -> None:
        cfg, c = self.cfg, self.model_cfg.canvas_length
        self.eos = self.tokenizer.token_id(self.tokenizer.eos_token)
        data = load_dataset(cfg.train_data, self.tokenizer, c, cfg.canvases, cfg.max_prompt, cfg.seed)
        self.loader = Loader(data, cfg.batch_size, c, self.eos, cfg.seed)
        self.valid = None
        if cfg.valid_data:
            vdata = load_dataset(cfg.valid_data, self.tokenizer, c, cfg.canvases, cfg.max_prompt, cfg.seed + 1)
            n = min(len(vdata), cfg.eval_batches * cfg.batch_size)
            self.valid = [collate([vdata.get(j, 0) for j in range(i, min(n, i + cfg.batch_size))], c, self.eos)
                          for i in range(0, n, cfg.batch_size)]
            # under torchrun every rank scores rows of every batch: a last one with fewer rows than ranks is left out
            self.valid = [b for b in self.valid if b.ids.shape[0] >= self.par.world]

    def _check_vocab(self) -> None:
        vocab = self.model_cfg.text.vocab_size
        if self.tokenizer.vocab_size > vocab:
            raise DgemmaError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model only {vocab}")

    # -- state ---------------------------------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def save(self) -> Path:
        extra = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "loader": self.loader.state_dict(),
        }
        meta = {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed": self.elapsed,
                "history": self.history, "config": self.cfg.to_dict()}
        root = self.out / "checkpoints"
        if self.par.world > 1:
            state = distributed.training_state(self.model, self.optimizer)
            return ckpt.save_sharded_state(root, self.step, state, extra, meta, self.cfg.keep_checkpoints, self.par)
        return ckpt.save_state(root, self.step, self.trainable_state(), extra, meta, self.cfg.keep_checkpoints)

    def _restore(self, path: Path) -> None:
        weights, extra, meta = ckpt.load_state(path)
        ckpt.check_resumable(path, meta, self.cfg.to_dict())
        if weights is None:
            state = distributed.training_state(self.model, self.optimizer)
            ckpt.load_sharded_state(path, state)
            distributed.load_training_state(self.model, self.optimizer, state)
        else:
            self._load_weights(path, weights, extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scheduler.base_lrs = [self.cfg.lr for _ in self.scheduler.base_lrs]  # a changed --lr, like --steps
        self.generator.set_state(extra["generator"])
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["python_rng"])
        self.loader.load_state_dict(extra["loader"])
        self.step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        self.elapsed, self.history = meta["elapsed"], meta["history"]
        log.info("resumed from %s (step %d)", path, self.step)

    def _load_weights(self, path: Path, weights: dict[str, torch.Tensor], optimizer: dict) -> None:
        """A one-process state: whole trainable weights, the optimizer state by parameter index."""
        params = dict(self.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
        if missing or any(n not in params or params[n].shape != w.shape for n, w in weights.items()):
            raise DgemmaError(f"{path}: the saved training state does not fit this model / LoRA setup; "
                              "use another --out or --no-resume")
        if self.par.world > 1:
            return distributed.load_whole_state(self.model, self.optimizer, weights, optimizer)
        with torch.no_grad():
            for n, w in weights.items():
                params[n].copy_(w)
        self.optimizer.load_state_dict(optimizer)

    # -- training ------------------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One optimizer step over grad_accum micro-batches; returns the step's mean losses and token count."""
        cfg = self.cfg
        diff = ar = 0.0
        tokens = 0
        for _ in range(cfg.grad_accum):
            batch = self.loader.next()
            losses = compute_losses(self.model, batch, self.objective, self.generator, self.amp, self.par.part)
            (losses.total / cfg.grad_accum).backward()
            diff += losses.diffusion / cfg.grad_accum
            ar += losses.autoregressive / cfg.grad_accum
            tokens += batch.tokens
        distributed.average_gradients(self.params, self.par)
        norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.clip) if cfg.clip > 0 else torch.tensor(0.0)
        norm = distributed.local(norm)
        diff, ar = self.par.mean([diff, ar])
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += tokens
        total = diff + cfg.ar_weight * ar
        return {"loss": total, "diffusion": diff, "ar": ar, "grad_norm": float(norm), "lr": lr, "tokens": tokens}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Held-out losses on fixed batches with fixed noise (comparable across steps and runs)."""
        if not self.valid:
            return None
        self.model.eval()
        g = torch.Generator().manual_seed(self.cfg.seed + 12345)
        diff = ar = 0.0
        canvas_tokens = ar_tokens = 0
        for batch in self.valid:
            losses = compute_losses(self.model, batch, self.objective, g, self.amp, self.par.part)
            diff += losses.diffusion * losses.canvas_tokens
            ar += losses.autoregressive * losses.ar_tokens
            canvas_tokens += losses.canvas_tokens
            ar_tokens += losses.ar_tokens
        self.model.train()
        distributed.after_eval(self.model)
        diff, ar = self.par.mean([diff, ar])
        return {"eval_diffusion": diff / canvas_tokens, "eval_ar": ar / max(1, ar_tokens)}

    def run(self) -> Path:
        """Train to cfg.steps (or cfg.max_minutes), checkpointing along the way; export and return out/final."""
        self.fit()
        return self.export()

    def fit(self) -> None:
        from tqdm import tqdm

        main = self.par.main  # one rank writes the log and prints
        self.out.mkdir(parents=True, exist_ok=True)
        if main:
            (self.out / "train_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        logfile = (self.out / "log.jsonl").open("a") if main else open(os.devnull, "w")
        bar = tqdm(total=self.cfg.steps, initial=self.step, disable=not (self.progress and main), dynamic_ncols=True,
                   mininterval=1.0, unit="step")
        try:
            self._loop(bar, logfile)
        except KeyboardInterrupt:
            bar.close()
            state = ckpt.latest_state(self.out / "checkpoints")
            where = f"last checkpoint: {state}" if state else "no checkpoint was written yet"
            if main:
                print(f"interrupted at step {self.step}; {where} (rerun the same command to resume)")
            raise
        finally:
            bar.close()
            logfile.close()

    def _loop(self, bar, logfile) -> None:
        cfg = self.cfg
        last_save, start, window = time.time(), time.time() - self.elapsed, []
        while self.step < cfg.steps:
            t0 = time.time()
            stats = self.train_step()
            window = (window + [(stats["tokens"], time.time() - t0)])[-20:]
            self.elapsed = time.time() - start
            tok_s = sum(n for n, _ in window) / max(1e-9, sum(dt for _, dt in window))
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", diff=f"{stats['diffusion']:.3f}",
                            ar=f"{stats['ar']:.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
            last = self.step == cfg.steps
            if self.step % cfg.log_every == 0 or last:
                self._log(logfile, {"step": self.step, **stats, "tok_s": tok_s,
                                    "tokens_seen": self.tokens_seen, "elapsed": round(self.elapsed, 1)})
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or last):
                self._evaluate_and_log(bar, logfile)
            timeout = cfg.max_minutes is not None and self.elapsed >= cfg.max_minutes * 60
            due = (cfg.save_every and self.step % cfg.save_every == 0) or \
                time.time() - last_save >= cfg.save_minutes * 60
            if self.par.world > 1:  # clocks differ: a rank that wants to save or stop makes all of them do it
                due, timeout = (v > 0 for v in self.par.mean([float(due), float(timeout)]))
            if due or timeout or last:
                self.save()
                last_save = time.time()
            if timeout:
                if self.par.main:
                    bar.write(f"stopping at step {self.step}: max_minutes={cfg.max_minutes} reached")
                break

    def _evaluate_and_log(self, bar, logfile) -> None:
        if (ev := self.evaluate()) is None:
            return
        record = {"step": self.step, "tokens_seen": self.tokens_seen, **ev}
        self.history.append(record)
        self._log(logfile, record)
        if self.par.main:
            bar.write(f"step {self.step}: held-out diffusion {ev['eval_diffusion']:.4f}, "
                      f"autoregressive {ev['eval_ar']:.4f}")

    def _log(self, f, record: dict[str, Any]) -> None:
        f.write(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in record.items()}) + "\n")
        f.flush()

    # -- export --------------------------------------------------------------------------------------------------

    def generation_config(self) -> dict[str, Any]:
        tok = self.tokenizer
        eos = [i for i in (tok.token_id(tok.eos_token), tok.token_id("<end_of_turn>")) if i is not None]
        pad = tok.token_id("<pad>")
        return ckpt.generation_config(eos, 0 if pad is None else pad, tok.token_id(tok.bos_token) or 2,
                                      self.cfg.generation, self.model_dir)

    def export(self) -> Path:
        """out/final: a full HF-layout checkpoint; with LoRA also out/adapter, merged into the base on the CPU
        (the training model is left as it is and never copied on its device)."""
        from dgemma.train.lora import export_merged, save_adapter

        dtype, final = parse_dtype(self.cfg.save_dtype), self.out / "final"
        if self.par.world > 1:
            return self._export_gathered(dtype, final)
        if self.peft is None:
            return ckpt.export_model(self.model, final, self.tokenizer_dir, self.generation_config(), dtype)
        tmp = self.out / "adapter.tmp"
        save_adapter(self.peft, tmp, self.cfg.model)
        ckpt.replace_dir(tmp, self.out / "adapter")
        return export_merged(self.model_dir, self.out / "adapter", final, self.tokenizer_dir,
                             self.generation_config(), dtype)

    def _export_gathered(self, dtype: torch.dtype, final: Path) -> Path:
        """torchrun: the weights (or the adapter) gathered whole on the main rank, which writes what one process
        would; the other ranks wait."""
        from dgemma.train.lora import export_merged, save_adapter

        state = distributed.gathered_state(self.model, trainable_only=self.peft is not None)
        if self.par.main and self.peft is None:
            model = distributed.plain_model(self.model_cfg, state)
            ckpt.export_model(model, final, self.tokenizer_dir, self.generation_config(), dtype)
        elif self.par.main:
            tmp = self.out / "adapter.tmp"
            save_adapter(self.peft, tmp, self.cfg.model, {f"base_model.model.{k}": v for k, v in state.items()})
            ckpt.replace_dir(tmp, self.out / "adapter")
            export_merged(self.model_dir, self.out / "adapter", final, self.tokenizer_dir,
                          self.generation_config(), dtype)
        self.par.barrier()
        return final


def _optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig):
    """AdamW (no weight decay on vectors) and its warmup + cosine schedule."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps)
    floor = cfg.min_lr / cfg.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps, floor))
    return optimizer, scheduler


def checkpoint_dir(model: str) -> Path:
    from dgemma.api.checkpoint import locate

    directory, gguf = locate(model)
    if gguf:
        raise DgemmaError(f"model {model}: training reads a checkpoint directory, not a GGUF file")
    return directory


def _load_tokenizer(directory: Path):
    from dgemma.tokenizer import Tokenizer

    if not (directory / "tokenizer.json").is_file():
        raise DgemmaError(f"{directory}: no tokenizer.json (set tokenizer to a directory that has one)")
    return Tokenizer(directory)


def train(cfg: TrainConfig, progress: bool = True) -> Path:
    trainer = Trainer(cfg, progress)
    try:
        return trainer.run()
    finally:
        distributed.close(trainer.par)
