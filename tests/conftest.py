import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

if "SHARDLINE_CACHE" not in os.environ:  # unpacked shards of this test session, not the user's ~/.cache
    os.environ["SHARDLINE_CACHE"] = tempfile.mkdtemp(prefix="shardline-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SHARDLINE_CACHE"], True)  # a run left ~50 MB a worker behind
if "SHARDLINE_TEST_MLFLOW_TEMPLATES" not in os.environ:  # the migrated MLflow store (tests/hooks/sitecustomize.py)
    os.environ["SHARDLINE_TEST_MLFLOW_TEMPLATES"] = tempfile.mkdtemp(prefix="shardline-test-mlflow-")
    atexit.register(shutil.rmtree, os.environ["SHARDLINE_TEST_MLFLOW_TEMPLATES"], True)
if "PYTEST_XDIST_WORKER" in os.environ and "PREFECT_HOME" not in os.environ:
    # each pytest-xdist worker (scripts/test runs three) gets a Prefect home of its own: the `shardline`
    # processes the tests start use the ephemeral API, whose SQLite file two workers must not share
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="shardline-test-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)

from pathlib import Path

import numpy as np
import polars as pl
import pytest

# the test-only delays of a training (tests/hooks/sitecustomize.py): in this process, and in every process it starts
_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HOOKS, os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, _HOOKS)
import sitecustomize  # noqa: E402, F401  (the test hooks, loaded by this process too)

sys.path.remove(_HOOKS)


def make_raw(folder: Path, n_seq: int = 12, rows: int = 60, seed: int = 0, prefix: str = "s") -> list[Path]:
    """Tiny sequences whose `label` is the previous row's `kind` (learnable from a window), 3 sequences a file."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    frames = []
    for i in range(n_seq):
        kind = rng.choice(["a", "b", "c"], size=rows)
        frames.append(
            pl.DataFrame(
                {
                    "seq": [f"{prefix}{i:03d}"] * rows,
                    "t": np.arange(rows, dtype=np.int32),
                    "x": rng.normal(size=rows).astype(np.float32),
                    "y": rng.normal(loc=5, scale=2, size=rows),
                    "flag": rng.random(rows) > 0.5,
                    "kind": kind,
                    "label": np.roll(kind, 1),  # the previous row's kind: learnable from the window
                    "value": rng.normal(size=rows) + (kind == "a") * 3.0,
                    "season": np.full(rows, 2020 + i % 4, dtype=np.int16),
                }
            )
        )
    paths = []
    for j in range(0, n_seq, 3):
        p = folder / f"{prefix}-{j // 3:03d}.parquet"
        pl.concat(frames[j : j + 3]).write_parquet(p)
        paths.append(p)
    return paths


def write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> dict:
    """Write arrays into one shard file at `path` as the encoder lays them out; the layout (name -> ArraySpec)."""
    from shardline.core.shards import allocate

    buf, specs, views = allocate({name: (arr.dtype, arr.shape) for name, arr in arrays.items()})
    for name, arr in arrays.items():
        views[name][...] = arr
    Path(path).write_bytes(buf)
    return specs


def tiny_config(source: str, root: str, **over) -> dict:
    cfg = {
        "name": "tiny",
        "data": {
            "source": source,
            "sequence_key": "seq",
            "order_by": "t",
            "window": 3,
            "features": {"continuous": ["x", "y"], "boolean": ["flag"], "categorical": ["kind"]},
            "target": {"column": "label", "task": "classification"},
            "split": {"method": "hash", "seed": 1, "fractions": {"train": 0.6, "validation": 0.2, "test": 0.2}},
            "files_per_group": 2,
        },
        "model": {"family": "mlp", "hidden": 32, "layers": 1, "dropout": 0.0},
        "training": {"epochs": 2, "batch_size": 32, "lr": 0.01, "warmup_steps": 2, "checkpoint_every_steps": 5},
        "storage": {"root": root},
        "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "tiny", "model_name": "tiny-model"},
    }
    for key, value in over.items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return cfg


def split_targets(split, i: int = 0) -> np.ndarray:
    """Target `i` of every window of a SplitData, in window order (class ids or standardised values): [N], or
    [N, K] when every position is predicted."""
    dtype = np.float32 if split.tasks[i] == "regression" else np.int64
    parts = split.each_shard(lambda v, s: v.gather_targets(np.asarray(v.starts))[i].astype(dtype))
    return np.concatenate(parts) if parts else np.zeros((0, split.window) if split.positions == "all" else (0,), dtype)


def list_checkpoints(dir_uri: str) -> list[str]:
    """Names of the checkpoints in `dir_uri` that have a sidecar, oldest first (not checksum-verified)."""
    from shardline.trainer.checkpoint import _steps, checkpoint_name

    return [checkpoint_name(s) for s in reversed(_steps(dir_uri))]


@pytest.fixture
def raw_dir(tmp_path) -> Path:
    make_raw(tmp_path / "raw")
    return tmp_path / "raw"


@pytest.fixture(autouse=True)
def _sys_path_as_it_was():
    """A test that loads a model with MLflow's own `mlflow.pyfunc.load_model` leaves the model's code folder first on
    sys.path; the tests after it in this worker would start processes (a Dask cluster of their own) that import
    Shardline from that model's partial copy."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.fixture(autouse=True)
def _no_tracking_server_from_the_shell(monkeypatch):
    """Tests use their own stores, never an MLflow server exported in the developer's shell."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# the Prefect test server the pytest-xdist controller started for its workers (pytest_configure below)
SHARED_API = "SHARDLINE_TEST_PREFECT_API"


def pytest_configure(config):
    """Under pytest-xdist (scripts/test runs three workers), the controller starts one throwaway Prefect API for
    all its workers, rather than each worker its own: an idle server costs ~1.5 CPU-s a minute, and each start ~5."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) or os.environ.get(SHARED_API):
        return
    import contextlib

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    stack = contextlib.ExitStack()
    home = tempfile.mkdtemp(prefix="shardline-test-prefect-")  # not the user's ~/.prefect; each worker has its own
    stack.callback(shutil.rmtree, home, True)
    stack.enter_context(temporary_settings(updates={PREFECT_HOME: home}))
    stack.enter_context(prefect_test_harness(server_startup_timeout=180))
    os.environ[SHARED_API] = PREFECT_API_URL.value()  # the workers, started after this, inherit it
    config.add_cleanup(stack.close)


@pytest.fixture(scope="session")
def prefect_api():
    """A real, throwaway Prefect API (SQLite) for every flow run in the session: the one the pytest-xdist controller
    started for its workers, else one of this process's own."""
    shared = os.environ.get(SHARED_API)
    if shared:
        import prefect.context
        from prefect.settings import PREFECT_API_URL, temporary_settings

        # as prefect_test_harness sets its server's address: in the settings, and as the process-global settings
        with temporary_settings(updates={PREFECT_API_URL: shared}):
            with prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
                yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def api_env(**extra: str) -> dict[str, str]:
    """The environment for a `shardline` command in a subprocess that talks to the session's Prefect API (the
    `prefect_api` fixture, which the test must use) rather than starting a temporary server of its own: ~5 s of
    CPU saved a command. For tests that are not about a laptop's ephemeral API (test_cli, test_packaging,
    test_crash_e2e and the GPU kit's loop keep it)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "api_env() needs the prefect_api fixture"
    return {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": url, **extra}


def recorded_task_runs(flow_run_id, name_prefix: str = "", count: int = 1, timeout: float = 90.0) -> list:
    """The task runs of a finished flow run, once the API has recorded at least `count` of them named
    `name_prefix...` in a final state. A task run's states reach the Prefect server as events that its
    task-run recorder writes a moment later, so a read right after the flow returns can miss the last one
    (CI on stop 58: 7 of 8 encode groups). Returns what is there at the deadline; the test's assert says what is not."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        named = [r for r in runs if r.name.startswith(name_prefix)]
        done = [r for r in named if r.state is not None and r.state.is_final()]
        if len(done) >= count or time.monotonic() > deadline:
            return runs
        time.sleep(0.25)


# ---------------------------------------------------------------- CI guard: the pipeline really ran
_e2e = {"collected": 0, "passed": 0, "skipped": []}


# the longest files first (a full run's durations, 2026-12-04: `--durations=0`, each file's tests summed): pytest-xdist
# hands whole files to its workers in this order, so the longest start at once and the short ones fill in behind
# them (the order of 2026-11-24 had test_examples and test_ddp, now the 2nd and 6th longest, 12th and 14th, and
# test_caching_e2e, the 9th, after every listed file)
_LONGEST_FIRST = (
    "test_remote_e2e.py",
    "test_examples.py",
    "test_sweep.py",
    "test_crash_e2e.py",
    "test_packaging.py",
    "test_ddp.py",
    "test_resume_kill.py",
    "test_gpu_kit.py",
    "test_caching_e2e.py",
    "test_user_model_e2e.py",
    "test_tracker_outage.py",
    "test_cli.py",
    "test_time_columns.py",
    "test_cost_e2e.py",
    "test_registry.py",
    "test_doctor.py",
    "test_sweep_optuna.py",
    "test_text_pipeline.py",
    "test_secrets.py",
    "test_s3_source.py",
    "test_seed_scale.py",
    "test_gc.py",
    "test_lease.py",
    "test_kfold.py",
)


def pytest_collection_modifyitems(config, items):
    _e2e["collected"] = sum(1 for i in items if i.get_closest_marker("e2e"))
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_runtest_logreport(report):
    if "e2e" not in report.keywords:
        return
    if report.skipped:
        _e2e["skipped"].append(report.nodeid)
    elif report.when == "call" and report.passed:
        _e2e["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("SHARDLINE_REQUIRE_E2E") != "1" or exitstatus not in (0,):
        return
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller, which sees every report, checks
    problems = []
    distributed = getattr(session.config.option, "numprocesses", None)
    if _e2e["collected"] == 0 and not distributed:  # under xdist the controller collects nothing itself
        problems.append("no end-to-end test was collected")
    if _e2e["skipped"]:
        problems.append(f"end-to-end test(s) skipped: {_e2e['skipped']}")
    if _e2e["passed"] == 0:
        problems.append("no end-to-end test passed")
    if problems:
        print(
            "\nSHARDLINE_REQUIRE_E2E=1 but " + "; ".join(problems) + " -- a green run must mean the pipeline ran",
            flush=True,
        )
        session.exitstatus = 3


from tests.cluster import cluster  # noqa: E402,F401  (module fixture: Prefect server, pool workers, S3)
