"""A Prefect server, a process worker for `cpu-pool` and two for `gpu-pool` (one run at a time each), deployments from
prefect.yaml and a local S3 server (moto), all on 127.0.0.1, shared by the tests of one module (fixture `cluster` in
conftest.py; started only when a test asks for it, stopped when the module's tests are done).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_raw
from tests.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BUCKET = "shardline-e2e"
# (pool, worker name, its --limit): the GPU pool's two workers stand for two GPU machines
WORKERS = [("cpu-pool", "cpu-pool-w1", None), ("gpu-pool", "gpu-pool-w1", 1), ("gpu-pool", "gpu-pool-w2", 1)]


def wait_until(check, timeout: float, what: str, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Cluster:
    env: dict
    api: str
    base: Path
    logs: Path

    def prefect(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(BIN / "prefect"), *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, (
            f"prefect {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}\n{self.tail_logs()}"
        )
        return out

    def post(self, path: str, body: dict) -> list[dict]:
        r = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def flow_runs(self, **flow_run_filter) -> list[dict]:
        return self.post("/flow_runs/filter", {"flow_runs": flow_run_filter, "sort": "EXPECTED_START_TIME_ASC"})

    def task_runs(self, flow_run_id: str, final: int = 1, timeout: float = 90.0) -> list[dict]:
        """A finished flow run's task runs, once at least `final` of them are recorded in a final state: the
        server's task-run recorder writes them from events a moment after the flow returns."""
        deadline = time.monotonic() + timeout
        while True:
            runs = self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
            done = [
                r for r in runs if (r.get("state") or {}).get("type") in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
            ]
            if len(done) >= final or time.monotonic() > deadline:
                return runs
            time.sleep(0.25)

    def tail_logs(self, n: int = 40) -> str:
        out = []
        for f in sorted(self.logs.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    # its own session, SIGINT at its default: SIGTERM stops it (a bash `&` job would ignore it)
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


# module-scoped: the three workers' polls cost the server ~4 CPU-s a minute even when no test uses it, and a
# session-scoped cluster lived on to the end of the session in each pytest-xdist worker whose files used it
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from moto.server import ThreadedMotoServer

    base = tmp_path_factory.mktemp("cluster")
    logs = base / "logs"
    logs.mkdir()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    s3.start()
    endpoint = f"http://127.0.0.1:{s3._port}"
    api = f"http://127.0.0.1:{free_port()}/api"
    # none of the test process's own settings but benchmarks/suite_cpu.py's mark: the cluster's CPU is the suite's
    skip = ("PREFECT_", "MLFLOW_", "AWS_", "SHARDLINE_")
    env = {k: v for k, v in os.environ.items() if k == "SHARDLINE_SUITE_CPU" or not k.startswith(skip)}
    env.update(
        PWD=str(REPO),  # prefect.yaml's pull step: {{ $PWD }}
        PREFECT_HOME=str(base / "prefect-home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        # a poll every 2 s (Prefect's default: 10): a dispatch waits 1 s more on average, and the idle server spends
        # 4.0 CPU-s a minute instead of 6.4 with one a second (measured with these three workers, 2026-12-02)
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="1",
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",  # a schedule turned on makes its runs within seconds
        AWS_ENDPOINT_URL=endpoint,
        MLFLOW_S3_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        MLFLOW_ENABLE_ASYNC_LOGGING="false",
        SHARDLINE_CACHE=str(base / "worker-cache"),
    )
    procs = [
        _start(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", api.split(":")[2].split("/")[0]],
            env,
            logs / "server.log",
        )
    ]
    c = Cluster(env=env, api=api, base=base, logs=logs)
    try:
        wait_until(lambda: _healthy(api), 180, "the Prefect server")
        for pool in ("cpu-pool", "gpu-pool"):
            c.prefect("work-pool", "create", "--type", "process", pool)
        c.prefect("--no-prompt", "deploy", "--all")
        # one CPU worker; two GPU workers, each a GPU machine that trains one run at a time (`--limit 1`)
        for pool, name, limit in WORKERS:
            cmd = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--name", name]
            procs.append(_start(cmd + (["--limit", str(limit)] if limit else []), env, logs / f"{name}.log"))
        wait_until(
            lambda: _workers(api, "cpu-pool") >= 1 and _workers(api, "gpu-pool") >= 2, 120, "the three workers to poll"
        )

        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="test", secret="test")
        if fs.exists(BUCKET):  # moto's buckets are its process's: an earlier module's cluster in this one left it
            fs.rm(BUCKET, recursive=True)
        fs.mkdir(BUCKET)
        for p in make_raw(base / "raw", n_seq=15, rows=80):
            fs.put(str(p), f"{BUCKET}/raw/{p.name}")
        c.fs = fs
        yield c
    finally:
        _stop(procs)
        s3.stop()


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _workers(api: str, pool: str) -> int:
    r = httpx.post(f"{api}/work_pools/{pool}/workers/filter", json={}, timeout=10)
    return len(r.json()) if r.status_code == 200 else 0
