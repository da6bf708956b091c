"""No secret leaves the process: one redaction function, used wherever Shardline writes (MLflow, the
storage root, Prefect's API, the terminal), checked by planting recognisable secrets and searching every
byte the pipeline wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardline.core.config import validate_config
from shardline.core.secrets import KEEP_SECRETS, redact, redact_text
from tests.conftest import make_raw, tiny_config
from tests.mlflow_server import MlflowServer

BIN = Path(sys.executable).parent

JOB_ENV = ("DB_PASS", "WANDB_KEY", "PGPASSWORD", "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING", "OPENAI_KEY")
SECRETS = {
    "url": "PLANTED-URL-PASSWORD-4711",
    "jobvar": "PLANTED-JOBVAR-SECRET-0099",
    **{n: f"PLANTED-{n.replace('_', '-')}-{i:04d}" for i, n in enumerate((*JOB_ENV, "GITHUB_PAT", "RUN_LABEL"))},
    "env": "PLANTED-ENV-SECRET-KEY-0042",
}


def test_secrets_are_found_by_name_and_place_not_by_equal_text(monkeypatch):
    # a short credential value ("test", as moto and many CI setups use) must not mask a bucket or a path
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    assert redact_text("s3://test/raw/*.parquet: no such bucket test") == "s3://test/raw/*.parquet: no such bucket test"
    # a real-length credential of this process is masked wherever it appears
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz")
    assert redact_text("401 for token hf_abcdefghijklmnopqrstuvwxyz") == "401 for token ***"
    # the shell's working folder is no password, though `pwd` names one: the paths under it stay readable
    monkeypatch.setenv("PWD", "/home/alice/projects/replays")
    assert redact_text("no file /home/alice/projects/replays/raw") == "no file /home/alice/projects/replays/raw"
    assert redact_text("postgresql://user:pa55@db:5432/mlflow") == "postgresql://***@db:5432/mlflow"
    assert redact_text("https://tok3n@mlflow.example.com") == "https://***@mlflow.example.com"
    assert redact_text("MLFLOW_TRACKING_PASSWORD=hunter2 AWS_REGION=eu-west-1") == (
        "MLFLOW_TRACKING_PASSWORD=*** AWS_REGION=eu-west-1"
    )
    # by whole words of the name: max_tokens, tokenizer and sequence_key are settings, not secrets; every value
    # of a job's environment is one, whatever its name
    assert redact(
        {"env": {"AWS_SECRET_ACCESS_KEY": "x", "RUN_LABEL": "eu"}, "max_tokens": 512, "tokenizer": "bpe"}
        | {"sequence_key": "game_id", "cache_key": "k"}
    ) == {
        "env": {"AWS_SECRET_ACCESS_KEY": "***", "RUN_LABEL": "***"},
        "max_tokens": 512,
        "tokenizer": "bpe",
        "sequence_key": "game_id",
        "cache_key": "k",
    }
    # the names credentials go by, and a presigned URL's signature
    names = ("DB_PASS", "WANDB_KEY", "PGPASSWORD", "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING")
    for name in (*names, "OPENAI_KEY", "GITHUB_PAT"):
        assert redact_text(f"failed: {name}=v4lue-1234 (retry)") == f"failed: {name}=*** (retry)", name
        assert redact({name: "v4lue-1234"}) == {name: "***"}, name
    presigned = "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA1%2F2&X-Amz-Signature=f00d&x-id=GetObject"
    assert redact_text(f"403 on {presigned}") == (
        "403 on https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x-id=GetObject"
    )
    assert redact_text("https://acct.blob.core.windows.net/c/b?sv=2024&sig=AbC%3D") == (
        "https://acct.blob.core.windows.net/c/b?sv=2024&sig=***"
    )
    # a URL that went through a path (`//` collapsed): its password was left in the error
    assert redact_text("not found: /w/tracking_uri: http:/bob:TrackPw987@127.0.0.1:5902") == (
        "not found: /w/tracking_uri: http:/***@127.0.0.1:5902"
    )
    assert redact_text("file:/tmp/runs/a@b.parquet") == "file:/tmp/runs/a@b.parquet"
    assert redact_text("models:/no-such-model@champion") == "models:/no-such-model@champion"  # a model's URI
    # an exception's class is no setting: its message stays readable (it read "NoCredentialsError: *** to locate")
    assert redact_text("NoCredentialsError: Unable to locate credentials") == (
        "NoCredentialsError: Unable to locate credentials"
    )


def test_a_config_serialized_as_json_has_its_secrets_masked_unless_asked(tmp_path):
    cfg = tiny_config("raw/*.parquet", str(tmp_path))
    cfg["mlflow"]["tracking_uri"] = "https://alice:s3cr3t@mlflow.example.com"
    cfg["compute"] = {"job_variables": {"env": {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_REGION": "eu"}}}
    config = validate_config(cfg)
    dumped = config.model_dump(mode="json")  # what Prefect stores as the flow's parameter
    assert dumped["mlflow"]["tracking_uri"] == "https://***@mlflow.example.com"
    assert dumped["compute"]["job_variables"]["env"] == {"AWS_SECRET_ACCESS_KEY": "***", "AWS_REGION": "***"}
    assert "s3cr3t" not in config.model_dump_json()
    kept = config.model_dump(mode="json", context=KEEP_SECRETS)
    assert kept["mlflow"]["tracking_uri"] == cfg["mlflow"]["tracking_uri"]
    assert config.mlflow.tracking_uri == cfg["mlflow"]["tracking_uri"]  # the object itself keeps them
    # a rotated password is the same config
    cfg["mlflow"]["tracking_uri"] = "https://alice:n3w@mlflow.example.com"
    assert validate_config(cfg).hash() == config.hash()


@pytest.mark.e2e
def test_planted_secrets_appear_in_no_byte_the_pipeline_writes(tmp_path):
    """A credential in the tracking URI, in the training job's environment (config) and in this
    process's environment; the pipeline runs through a real MLflow server and a real Prefect API (its
    database in this test's folder); then every file under the folder (MLflow's store and artifacts, the
    storage root, Prefect's database) and the CLI's output are searched for them. A public marker planted
    beside them is found, so the search reaches those stores."""
    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()
    port = server.port
    try:
        make_raw(tmp_path / "raw", n_seq=9, rows=40)
        cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 1})
        cfg["mlflow"]["tracking_uri"] = f"http://planted-user:{SECRETS['url']}@127.0.0.1:{port}"
        cfg["name"] = "public-marker-77"  # a public value: found, so the search reaches the stores
        job_env = {name: SECRETS[name] for name in (*JOB_ENV, "GITHUB_PAT", "RUN_LABEL")}
        cfg["compute"] = {"job_variables": {"env": {"AWS_SECRET_ACCESS_KEY": SECRETS["jobvar"], **job_env}}}
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        env = {
            **os.environ,
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "SHARDLINE_CACHE": str(tmp_path / "cache"),
            "PLANTED_API_TOKEN": SECRETS["env"],
        }
        env.pop("PREFECT_API_URL", None)
        out = subprocess.run(
            [str(BIN / "shardline"), "run", str(tmp_path / "cfg.yaml")],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        assert "Registered tiny-model version 1" in out.stdout
        bad = subprocess.run(  # an error message that would carry the URI
            [str(BIN / "shardline"), "run", str(tmp_path / "cfg.yaml"), "--set", "data.source=/nowhere/*.parquet"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
        assert bad.returncode != 0
    finally:
        server.stop()

    texts = {"stdout": out.stdout + bad.stdout, "stderr": out.stderr + bad.stderr}
    found: dict[str, list[str]] = {}
    searched = 0
    for path in tmp_path.rglob("*"):
        if not path.is_file() or path.name == "cfg.yaml" or path.parent == tmp_path / "raw":
            continue  # the user's own config and data hold what they hold
        data = path.read_bytes()
        searched += len(data)
        for what, secret in SECRETS.items():
            if secret.encode() in data:
                found.setdefault(what, []).append(str(path.relative_to(tmp_path)))
        if b"public-marker-77" in data:
            found.setdefault("marker", []).append(str(path.relative_to(tmp_path)))
    for name, text in texts.items():
        for what, secret in SECRETS.items():
            if secret in text:
                found.setdefault(what, []).append(name)
    markers = found.pop("marker", [])
    lines = [
        line for line in (out.stdout + bad.stdout + out.stderr + bad.stderr).splitlines() if SECRETS["url"] in line
    ]
    assert not found, f"secrets written to: {found}; {lines[:5]}"
    # the search reaches the stores: the public value is in Prefect's database, the run folder and MLflow's
    assert any("prefect-home" in m for m in markers), markers
    assert any(m.startswith("store/runs/") for m in markers), markers
    assert any(m.startswith("mlflow-server") for m in markers), markers
    assert searched > 1_000_000


def test_redaction_reads_an_environment_another_thread_changes(monkeypatch):
    """MLflow's telemetry sets and deletes a variable of its own while training runs: a redaction reading
    the environment at that moment still redacts (it failed a training run with a KeyError)."""
    import threading

    from shardline.core.secrets import redact_text

    monkeypatch.setenv("SHARDLINE_TEST_API_TOKEN", "tok-0123456789abcdef")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.environ["_SHARDLINE_TEST_CHURN"] = "x"
            os.environ.pop("_SHARDLINE_TEST_CHURN", None)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(3000):
            assert "tok-0123456789abcdef" not in redact_text("token tok-0123456789abcdef in a log line")
    finally:
        stop.set()
        t.join()


def test_a_job_s_masked_environment_is_passed_on_as_this_process_has_it(monkeypatch):
    """A training run on a worker is handed its config with the job's environment masked; the runs it starts (its
    other nodes) get the values its own process has (the worker set them), never the mask."""
    from shardline.core.secrets import job_variables_here

    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0.2")
    monkeypatch.delenv("ABSENT_HERE", raising=False)
    masked = {"env": {"SHARDLINE_TEST_STEP_DELAY": "***", "ABSENT_HERE": "***", "PLAIN": "1"}, "image": "x"}
    assert job_variables_here(masked) == {
        "env": {"SHARDLINE_TEST_STEP_DELAY": "0.2", "ABSENT_HERE": "***", "PLAIN": "1"},
        "image": "x",
    }
    assert job_variables_here({}) == {} and job_variables_here({"image": "x"}) == {"image": "x"}
