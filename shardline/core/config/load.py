"""Reading a config: YAML files, `extends:` chains (paths relative to the file), `--set` overrides, validation
that names the key, the bad value and what is allowed."""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shardline.core.config.base import ConfigError
from shardline.core.config.schema import PipelineConfig

# ---------------------------------------------------------------- loading

SHIPPED = Path(__file__).resolve().parents[2] / "configs"  # shardline/configs: the demo's config


def _deep_merge(base: dict, over: dict, top: bool = True) -> dict:
    """`over` on `base` (an `extends:` parent), mapping by mapping. An empty mapping below the sections clears the
    inherited one (`training.loss_weights: {}`, `model.params: {}`: merged, nothing could be taken away)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and (v or top):
            out[k] = _deep_merge(out[k], v, top=False)
        else:
            out[k] = v
    return out


def is_inline(config: str) -> bool:
    """Whether a `config` parameter (a deployment's, a sweep's) is the config's YAML text rather than a path."""
    text = config.strip()
    return "\n" in text or ": " in text or text.startswith("{")


def inline_config(text: str) -> dict:
    """A config given as YAML text: parsed, its `extends:` (and relative paths) taken from the working folder (a
    worker's: the project folder prefect.yaml pulls). Errors never quote the text: it may hold credentials."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"the config given inline is not valid YAML{at}") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"the config given inline must be a mapping of sections (data, model, ...), not {type(raw).__name__}"
        )
    parent, folder = raw.pop("extends", None), Path.cwd()
    raw = _rebase_paths(raw, folder)
    return _deep_merge(_own_model(read_yaml(folder / parent), raw), raw) if parent else raw


def read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config 'extends' loops: {' -> '.join(str(p) for p in (*chain, path))}")
    if not path.exists():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:  # where and what, never the line itself (it may hold a secret); yaml said
        where = getattr(e, "problem_mark", None)  # '"<unicode string>", line 3' and quoted the line
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        what = "; ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
        raise ConfigError(f"{path}: not valid YAML{at}" + (f": {what}" if what else "")) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (data, model, ...), got {type(raw).__name__}"
        )
    parent = raw.pop("extends", None)
    # the configs shipped inside the package (the demo's) hold paths relative to the config that extends them, or
    # to the working directory when given themselves: their own folder is the installed package, no place for a
    # user's data or store
    folder = path.parent if path.parent != SHIPPED else chain[-1].parent if chain else Path.cwd()
    if parent is None:
        return _rebase_paths(raw, folder)
    base = read_yaml((path.parent / parent), (*chain, path))
    return _deep_merge(_own_model(base, raw), _rebase_paths(raw, folder))


def _own_model(base: dict, raw: dict) -> dict:
    """`base` (an `extends:` parent) without its `model.params` where `raw` names another model (another entrypoint
    or family): they were that model's keyword arguments, not this one's."""
    mine, theirs = raw.get("model"), base.get("model")
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return base
    if any(k in mine and mine[k] != theirs.get(k) for k in ("entrypoint", "family")):
        return {**base, "model": {k: v for k, v in theirs.items() if k != "params"}}
    return base


def _rebase_paths(raw: dict, folder: Path) -> dict:
    """Relative local paths in a config file are relative to that file, not to the cwd."""
    model = raw.get("model")
    if isinstance(model, dict) and model.get("entrypoint") and not model.get("code_dir"):
        raw["model"] = {**model, "code_dir": str(folder.resolve())}  # the user's code sits beside the config
    data = raw.get("data")
    tok = data.get("tokenizer") if isinstance(data, dict) else None
    file = tok.get("file") if isinstance(tok, dict) else None
    if isinstance(file, str) and "://" not in file and not Path(file).is_absolute():  # a URL is where it says
        raw["data"] = {**data, "tokenizer": {**tok, "file": str((folder / tok["file"]).resolve())}}
    # a checkpoint parent too (its tags named `store/runs/...`, which meant something only from that folder)
    for section, key in (("data", "source"), ("storage", "root"), ("model", "code_dir"), ("training", "init_from")):
        val = (raw.get(section) or {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(val, str) and ":/" not in val and not Path(val).is_absolute():  # models:/, runs:/, s3://
            raw[section] = dict(raw[section])
            raw[section][key] = str((folder / val).resolve())
    return raw


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set '{item}': expected key.path=value, e.g. training.epochs=5")
    key, _, value = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set '{item}': the key is empty")
    try:
        return parts, yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:  # the value is read as YAML: `[1` or `{a: 1` does not close
        mark = f" ({e.problem})" if getattr(e, "problem", None) else ""
        raise ConfigError(
            f"--set '{item}': the value does not read as YAML{mark}; quote it for text, close its brackets for a list"
        ) from e


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = json.loads(json.dumps(raw, default=str))
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set '{item}': '{p}' is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((m for a in typing.get_args(annotation) if (m := _model_in(a)) is not None), None)
    return None


def _is_mapping(annotation: Any) -> bool:
    if annotation is Any or annotation is dict or typing.get_origin(annotation) is dict:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_mapping(a) for a in typing.get_args(annotation))
    return False


def key_problem(key: str) -> str | None:
    """Why `key` is no config key (naming the closest ones), or None: a key of a section, a whole section,
    or any key below a mapping setting (`model.params.width`, `training.loss_weights.label`)."""
    parts = [p for p in key.split(".") if p]
    model: type[BaseModel] = PipelineConfig
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:i]) or "the config's top level"
            close = difflib.get_close_matches(part, list(fields), n=3)
            hint = f"; did you mean {' or '.join(repr('.'.join([*parts[:i], c])) for c in close)}?" if close else ""
            return f"'{key}' is not a config key: {where} has no '{part}'{hint}"
        annotation = fields[part].annotation
        sub = _model_in(annotation)
        if sub is None:
            if i < len(parts) - 1 and not _is_mapping(annotation):
                return f"'{key}' is not a config key: {'.'.join(parts[: i + 1])} is a value, not a section"
            return None
        model = sub
    return None if parts else "an empty key"


def _spelling_hint(key: str) -> str:
    """'; did you mean ...?' with the closest keys where `key`'s last part is no key of its section, else ''."""
    problem = key_problem(key) or ""
    if f"has no '{key.rsplit('.', 1)[-1]}'; did you mean " not in problem:
        return ""
    return "; did you mean " + problem.split("; did you mean ", 1)[1]


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config {origin}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key '{loc}': remove it or check its spelling{_spelling_hint(loc)}")
            continue
        value = e.get("input")
        shown = "" if isinstance(value, dict) or e["type"] == "missing" else f" (got {value!r})"
        lines.append(f"  - {loc or 'config'}: {msg}{shown}")
    return "\n".join(lines)


def validate_config(raw: dict, origin: str = "") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> PipelineConfig:
    """Read a YAML config (following `extends:`), apply `--set` overrides, validate."""
    raw: dict = dict(base or {})
    if path is not None:
        raw = _deep_merge(raw, read_yaml(Path(path)))
    raw = apply_overrides(raw, overrides or [])
    if path is not None:
        raw = code_beside(raw, Path(path))
    return validate_config(raw, f"'{path}'" if path else "")


def code_beside(raw: dict, config_path: Path) -> dict:
    """`model.code_dir` where a `--set` gave the entrypoint without one: the config file's folder, as for an
    entrypoint written in the file (`_rebase_paths`)."""
    model = raw.get("model")
    if isinstance(model, dict) and model.get("entrypoint") and not model.get("code_dir"):
        raw = {**raw, "model": {**model, "code_dir": str(config_path.resolve().parent)}}
    return raw
