"""The model contract: what Shardline gives a model, what it expects back, and the default loss.

A model (a built-in family or the user's own, named by `model.entrypoint: "package.module:Name"`)
is built as `Name(spec, **model.params)`, where `spec` is a `DataSpec`: the feature names by role,
the width of the `cont` tensor, each categorical column's cardinality, the window K and each
target's name, kind and positions. `forward(cont, cat)` takes `cont` [B, K, n_cont] float and `cat`
[B, K, n_cat] int64 and returns `{target_name: tensor}`: [B, n_classes] (classification) or [B]
(regression) per target, [B, K, n_classes] or [B, K] when the target is predicted at every position.
A model may define `loss(outputs, cont, cat, targets) -> scalar tensor` to replace the default loss
(cross-entropy or MSE on the standardised value, per target, summed with `training.loss_weights`);
that is how a model with no target at all (self-supervised) trains, and its optional
`metrics(outputs, cont, cat, targets) -> {name: scalar}` is reported beside its loss. The loop,
checkpoints, exact resume, AMP, evaluation and registration treat every model the same.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
import types
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy


class ModelContractError(ValueError):
    """A model that does not keep the contract: the message names the entrypoint, the target and the fix."""


@dataclass(frozen=True)
class TargetInfo:
    """One predicted target: `name` (its column), `kind` (classification or regression), `n_classes`
    (classification: the vocabulary size, id 0 being a class never seen in training) and `positions`
    (`last`: one prediction per window, for the row `horizon` rows after its last; `all`: one per row of
    the window, each for the row `horizon` rows after it)."""

    name: str
    kind: str
    n_classes: int | None = None
    positions: str = "last"

    def expected_shape(self, batch: int, window: int = 1) -> tuple[int, ...]:
        lead = (batch, window) if self.positions == "all" else (batch,)
        return (*lead, self.n_classes) if self.kind == "classification" else lead


@dataclass(frozen=True)
class DataSpec:
    """What a model sees: built once from the encoding, passed to the model's constructor."""

    continuous: list[str]
    boolean: list[str]
    categorical: list[str]
    cardinalities: list[int]  # one per column of `cat`: the categorical columns, then the boolean ones (3 ids)
    window: int
    targets: list[TargetInfo] = field(default_factory=list)
    # text data (data.features.text): {"vocab_size", "pad_id": 0, "sep_id": 1, "eos_id": 2, "target_column"
    # (a generation target's column, or None when pre-training)}; `cat` is then [B, K, 1] token ids and a
    # target of 0 (<pad>) is ignored by the default loss and the metrics. None for other data.
    text: dict | None = None

    @property
    def n_cont(self) -> int:
        return len(self.continuous)

    @property
    def n_cat(self) -> int:
        return len(self.cardinalities)

    @property
    def cat_columns(self) -> list[str]:
        """The columns of the `cat` tensor, in order."""
        return [*self.categorical, *self.boolean]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DataSpec:
        return cls(**{**d, "targets": [TargetInfo(**t) for t in d["targets"]]})

    @property
    def ignore_id(self) -> int | None:
        """The target id the default loss and the metrics ignore: text data's <pad> (0); None otherwise."""
        return None if self.text is None else int(self.text.get("pad_id", 0))


# ---------------------------------------------------------------- the user's code


def _forget_other_copy(top: str, code_dir: str | None) -> None:
    """A package of the same name imported before from another folder (two projects' `models` in one
    process: a sweep, a worker, a notebook) is forgotten, so that `code_dir`'s own is imported, not the
    first one's: only when `code_dir` holds a package or module of that name."""
    if not code_dir or top not in sys.modules:
        return
    root = Path(code_dir).resolve()
    if not ((root / top).is_dir() or (root / f"{top}.py").is_file()):
        return
    loaded = sys.modules[top]
    places = [*getattr(loaded, "__path__", []), getattr(loaded, "__file__", None) or ""]
    if any(p and Path(p).resolve().is_relative_to(root) for p in places):
        return
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def import_entrypoint(entrypoint: str, code_dir: str | None = None):
    """The callable that `model.entrypoint` ("package.module:Name") names, imported from `code_dir`
    (the config file's folder) and the working directory; errors say what is wrong and where it looked."""
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}' is not 'package.module:Name' (the module, a colon, the class or "
            "factory in it), e.g. 'models.world:WorldModel'"
        )
    if code_dir and (not sys.path or sys.path[0] != code_dir):
        if code_dir in sys.path:
            sys.path.remove(code_dir)
        sys.path.insert(0, code_dir)  # the user's folder first (also when another was put there since)
    if str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))  # last: a file in the working directory never shadows a package
    where = ", ".join(dict.fromkeys(str(f) for f in (code_dir, Path.cwd()) if f))
    _forget_other_copy(module_name.split(".")[0], code_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ModelContractError(
                f"model.entrypoint='{entrypoint}': no module '{e.name}' in {where} (model.code_dir, default the "
                "config file's folder, and the working directory); check the module path, or set model.code_dir"
            ) from None
        # the import that failed: the last frame in the user's own files, not importlib's
        mine = [f for f in inspect.trace() if code_dir and Path(f.filename).resolve().is_relative_to(Path(code_dir))]
        at = f" ({mine[-1].filename}:{mine[-1].lineno})" if mine else ""
        top = Path(code_dir or ".") / (e.name or "").split(".")[0]
        fix = (  # a module of the user's own package: no package to install
            f"no such file in your package {top}: add it or fix the import"
            if e.name and (top.is_dir() or top.with_suffix(".py").is_file())
            else "install that package or fix the import"
        )
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}': importing {module_name} failed{at}: {type(e).__name__}: {e}; {fix}"
        ) from e
    except Exception as e:
        frame = inspect.trace()[-1] if inspect.trace() else None
        at = f" ({frame.filename}:{frame.lineno})" if frame else ""
        if isinstance(e, SyntaxError) and e.filename:  # the file that does not parse, not the importer's frame
            at = f" ({e.filename}:{e.lineno})"
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}': importing {module_name} failed{at}: {type(e).__name__}: {e}"
        ) from e
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            file = getattr(module, "__file__", None) or "(built in)"
            raise ModelContractError(
                f"model.entrypoint='{entrypoint}': {module_name} ({file}) has no '{attr}'; it defines {defined}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}': {attr} in {module_name} is a {type(target).__name__}, not a "
            "torch.nn.Module class or a function that returns one"
        )
    return target


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _closest_params(factory, params: dict) -> str:
    """'; did you mean model.params.hidden (for hiddn)?' for each param the factory does not take that is close to
    one it does ('' where none is, or it takes any keyword)."""
    import difflib

    try:
        taken = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return ""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return ""
    names = [n for n, p in list(taken.items())[1:] if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    said = [
        f"model.params.{close[0]} (for {k})"
        for k in params
        if k not in taken and (close := difflib.get_close_matches(k, names, n=1, cutoff=0.6))
    ]
    return f"; did you mean {', '.join(said)}?" if said else ""


def check_params(entrypoint: str, params: dict, code_dir: str | None = None) -> None:
    """Before any work: the entrypoint imports and takes the data spec and `model.params` as its signature says (a
    parameter it does not take was said only once the training built the model, after the ingest and the encode)."""
    factory = import_entrypoint(entrypoint, code_dir)
    try:
        inspect.signature(factory).bind(None, **params)
    except TypeError as e:
        name = entrypoint.rpartition(":")[2]
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}' cannot be called as {name}(spec, **model.params={params}): "
            f"{e}{_closest_params(factory, params)}; it must accept the data spec first, then model.params"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call says it
        pass


def build_user_model(entrypoint: str, params: dict, spec: DataSpec, code_dir: str | None = None) -> nn.Module:
    """`Name(spec, **params)`, checked to be a torch module."""
    factory = import_entrypoint(entrypoint, code_dir)
    try:
        model = factory(spec, **params)
    except TypeError as e:
        called = (
            f"model.entrypoint='{entrypoint}' called as {entrypoint.rpartition(':')[2]}(spec, **model.params={params})"
        )
        try:
            inspect.signature(factory).bind(spec, **params)
        except TypeError:  # the call itself does not fit what it takes
            raise ModelContractError(
                f"{called} failed: {e}{_closest_params(factory, params)}; it must accept the data spec first, then "
                "model.params"
            ) from e
        except ValueError:  # no signature to read (a builtin): said as the call's failure
            pass
        # it took the call and failed inside: where, and a number YAML read as text (1e-1 is text to YAML)
        frame = next((f for f in reversed(inspect.trace()) if "site-packages" not in f.filename), None)
        at = f" at {frame.filename}:{frame.lineno}" if frame else ""
        numeric = [k for k, v in params.items() if isinstance(v, str) and _reads_as_number(v)]
        hint = "".join(
            f"; model.params.{k} is the text {params[k]!r} (YAML reads a number such as 1e-1 as text: write 0.1 "
            "or 1.0e-1)"
            for k in numeric
        )
        raise ModelContractError(f"{called} raised TypeError{at}: {e}{hint}") from e
    if not isinstance(model, nn.Module):
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}' returned a {type(model).__name__}, not a torch.nn.Module"
        )
    try:  # Shardline calls forward(cont, cat): a forward that needs more fails on the first batch, said here
        inspect.signature(model.forward).bind(None, None)
    except TypeError as e:
        raise ModelContractError(
            f"model.entrypoint='{entrypoint}': {type(model).__name__}.forward{inspect.signature(model.forward)} cannot "
            f"be called as forward(cont, cat) ({e}); take exactly those two (give anything else a default)"
        ) from None
    except ValueError:  # no signature to read
        pass
    return model


# ---------------------------------------------------------------- outputs and loss


def is_lazy_model(model: nn.Module) -> bool:
    """Whether the model has lazy layers still without their shapes (`nn.LazyLinear`, `nn.LazyConv1d`, ...)."""
    return any(is_lazy(t) for t in (*model.parameters(), *model.buffers()))


def materialize(model: nn.Module, cont: torch.Tensor, cat: torch.Tensor, device: torch.device) -> None:
    """Give lazy layers their shapes: one forward of (`cont`, `cat`), a few windows of the first batch, on the
    run's device, in eval mode and without gradients (PyTorch's "call forward with a dummy batch"). The layers
    draw their initial weights from the seeded RNG as they materialize, so a run and its resume build the same
    model and use the RNG the same way before the checkpoint's state replaces both."""
    was_training = model.training
    model.to(device).eval()
    with torch.no_grad():
        model(cont.to(device), cat.to(device))
    model.train(was_training)
    if is_lazy_model(model):
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
        raise ModelContractError(
            f"{type(model).__name__}: lazy layer(s) {', '.join(left[:8])} still have no shape after a forward "
            "of the first batch: forward must use every lazy layer on every batch (or build the layer with "
            "its input size)"
        )


def own_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any, str]:
    """The model's `configure_optimizers()`, in the shapes Lightning's takes: an optimizer; (optimizer,
    scheduler) or ([optimizer], [scheduler]); or {"optimizer": ..., "lr_scheduler": scheduler or {"scheduler":
    ..., "interval": "step" | "epoch"}}. Returns (optimizer, scheduler or None, interval: "epoch" unless said).
    Anything else is a ModelContractError saying what came back and the shapes it may take."""
    name = f"{type(model).__name__}.configure_optimizers()"
    got = model.configure_optimizers()
    optimizer, scheduler, interval = got, None, "epoch"
    if isinstance(got, dict):
        optimizer, scheduler = got.get("optimizer"), got.get("lr_scheduler")
    elif isinstance(got, (tuple, list)) and len(got) == 2:
        optimizer, scheduler = got
    if isinstance(optimizer, (tuple, list)) and len(optimizer) == 1:
        optimizer = optimizer[0]
    if isinstance(scheduler, (tuple, list)) and len(scheduler) <= 1:
        scheduler = scheduler[0] if scheduler else None
    if isinstance(scheduler, dict):
        scheduler, interval = scheduler.get("scheduler"), scheduler.get("interval", "epoch")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(scheduler, torch.optim.Optimizer):
        raise ModelContractError(
            f"{name} returned {type(got).__name__}, not one optimizer: return an optimizer, (optimizer, "
            'scheduler), or {"optimizer": ..., "lr_scheduler": ...} (one optimizer: Shardline steps it)'
        )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if scheduler is not None and (
        not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or isinstance(scheduler, plateau)
    ):
        raise ModelContractError(
            f"{name}: the scheduler is a {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler "
            "(ReduceLROnPlateau, which needs a metric each call, is not supported: use a schedule by step or epoch)"
        )
    if scheduler is not None and scheduler.optimizer is not optimizer:
        raise ModelContractError(f"{name}: the scheduler steps another optimizer than the one returned")
    if interval not in ("step", "epoch"):
        raise ModelContractError(f'{name}: lr_scheduler interval {interval!r}: use "step" or "epoch"')
    return optimizer, scheduler, interval


def as_outputs(raw: Any, spec: DataSpec) -> dict[str, torch.Tensor]:
    """A model's return value as {target: tensor}: a dict as it is; a bare tensor when there is one target
    (or none: then it is `{"output": tensor}`, for the model's own loss)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, torch.Tensor) and len(spec.targets) == 1:
        return {spec.targets[0].name: raw}
    if isinstance(raw, torch.Tensor) and not spec.targets:
        return {"output": raw}
    raise ModelContractError(
        f"forward returned a {type(raw).__name__}; it must return a dict {{target: tensor}} with the targets "
        f"{[t.name for t in spec.targets]}"
    )


def check_outputs(outputs: dict[str, torch.Tensor], spec: DataSpec, batch: int) -> None:
    """The first batch's outputs keep the contract: every declared target, each of the right shape."""
    names = [t.name for t in spec.targets]
    missing = [n for n in names if n not in outputs]
    if missing:
        raise ModelContractError(
            f"forward returned {sorted(outputs)} but not the declared target(s) {missing}: return a dict with a "
            f"tensor for each of {names}"
        )
    for t in spec.targets:
        out = outputs[t.name]
        if not isinstance(out, torch.Tensor):
            raise ModelContractError(f"forward's output for target '{t.name}' is a {type(out).__name__}, not a tensor")
        if not out.is_floating_point():  # an integer output carries no gradient: its head never trains
            raise ModelContractError(
                f"forward's output for target '{t.name}' ({t.kind}) is {str(out.dtype).removeprefix('torch.')}: it "
                "must be floating point (scores or values; an integer or rounded output has no gradient, and its "
                "layers would never train)"
            )
        want = t.expected_shape(batch, spec.window)
        got = tuple(out.shape)
        if t.kind == "regression" and got == (*want, 1):
            continue  # [B, 1] is read as [B]
        if got != want:
            lead = "B, K" if t.positions == "all" else "B"
            what = f"[{lead}, {t.n_classes}] class scores" if t.kind == "classification" else f"[{lead}] values"
            every = ", one per position of the window (data.target_positions: all)" if t.positions == "all" else ""
            raise ModelContractError(
                f"forward's output for target '{t.name}' ({t.kind}) has shape {list(got)}, expected {list(want)} "
                f"({what}, B={batch}, K={spec.window}{every})"
            )


def default_loss(
    outputs: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    spec: DataSpec,
    weights: dict[str, float] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Per target: cross-entropy (classification) or MSE on the standardised value (regression), summed
    with `weights` (default 1 each)."""
    total = None
    ignore = spec.ignore_id
    for t in spec.targets:
        out, y = outputs[t.name].float(), targets[t.name]
        if ignore is not None and t.kind == "classification":  # text: the mean over a window's real targets
            part = F.cross_entropy(
                out.reshape(-1, out.shape[-1]), y.long().reshape(-1), ignore_index=ignore, reduction="none"
            ).reshape(y.shape[0], -1)
            counted = (y.reshape(y.shape[0], -1) != ignore).sum(dim=1)
            part = part.sum(dim=1) / counted.clamp(min=1)
            part = part.mean() if reduction == "mean" else part.sum()
        elif t.positions == "all":  # every position: a window's loss is the mean over its K positions
            if t.kind == "classification":
                part = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.long().reshape(-1), reduction="none")
            else:
                part = F.mse_loss(out.reshape(y.shape), y.float(), reduction="none")
            part = part.reshape(y.shape[0], -1).mean(dim=1)
            part = part.mean() if reduction == "mean" else part.sum()
        elif t.kind == "classification":
            part = F.cross_entropy(out, y.long(), reduction=reduction)
        else:
            part = F.mse_loss(out.reshape(y.shape), y.float(), reduction=reduction)
        part = part * (weights or {}).get(t.name, 1.0)
        total = part if total is None else total + part
    if total is None:
        raise ModelContractError(
            "there is no target (data.targets is empty), so there is no default loss: define "
            "loss(outputs, cont, cat, targets) -> scalar tensor on your model"
        )
    return total


def model_loss(
    model: nn.Module,
    outputs: dict[str, torch.Tensor],
    cont: torch.Tensor,
    cat: torch.Tensor,
    targets: dict[str, torch.Tensor],
    spec: DataSpec,
    weights: dict[str, float] | None = None,
) -> torch.Tensor:
    """The model's own `loss(outputs, cont, cat, targets)` when it defines one, else the default loss."""
    own = own_hook(model, "loss")
    if own is None:
        return default_loss(outputs, targets, spec, weights)
    return own(outputs, cont, cat, targets)


def own_hook(model: nn.Module, name: str):
    """The model's own `loss` or `metrics` method, or None: a method its class defines, not an attribute of that
    name (`self.loss = nn.CrossEntropyLoss()`, `self.metrics = nn.ModuleDict(...)`: what it uses, not a hook)."""
    defined = getattr(type(getattr(model, "_orig_mod", model)), name, None)  # torch.compile's wrapper: its module's
    return getattr(model, name) if inspect.isfunction(defined) else None


def check_loss(loss: Any, step: int, model: nn.Module, outputs: dict[str, torch.Tensor] | None = None) -> None:
    """A loss must be a finite scalar tensor; the error names the step and whose loss it is. `outputs`: the run's
    first batch's, before any update (no learning rate can be the cause then): the outputs that are not finite
    are named."""
    whose = f"{type(model).__name__}.loss" if own_hook(model, "loss") is not None else "the default loss"
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelContractError(f"{whose} returned {shape} at step {step}; it must return a scalar tensor")
    value = float(loss.detach())
    if math.isfinite(value):
        return
    if outputs is None:  # after updates: the training diverged, or the model's forward made it
        own_rates = own_hook(model, "configure_optimizers") is not None
        rate = "the learning rate its configure_optimizers sets" if own_rates else "training.lr"
        raise ModelContractError(
            f"{whose} is {value} at step {step}: the training diverged, or the model's outputs hold inf or NaN. "
            f"Lower {rate}, clip gradients (training.grad_clip), or check the model's forward (an overflow, a log "
            "or a division of 0) and the inputs"
        )
    bad = [name for name, out in outputs.items() if not bool(torch.isfinite(out.detach()).all())]
    cause = (
        f"the model's output(s) {bad} hold inf or NaN: check its forward (an overflow, a log or a division of 0)"
        if bad
        else "its outputs are finite: check the loss and the targets"
    )
    raise ModelContractError(
        f"{whose} is {value} at step {step}, on the first batch, before any update (not the learning rate): {cause}"
    )


def check_own_metrics(values: Any, model: nn.Module, taken: set[str] | dict) -> None:
    """What a model's own `metrics` returns: a dict of scalars, each named apart from the metrics Shardline computes
    (`taken`: the validation's, `val_<name>`), which it would replace: the best epoch is chosen by them."""
    whose = f"{type(model).__name__}.metrics"
    if not isinstance(values, Mapping):
        raise ModelContractError(f"{whose} returned a {type(values).__name__}; it must return a dict of name -> scalar")
    for key, value in values.items():
        if f"val_{key}" in taken:
            raise ModelContractError(
                f"{whose} returned '{key}', the name of a metric Shardline computes itself (val_{key}), which it would "
                f"replace: give yours another name (e.g. 'my_{key.replace('/', '_')}')"
            )
        try:
            size = torch.as_tensor(value).numel()
        except (TypeError, ValueError, RuntimeError):
            size = None
        if size != 1:
            what = f"of shape {list(value.shape)}" if hasattr(value, "shape") else f"as a {type(value).__name__}"
            raise ModelContractError(
                f"{whose} returned '{key}' {what}; each value must be a scalar (a mean over the batch's windows)"
            )


# ---------------------------------------------------------------- starting from another model's weights


def load_matching(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> dict[str, list[str]]:
    """Copy the parameters and buffers of `weights` that match `model`'s by name and shape; returns which
    were `loaded`, which the model has that `weights` lacks (`new`) and which did not fit (`skipped`,
    with the shapes). Nothing matching is an error naming both models.

    A model may name its learned position tables (`shardline_position_tables`, e.g. the gpt family's
    `("wpe.weight",)`: one row per position of the window): one whose width matches but whose rows do not
    covers another context than this run's `data.window`, and is refused rather than re-initialised, which
    would silently discard what the parent learned about positions."""
    own = model.state_dict()
    positions = set(getattr(model, "shardline_position_tables", ()))
    loaded, skipped = [], []
    for name, value in weights.items():
        if name not in own:
            continue
        if tuple(own[name].shape) != tuple(value.shape):
            if name in positions and value.dim() >= 1 and tuple(value.shape[1:]) == tuple(own[name].shape[1:]):
                raise ModelContractError(
                    f"training.init_from={source}: its learned positions ({name}) cover a context of "
                    f"{value.shape[0]} positions, this model's {own[name].shape[0]} (data.window); re-initialising "
                    f"them would silently discard what the parent learned: set data.window to {value.shape[0]}, "
                    "the parent's, or drop training.init_from"
                )
            skipped.append(f"{name} {list(value.shape)} -> {list(own[name].shape)}")
            continue
        loaded.append(name)
    if not loaded:
        raise ModelContractError(
            f"training.init_from={source}: none of its {len(weights)} tensors matches {type(model).__name__} by "
            f"name and shape (its: {sorted(weights)[:6]}...; this model's: {sorted(own)[:6]}...); start from a "
            "model of the same architecture, or drop training.init_from"
        )
    with torch.no_grad():
        for name in loaded:
            own[name].copy_(weights[name])
    new = sorted(n for n in own if n not in weights)
    return {"loaded": sorted(loaded), "new": new, "skipped": sorted(skipped)}


def freeze(model: nn.Module, prefixes: list[str]) -> tuple[list[str], list[str]]:
    """Stop the gradients of the parameters whose names start with one of `prefixes`, and keep the norm layers
    among them (BatchNorm, any with running statistics) in eval mode; returns both lists of names. A prefix
    that matches no parameter is an error that lists the model's top-level modules."""
    names = [n for n, _ in model.named_parameters()]
    unmatched = [p for p in prefixes if not any(n.startswith(p) for n in names)]
    if unmatched:
        tops = sorted({n.split(".")[0] for n in names})
        raise ModelContractError(
            f"training.freeze: {unmatched} match(es) no parameter of {type(model).__name__}; its parameters start "
            f"with {tops}"
        )
    frozen = []
    for name, param in model.named_parameters():
        if any(name.startswith(p) for p in prefixes):
            param.requires_grad_(False)
            frozen.append(name)
    norms = []
    for name, module in model.named_modules():  # a frozen norm's running statistics stay as loaded, too
        at = f"{name}." if name else ""
        own = [at + n for n, _ in module.named_parameters(recurse=False)]
        inside = all(n in frozen for n in own) if own else any(at.startswith(p) for p in prefixes)
        if getattr(module, "track_running_stats", False) and inside:
            module.train = types.MethodType(_stay_in_eval, module)
            module.eval()
            norms.append(name)
    return frozen, norms


def _stay_in_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    """`train` of a frozen norm layer: it stays in eval mode, whatever `model.train()` its model is given."""
    return nn.Module.train(self, False)


def batch_targets(data: DataSpec, batch) -> dict[str, torch.Tensor]:
    """A batch's targets by name, in the spec's order (as the shards store them)."""
    return {t.name: y for t, y in zip(data.targets, batch.targets)}
