"""Reading a config: YAML files, `extends:` chains (paths relative to the file), `--set` overrides, validation
that names the key, the bad value and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from shardline.core.config.base import ConfigError
from shardline.core.config.schema import PipelineConfig

# ---------------------------------------------------------------- loading


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config 'extends' loops: {' -> '.join(str(p) for p in (*chain, path))}")
    if not path.exists():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (data, model, ...), got {type(raw).__name__}"
        )
    parent = raw.pop("extends", None)
    if parent is None:
        return _rebase_paths(raw, path.parent)
    base = read_yaml((path.parent / parent), (*chain, path))
    return _deep_merge(base, _rebase_paths(raw, path.parent))


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
    for section, key in (("data", "source"), ("storage", "root"), ("model", "code_dir")):
        val = (raw.get(section) or {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(val, str) and "://" not in val and not Path(val).is_absolute():
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


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config {origin}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key '{loc}': remove it or check its spelling")
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
    return validate_config(raw, f"'{path}'" if path else "")
