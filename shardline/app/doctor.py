"""`shardline doctor CONFIG`: check every dependency of a run before it starts, and say what is wrong.

One `Check` per dependency, in the order a run meets them (`doctor_checks.py`, `doctor_prefect.py`). A check
is `ok=True` (PASS), `False` (FAIL: the detail says what to do) or `None` (SKIP: the detail says why). Every
network check is bounded by `timeout`, and no detail ever holds a secret: values of credential-like
environment variables and passwords in URLs are masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardline.app.doctor_checks import Check, _data_check, _local_torch, _mlflow_checks, _short, _storage_check
from shardline.core.config import PipelineConfig
from shardline.core.secrets import redact_text

# ---------------------------------------------------------------- all of it


def doctor(
    config: PipelineConfig,
    timeout: float = 30.0,
    probe_timeout: float = 300.0,
    source: str | None = None,
    on_check: Callable[[Check], None] | None = None,
) -> list[Check]:
    """Every check, in order; `on_check` sees each one as soon as it is done (the GPU probe takes a while)."""
    from shardline.app.doctor_prefect import gpu_probe, prefect_checks

    done: list[Check] = []

    def add(*checks: Check) -> None:
        for chk in checks:
            chk.detail = redact_text(chk.detail)  # by names and URL userinfo: a bucket or path stays readable
            done.append(chk)
            if on_check is not None:
                on_check(chk)

    def guarded(name: str, fn: Callable[[], Any]) -> Any:
        """`fn()`'s value; a bug in a check is a failed row, not a crash of the doctor."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            add(Check(name, False, f"the check itself failed: {_short(e)}"))
            return None

    def row(name: str, fn: Callable[[], Check | list[Check]]) -> None:
        out = guarded(name, fn)
        if out is not None:
            add(*(out if isinstance(out, list) else [out]))

    c = config.compute
    where = (
        f"training dispatched to {c.train_deployment}"
        if c.train_on == "deployment"
        else "training in the pipeline's process"
    )
    add(
        Check(
            "config",
            True,
            f"{source + ': ' if source else ''}valid; name {config.name}, hash {config.hash()[:12]}, {where}",
        )
    )
    probe = guarded("prefect api", lambda: prefect_checks(config, timeout, add))
    row("data source", lambda: _data_check(config, timeout))
    row("storage", lambda: _storage_check(config, timeout))
    row("mlflow tracking", lambda: _mlflow_checks(config, timeout))
    row("torch (here)", lambda: _local_torch(config))
    # the probe goes last: a flow run on the pool takes a while (worker pickup, process start-up)
    if isinstance(probe, Check):
        add(probe)
    elif probe is not None:
        row("gpu probe", lambda: gpu_probe(config, probe, probe_timeout))
    return done
