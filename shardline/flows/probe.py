"""A tiny flow that says what a worker's machine can train on: `shardline doctor` runs it on the GPU pool.

It imports torch, looks for CUDA devices (and runs one small op on each), and reports the versions and
what training would pick there (`training.device`, `training.precision`). The report is returned and
also kept as a table artifact (`gpu-probe`) of the flow run, so that whoever started the run reads it
back through the Prefect API, whatever storage the worker sees.
"""

from __future__ import annotations

from prefect import flow

ARTIFACT_KEY = "gpu-probe"


@flow(name="probe", log_prints=True)
def probe(device: str = "auto", precision: str = "auto") -> dict:
    """Report torch, CUDA and the GPUs this worker sees, and what training would use here."""
    from prefect.artifacts import create_table_artifact

    from shardline.trainer.device import torch_report

    report = torch_report(device, precision)
    create_table_artifact(
        key=ARTIFACT_KEY,
        table=[{"field": k, "value": v} for k, v in report.items()],
        description=f"what training can use on {report['host']} (shardline doctor)",
    )
    print(
        f"probe on {report['host']}: torch {report['torch']}, CUDA build {report['cuda_build']}, "
        f"cuda available {report['cuda_available']}, devices {[d['name'] for d in report['devices']]}, "
        f"training would use {report['would_train_on']} ({report['precision']})"
    )
    return report
