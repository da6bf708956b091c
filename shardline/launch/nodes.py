"""Nodes 1..M-1 of a training on several machines on a Prefect pool: one flow run of `compute.node_deployment`
each, started by the training run (node 0). They meet node 0 only at torchrun's rendezvous
(shardline/launch/torchrun.py); what became of them is read back for the training's error."""

from __future__ import annotations

from collections.abc import Callable

from shardline.core.config import ComputeConfig
from shardline.core.secrets import job_variables_here


def others(nodes: int) -> str:
    """The nodes a training on `nodes` machines starts, in words: 'node 1', 'nodes 1 to 3'."""
    return "node 1" if nodes == 2 else f"nodes 1 to {nodes - 1}"


class NodeRuns:
    """Nodes 1..M-1 of this attempt: one flow run of `compute.node_deployment` each."""

    def __init__(self, compute: ComputeConfig, log: Callable[[str], None]):
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound
        from prefect.settings import PREFECT_API_URL

        self.compute, self.log, self.runs = compute, log, []
        with get_client(sync_client=True) as client:
            try:
                client.read_deployment_by_name(compute.node_deployment)
            except ObjectNotFound:
                raise ValueError(
                    f"compute.nodes={compute.nodes}: {others(compute.nodes)} run(s) as flow runs of "
                    f"compute.node_deployment '{compute.node_deployment}', which the Prefect API "
                    f"({PREFECT_API_URL.value() or 'ephemeral, in this process'}) does not "
                    "have. Deploy it (`prefect --no-prompt deploy --all` in the project folder: prefect.yaml's "
                    "train-node) and start a worker of its pool on each training machine, or start the machines "
                    "with a launcher (compute.train_on: launcher), or set compute.nodes: 1"
                ) from None

    def start(self, job_uri: str, endpoint: str, shutdown_seconds: int) -> None:
        from prefect.deployments import run_deployment

        c = self.compute
        for _ in range(1, c.nodes):
            self.runs.append(
                run_deployment(
                    name=c.node_deployment,
                    parameters={"job": job_uri, "endpoint": endpoint, "shutdown_seconds": shutdown_seconds},
                    job_variables=job_variables_here(c.job_variables) or None,  # this machine's job, as it got it
                    timeout=0,  # started, not waited for: this process is node 0
                    as_subflow=True,
                    tags=["shardline", "shardline-node"],
                )
            )
        self.log(
            f"{others(c.nodes)}: flow run(s) {', '.join(r.name for r in self.runs)} of {c.node_deployment}; the "
            f"rendezvous is at {endpoint} (the other machines must reach it: compute.master_addr, master_port)"
        )

    def _states(self) -> list:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return [client.read_flow_run(r.id) for r in self.runs]

    def report(self) -> str:
        """What became of the node runs, for the error of a failed training."""
        try:
            runs = self._states()
        except Exception as e:  # noqa: BLE001 - the API away: the error stands without it
            return f"; the other nodes' flow runs could not be read ({type(e).__name__})"
        said = [
            f"{r.name} ({r.id}) {r.state.name if r.state else '?'}"
            + (f": {r.state.message}" if r.state and r.state.message else "")
            for r in runs
        ]
        return "; the other nodes' flow runs: " + "; ".join(said) if said else ""

    def finish(self, wait: float) -> None:
        """Node 0's agent has ended: the node runs still running get `wait` seconds to end by themselves (their
        agents end with node 0's), then every node run not ended is cancelled (one never started has nothing left
        to join)."""
        import time

        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled, Cancelling

        until = time.monotonic() + wait
        while True:
            try:
                pending = [r for r in self._states() if not (r.state and r.state.is_final())]
            except Exception as e:  # noqa: BLE001 - the API away: nothing more to do here
                self.log(f"note: the nodes' flow runs could not be read ({type(e).__name__}: {e})")
                return
            if not any(r.state and r.state.is_running() for r in pending) or time.monotonic() >= until:
                break
            time.sleep(1.0)
        with get_client(sync_client=True) as client:
            for run in pending:
                running = run.state is not None and run.state.is_running()
                client.set_flow_run_state(run.id, Cancelling() if running else Cancelled(), force=True)
                self.log(f"node run {run.name} ({run.id}) was still {run.state.name if run.state else '?'}: cancelled")
