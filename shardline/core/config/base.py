"""What every part of the config shares: its error, the strict model base, the names of splits, the stable hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
)

FILE_SEQUENCE = "@file"  # sequence_key value meaning "each raw file is one sequence"
SPLITS = ("train", "validation", "test")


class ConfigError(ValueError):
    """A config the user must fix; the message names the key, the value and what is allowed."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def stable_hash(obj: Any) -> str:
    """sha256 of canonical JSON: the same content gives the same hash on any machine."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()
