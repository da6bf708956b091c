"""What training costs: the price table (`shardline/configs/prices.yaml`, an estimate, overridable), the
GPU type a machine has, and hours times price.

The table is USD per GPU-hour by GPU type and provider, on-demand and spot. A user's own file
(`SHARDLINE_PRICES`, or a path given to `load_prices`) replaces entries by (gpu, provider) and adds
new ones; its `as_of` is shown with every figure, so an estimate never passes for a quote.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardline.core.config import settings

PRICES_FILE = Path(__file__).resolve().parents[2] / "configs" / "prices.yaml"
PRICES_ENV = "SHARDLINE_PRICES"
GPU_ENV = "SHARDLINE_GPU_TYPE"  # a pool's job variables may declare the type instead of detecting it
CPU = "CPU"


@dataclass(frozen=True)
class Price:
    gpu: str
    provider: str
    on_demand: float
    spot: float | None

    def per_hour(self, spot: bool) -> float | None:
        return self.spot if spot else self.on_demand


@dataclass
class PriceTable:
    prices: list[Price]
    as_of: str
    sources: list[str]

    @property
    def gpus(self) -> list[str]:
        return sorted({p.gpu for p in self.prices})

    def of(self, gpu: str) -> list[Price]:
        """The prices of a GPU type (by `gpu_type`'s name), cheapest on-demand first; an unknown type is an
        error that lists the known ones."""
        found = sorted((p for p in self.prices if p.gpu == gpu), key=lambda p: p.on_demand)
        if not found:
            raise ValueError(
                f"GPU type '{gpu}' is not in the price table ({', '.join(self.sources)}); known types: "
                f"{', '.join(self.gpus)}. Pass one of them (--gpu), or add '{gpu}' to your own prices file "
                f"({PRICES_ENV}=FILE, entries like {{gpu: {gpu}, provider: NAME, on_demand: 1.5, spot: 0.6}})"
            )
        return found


def _entries(path: Path) -> tuple[list[Price], str]:
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"prices file {path}: cannot be read ({e})") from None
    rows = doc.get("prices") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"prices file {path}: needs a `prices:` list of {{gpu, provider, on_demand, spot}}")
    out = []
    for i, row in enumerate(rows):
        try:
            spot = row.get("spot")
            price = Price(
                gpu=gpu_type(str(row["gpu"])),
                provider=str(row["provider"]),
                on_demand=float(row["on_demand"]),
                spot=None if spot is None else float(spot),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(
                f"prices file {path}: entry {i + 1} ({row!r}) needs gpu, provider, on_demand (USD per GPU-hour) "
                "and spot (a number, or null)"
            ) from None
        if price.on_demand < 0 or (price.spot is not None and price.spot < 0):
            raise ValueError(f"prices file {path}: entry {i + 1} has a negative price")
        out.append(price)
    return out, str(doc.get("as_of") or "undated")


def load_prices(path: str | Path | None = None) -> PriceTable:
    """The shipped table, with the user's file (`path`, else `SHARDLINE_PRICES`) laid over it."""
    prices, as_of = _entries(PRICES_FILE)
    sources = [f"shipped estimate, {as_of}"]
    own = path or settings.text(PRICES_ENV)
    if own:
        own = Path(own).expanduser()
        if not own.is_file():
            raise ValueError(f"prices file {own} (from {'--prices' if path else PRICES_ENV}) does not exist")
        theirs, their_date = _entries(own)
        replaced = {(p.gpu, p.provider) for p in theirs}
        prices = [p for p in prices if (p.gpu, p.provider) not in replaced] + theirs
        sources.insert(0, f"{own}, {their_date}")
        as_of = f"{their_date} ({own.name}); others {as_of}"
    return PriceTable(prices, as_of, sources)


# device names as torch and nvidia-smi report them -> the table's types (the first match wins)
_NAMES = [
    (r"H200", "H200"),
    (r"H100", "H100"),
    (r"A100.*(80\s*GB|80G)", "A100-80GB"),
    (r"A100", "A100-40GB"),
    (r"L40S", "L40S"),
    (r"\bL4\b", "L4"),
    (r"A10G", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bT4\b", "T4"),
    (r"4090", "RTX4090"),
    (r"V100", "V100"),
]


def gpu_type(name: str) -> str:
    """The price table's type for a device name ("NVIDIA H100 80GB HBM3" -> "H100"); a name that matches no
    known type is returned as written (upper case), so that a user's own table can price it."""
    text = name.strip()
    if text.upper() in {CPU, "NONE", "NO GPU"}:
        return CPU
    for pattern, kind in _NAMES:
        if re.search(pattern, text, flags=re.IGNORECASE):
            return kind
    return text.upper()


def detect_gpu() -> tuple[str, str]:
    """This machine's GPU type and how it was found: `SHARDLINE_GPU_TYPE` (a pool's job variables), torch's
    first CUDA device, nvidia-smi, else CPU."""
    declared = settings.text(GPU_ENV)
    if declared:
        return gpu_type(declared), f"{GPU_ENV}={declared}"
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return gpu_type(name), f"torch: {name} x{torch.cuda.device_count()}"
    except Exception:  # noqa: BLE001 - detection falls through to the next way
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            if out:
                return gpu_type(out.splitlines()[0]), f"nvidia-smi: {out.splitlines()[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    return CPU, "no CUDA device"


def estimate(hours: float, gpu: str, table: PriceTable, spot: bool = False, gpus: int = 1) -> list[dict]:
    """`hours` of `gpus` GPUs of type `gpu`, priced by each provider that sells it (spot: where sold)."""
    rows = []
    for p in table.of(gpu):
        rate = p.per_hour(spot)
        rows.append(
            {
                "provider": p.provider,
                "gpu": gpu,
                "kind": "spot" if spot else "on-demand",
                "usd_per_gpu_hour": rate,
                "gpu_hours": hours * gpus,
                "usd": None if rate is None else hours * gpus * rate,
            }
        )
    return rows
