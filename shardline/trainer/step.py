"""The optimizer step: forward, loss and backward of each micro-batch, clipping, the update (AdamW, or the model's
own optimizer and schedule: `configure_optimizers`); the learning rate of each step; and, with several processes
(DDP), each rank's weight in the global batch."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from shardline.core.config import TrainingConfig
from shardline.trainer.contract import (
    DataSpec,
    as_outputs,
    batch_targets,
    check_loss,
    check_outputs,
    check_own_metrics,
    model_loss,
    own_hook,
    own_optimizer,
)
from shardline.trainer.device import autocast, needs_grad_scaler
from shardline.trainer.distributed import World, rank_bounds
from shardline.trainer.graphed import GraphedStep, graphs_blocker, match_optimizer, set_lr
from shardline.trainer.state import seed_rank


def lr_at(step: int, cfg: TrainingConfig, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr_ratio*lr, or constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return cfg.lr
    ratio = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    min_lr = cfg.min_lr_ratio * cfg.lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - min_lr)


def make_optimizer(model: nn.Module, cfg: TrainingConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (Linear / attention weights) only, not on biases, norms or embeddings:
    decaying an embedding table shrinks rare categories towards zero just for being rare."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen ones (training.freeze) are left alone
    decay = [p for p in trained if p.dim() >= 2 and id(p) not in embeddings]
    rest = [p for p in trained if not (p.dim() >= 2 and id(p) not in embeddings)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=device.type == "cuda")


def planned_steps(train_windows: int, cfg: TrainingConfig) -> tuple[int, int]:
    """(optimizer steps per epoch, in all) of a run on `train_windows` windows: a last short batch and a last
    short group of micro-batches count; `max_steps_per_epoch` caps an epoch."""
    batches = -(-train_windows // cfg.batch_size)
    per_epoch = -(-batches // cfg.grad_accum)
    if cfg.max_steps_per_epoch:
        per_epoch = min(per_epoch, cfg.max_steps_per_epoch)
    return per_epoch, cfg.epochs * per_epoch


class Step:
    """The model, its optimizer and loss scaler, and the step that trains them. The unwrapped `model` is what is
    saved, validated and handed back; with several processes the step goes through DDP, whose backward averages
    the ranks' gradients (each rank's loss is weighted so that the average is the gradient of the global batch)."""

    def __init__(
        self, model: nn.Module, cfg: TrainingConfig, spec: DataSpec, device, precision, ranks: World, total: int, log
    ):
        self.model, self.cfg, self.spec, self.device, self.ranks, self.log = model, cfg, spec, device, ranks, log
        self.total = total  # optimizer steps in the run, for the schedule
        self.metric_names: set[str] = set()  # the validation's own metrics: a model's own may not take them
        # training.compile: the step's forward compiled; the module itself (its state_dict) is what is saved
        self.forward = torch.compile(model) if cfg.compile else model
        # the model's own optimizer and scheduler (configure_optimizers), else AdamW on training.lr's schedule
        own = own_optimizer(model) if hasattr(model, "configure_optimizers") else None
        self.optimizer, self.scheduler, self.interval = own or (make_optimizer(model, cfg, device), None, None)
        # the model's own rates, which training.lr's schedule scales when it brings no scheduler of its own
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups] if own else None
        if own:
            log(
                f"{type(model).__name__}.configure_optimizers: {type(self.optimizer).__name__}, "
                f"{len(self.base_lrs)} parameter group(s), "
                + (
                    f"{type(self.scheduler).__name__} every {self.interval}"
                    if self.scheduler is not None
                    else "each group's rate on training.lr's schedule (warm-up, decay)"
                )
            )
        self.scaler = torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(precision))
        # training.cuda_graphs: null (the default) captures on a CUDA device whenever nothing below rules it out
        wanted = cfg.cuda_graphs is not False
        blocker = graphs_blocker(device, precision, ranks.size) if wanted else None
        if wanted and own and blocker is None:
            blocker = "the model brings its own optimizer (configure_optimizers), which a captured step does not replay"
        self.graphs = wanted and blocker is None
        if blocker and (cfg.cuda_graphs or device.type == "cuda"):  # the default says nothing on the CPU
            setting = "is set" if cfg.cuda_graphs else "is null (capture where it can)"
            log(f"note: training.cuda_graphs {setting}, but every step runs eagerly: {blocker}")
        # chosen once: every precision shares the one step below (a captured step recomputes its casts)
        self.ctx = autocast(device, precision, cache=not self.graphs)
        self.ddp = self.graphed = None
        self.checked = False  # the model contract, checked on the run's first batch
        self.number = 0  # the step being taken (1-based), as an error about its loss names it

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            **({"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}),
        }

    def load_state_dict(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.scaler.is_enabled() and ckpt["scaler"]:
            self.scaler.load_state_dict(ckpt["scaler"])
        if self.scheduler is not None and ckpt.get("scheduler") is not None:
            self.scheduler.load_state_dict(ckpt["scheduler"])

    def lr(self, number: int) -> float:
        """The learning rate of optimizer step `number` (0-based), the first parameter group's: training.lr's
        schedule; the model's own rates on that schedule; or what the model's own scheduler set."""
        if self.scheduler is not None:
            return float(self.optimizer.param_groups[0]["lr"])
        scheduled = lr_at(number, self.cfg, self.total)
        return scheduled if self.base_lrs is None else self.base_lrs[0] * scheduled / self.cfg.lr

    def _set_lr(self, number: int) -> None:
        if self.scheduler is not None:  # the model's own scheduler sets the rates
            return
        scheduled = lr_at(number, self.cfg, self.total)
        if self.base_lrs is None:
            set_lr(self.optimizer, scheduled)
        else:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * scheduled / self.cfg.lr

    def epoch_end(self) -> None:
        """The model's own scheduler, stepped once an epoch (`interval: epoch`, Lightning's default)."""
        if self.scheduler is not None and self.interval == "epoch":
            self.scheduler.step()

    def start(self, fresh: bool) -> None:
        """After any `load_state_dict`: the optimizer in the form this run steps it, DDP, the captured step."""
        match_optimizer(self.optimizer, self.device, self.graphs)  # also over a checkpoint's groups
        if self.ranks.distributed:
            from torch.nn.parallel import DistributedDataParallel

            cuda = self.device.type == "cuda"
            self.ddp = DistributedDataParallel(self.model, device_ids=[torch.cuda.current_device()] if cuda else None)
            self.forward = torch.compile(self.ddp) if self.cfg.compile else self.ddp
            if fresh and self.ranks.rank:  # the same weights everywhere (seeded alike), but each rank its own dropout
                seed_rank(self.cfg.seed, self.ranks.rank, 0)
        if self.graphs:  # training.cuda_graphs: full steps (grad_accum full batches) replay one captured graph
            self.graphed = GraphedStep(
                lambda bs: self.run(bs, [len(b) for b in bs], [1.0] * len(bs), sum(len(b) for b in bs)),
                (self.cfg.batch_size,) * self.cfg.grad_accum,
                self.optimizer,
                [p for p in self.model.parameters() if p.requires_grad],
                self.device,
                self.log,
                chosen=self.cfg.cuda_graphs is True,
            )

    def shares(self, micro: list, n_step: int) -> tuple[list[int], list[float]]:
        """(this rank's real windows, the weight of its loss) of each micro-batch. DDP averages the ranks'
        gradients, so a rank's batch-mean loss weighs real * W / k (exactly the mean over the global batch, also
        for an uneven last batch; an empty share trains one window at weight 0)."""
        if self.ddp is None:
            return [len(m) for m in micro], [1.0] * len(micro)
        size, bs = self.ranks.size, self.cfg.batch_size
        ks = [min(bs, n_step - i * bs) for i in range(len(micro))]
        real = [hi - lo for lo, hi in (rank_bounds(k, self.ranks.rank, size) for k in ks)]
        return real, [r * size / k for r, k in zip(real, ks)]

    def __call__(self, micro: list, n_step: int, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Optimizer step `number` (1-based) on `micro` (its global batches hold `n_step` windows): (the step's
        loss, the global batch's mean; this process's part of the epoch's loss sum), on the device."""
        self.number = number
        self._set_lr(number - 1)
        if self.graphed is not None and self.graphed.takes(micro):
            out = self.graphed(micro)
        else:
            out = self.run(micro, *self.shares(micro, n_step), n_step)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.interval == "step":
            self.scheduler.step()
        return out

    def run(self, micro: list, real: list[int], weight: list[float], n_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step itself. No value is read back here: a CUDA graph can capture this function whole."""
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        part = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro):
            b = batch.to(self.device, non_blocking=True)
            targets = batch_targets(self.spec, b)
            with self.ctx:
                outputs = as_outputs(self.forward(b.cont, b.cat), self.spec)
                if not self.checked:  # the contract, on the run's first batch: before any step is taken
                    check_outputs(outputs, self.spec, len(b))
                    if (own := own_hook(self.model, "metrics")) is not None:
                        with torch.no_grad():
                            check_own_metrics(own(outputs, b.cont, b.cat, targets), self.model, self.metric_names)
                loss = model_loss(self.model, outputs, b.cont, b.cat, targets, self.spec, self.cfg.loss_weights)
            if not self.checked:
                check_loss(loss, self.number, self.model, outputs)
                self.checked = True
            # gradients add up over micro-batches: scale each so the step follows their mean
            # (len(micro) is grad_accum except for an epoch's last, shorter group)
            if self.ddp is None:
                self.scaler.scale(loss / len(micro)).backward()
            else:  # the ranks' gradients are averaged once, at the step's last micro-batch
                with self.ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    self.scaler.scale(loss * weight[i] / len(micro)).backward()
            step_loss += loss.detach().double() * (real[i] / n_step)
            part += loss.detach().double() * (len(b) if self.ddp is None else real[i])
        if self.cfg.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the loss-scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return step_loss, part
