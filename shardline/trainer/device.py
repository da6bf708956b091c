"""Where training runs and in which precision: decided once, up front, with errors that name the setting."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def available_devices() -> list[str]:
    """Device types this machine can train on, best first."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    return [*found, "cpu"]


def pick_device(pref: str = "auto") -> torch.device:
    """`training.device` -> a torch device: auto prefers CUDA, then MPS, then CPU."""
    available = available_devices()
    if pref == "auto":
        return torch.device(available[0])
    if pref not in available:
        raise ValueError(
            f"training.device='{pref}' but this machine has no {pref.upper()} device available "
            f"(available: {', '.join(available)}); set training.device to auto or one of those"
        )
    return torch.device(pref)


def pick_precision(pref: str, device: torch.device) -> str:
    """`training.precision` -> fp32 | bf16 | fp16 for `device`.

    auto: bf16 on CUDA when supported, else fp16; fp32 on CPU and MPS. CPU autocast supports bf16
    but not fp16 training, so fp16 on CPU is rejected.
    """
    kind = torch.device(device).type
    if pref == "auto":
        if kind == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if kind == "cpu" and pref == "fp16":
        raise ValueError(
            "training.precision='fp16' is not supported on the CPU (CPU autocast has no float16 training "
            "path); use fp32 or bf16 there, or train on a CUDA device"
        )
    if kind == "cuda" and pref == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"training.precision='bf16' but this GPU ({torch.cuda.get_device_name()}) does not support bfloat16; "
            "use fp16 (with loss scaling) or fp32"
        )
    return pref


def autocast(device: torch.device, precision: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """The one mixed-precision context of a run: a null context for fp32. `cache=False` for a step captured as
    a CUDA graph (the cast weights are then recomputed in the graph, as capture requires)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=_DTYPES[precision], cache_enabled=cache)


def needs_grad_scaler(precision: str) -> bool:
    """Only float16 needs loss scaling: bfloat16 has float32's exponent range."""
    return precision == "fp16"


def torch_report(device: str = "auto", precision: str = "auto") -> dict:
    """What this machine can train on: torch and CUDA versions, the devices, and what
    `training.device` / `training.precision` resolve to here (or why they cannot)."""
    import platform
    import socket

    cuda_available = torch.cuda.is_available()
    devices = []
    cuda_op = None
    if cuda_available:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            major, minor = torch.cuda.get_device_capability(i)
            devices.append(
                {
                    "index": i,
                    "name": props.name,
                    "capability": f"{major}.{minor}",
                    "memory_gb": round(props.total_memory / 2**30, 1),
                    "bf16": major >= 8,
                }
            )
        try:  # visible is not usable: one small op on each device (a driver/build mismatch fails here)
            for i in range(len(devices)):
                x = torch.ones(64, 64, device=f"cuda:{i}")
                float((x @ x).sum().item())
            torch.cuda.synchronize()
            cuda_op = "ok"
        except Exception as e:  # noqa: BLE001 - reported, that is the point
            cuda_op = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    report = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,  # None: a CPU-only build of torch
        "cudnn": torch.backends.cudnn.version() if cuda_available else None,
        "cuda_available": cuda_available,
        "devices": devices,
        "cuda_op": cuda_op,
        "bf16": bool(cuda_available and torch.cuda.is_bf16_supported()),
        "mps_available": torch.backends.mps.is_available(),
        "training_device": device,
        "would_train_on": None,
        "precision": None,
        "device_error": None,
    }
    try:
        dev = pick_device(device)
        report["would_train_on"] = dev.type
        report["precision"] = pick_precision(precision, dev)
    except ValueError as e:
        report["device_error"] = str(e)
    return report
