"""What every part of the config shares: its error, the strict model base, the names of splits, the stable hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    model_validator,
)

FILE_SEQUENCE = "@file"  # sequence_key value meaning "each raw file is one sequence"
SPLITS = ("train", "validation", "test")


class ConfigError(ValueError):
    """A config the user must fix; the message names the key, the value and what is allowed."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _no_yes_or_no_for_a_number(cls, data: Any) -> Any:
        """`true` where a number is meant is refused, naming the key: pydantic reads it as 1 (a sweep's
        `--grid model.hidden=true,16` trained a model of one hidden unit, without a word)."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if field is None or not isinstance(value, bool):
                    continue
                types = set(get_args(field.annotation)) or {field.annotation}
                if bool not in types and types & {int, float}:
                    raise ValueError(f"{name}: {str(value).lower()} is a yes or no, where a number is meant")
        return data


def stable_hash(obj: Any) -> str:
    """sha256 of canonical JSON: the same content gives the same hash on any machine."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()
