"""Screenshots of what a user sees, taken with headless Chromium: a Prefect server and an MLflow server
on 127.0.0.1, the demo pipeline run against them, then the pages a user opens.

    apt-get install chromium            # once (Debian/Ubuntu; any Chromium or Chrome on PATH will do)
    .venv/bin/python scripts/screenshots.py [--out screenshots] [--games 24] [--frames 600] [--epochs 4]

Writes PNGs to --out: the pipeline's flow run (its task graph), the training flow run's logs, the live
training table while it trains and when done, the model report, the per-class table, and in MLflow the
run's overview, its model metrics and system metrics, and the registered version. Not run by CI (no
browser there); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {seconds:.0f} s")


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no Chromium on PATH: install your distribution's package (apt-get install chromium)")


def shoot(chrome: str, url: str, path: Path, height: int = 1100) -> None:
    subprocess.run(
        [
            chrome,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--window-size=1600,{height}",
            "--virtual-time-budget=25000",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    print(f"  {path.name}: {url}")


def api(base: str, path: str, body: dict | None = None):
    req = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "screenshots")
    ap.add_argument("--games", type=int, default=24)
    ap.add_argument("--frames", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the servers' folder (printed) afterwards")
    args = ap.parse_args()
    chrome = browser()
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="shardline-screenshots-"))
    prefect_port, mlflow_port = free_port(), free_port()
    prefect_ui, mlflow_ui = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": f"{prefect_ui}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "SHARDLINE_PROGRESS_SECONDS": "1",
        "SHARDLINE_SYSTEM_METRICS_SECONDS": "2",
    }
    servers = []
    try:
        servers.append(
            subprocess.Popen(
                [VENV / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        db = home / "demo" / "mlflow.db"
        db.parent.mkdir(parents=True)
        servers.append(
            subprocess.Popen(
                [
                    VENV / "mlflow",
                    "server",
                    "--backend-store-uri",
                    f"sqlite:///{db}",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mlflow_port),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_http(f"{prefect_ui}/api/health")
        wait_http(f"{mlflow_ui}/health")
        print(f"Prefect UI {prefect_ui}, MLflow UI {mlflow_ui}; running the demo ({args.games} games) ...")
        demo = subprocess.Popen(
            [
                VENV / "shardline",
                "demo",
                "--home",
                str(home / "demo"),
                "--games",
                str(args.games),
                "--frames",
                str(args.frames),
                "--set",
                f"training.epochs={args.epochs}",
                "--set",
                f"mlflow.tracking_uri={mlflow_ui}",
            ],
            env=env,
        )
        shot_live = False
        while demo.poll() is None:  # the live table while training runs
            if not shot_live:
                live = api(
                    f"{prefect_ui}/api", "/artifacts/latest/filter", {"artifacts": {"key": {"any_": ["train-live"]}}}
                )
                if live:
                    time.sleep(3)
                    shoot(
                        chrome,
                        f"{prefect_ui}/artifacts/artifact/{live[0]['latest_id']}",
                        args.out / "3-live-table-training.png",
                        800,
                    )
                    shot_live = True
            time.sleep(1)
        if demo.returncode != 0:
            raise SystemExit(f"the demo failed (exit {demo.returncode})")

        runs = api(f"{prefect_ui}/api", "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 20})
        by_flow = {}
        for run in runs:
            flow = api(f"{prefect_ui}/api", "/flows/filter", {"flows": {"id": {"any_": [run["flow_id"]]}}})[0]["name"]
            by_flow.setdefault(flow, run)
        pipeline_run, train_run = by_flow["pipeline"], by_flow["train"]
        shoot(chrome, f"{prefect_ui}/runs/flow-run/{pipeline_run['id']}", args.out / "1-prefect-pipeline-run.png")
        shoot(
            chrome, f"{prefect_ui}/runs/flow-run/{train_run['id']}?tab=Logs", args.out / "2-prefect-training-logs.png"
        )
        latest = api(f"{prefect_ui}/api", "/artifacts/latest/filter", {})
        keys = {a["key"]: a["latest_id"] for a in latest}
        for n, key in ((4, "train-live"), (5, "model-report"), (6, "per-class")):
            if key in keys:
                shoot(chrome, f"{prefect_ui}/artifacts/artifact/{keys[key]}", args.out / f"{n}-prefect-{key}.png")

        from mlflow import MlflowClient

        client = MlflowClient(mlflow_ui)
        version = client.get_model_version_by_alias("shardline-demo", "champion")
        exp = client.get_run(version.run_id).info.experiment_id
        run_page = f"{mlflow_ui}/#/experiments/{exp}/runs/{version.run_id}"
        shoot(chrome, run_page, args.out / "7-mlflow-run-overview.png", 1400)
        shoot(chrome, f"{run_page}/model-metrics", args.out / "8-mlflow-model-metrics.png", 1400)
        shoot(chrome, f"{run_page}/system-metrics", args.out / "9-mlflow-system-metrics.png", 1400)
        shoot(
            chrome,
            f"{mlflow_ui}/#/models/shardline-demo/versions/{version.version}",
            args.out / "10-mlflow-version.png",
        )
        print(f"screenshots in {args.out}")
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            try:
                s.wait(timeout=20)
            except subprocess.TimeoutExpired:
                s.kill()
        if args.keep:
            print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
