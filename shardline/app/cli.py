"""`shardline`: demo, run, sweep, check-config, predict, generate, rehearse, doctor, cost, gc."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import typer

from shardline.app.console import unwrapped_help
from shardline.app.ephemeral_api import own_database, start_ephemeral_api
from shardline.app.summary import summary, sweep_summary

# Prefect's ephemeral API takes 15-25 s to start on a small machine; its default allows 20.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Raw parquet -> shards -> a trained, evaluated model in the MLflow registry, as one Prefect pipeline.",
)
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@app.callback()
def _every_command() -> None:
    """Before any command: a temporary Prefect API it starts (doctor's, gc's, cost's and rehearse's too, not only a
    run's) keeps its runs in Shardline's own database, not ~/.prefect/prefect.db."""
    own_database()


def _fail(msg: str, code: int = 1) -> None:
    from shardline.core.failures import BUDGET_EXIT_CODE, PREEMPTED_EXIT_CODE
    from shardline.core.secrets import redact_text

    if code in (130, PREEMPTED_EXIT_CODE, BUDGET_EXIT_CODE):  # asked to stop, or out of budget: no error
        typer.secho(f"stopped: {redact_text(msg)}", fg=typer.colors.YELLOW, err=True)
    else:
        typer.secho(f"error: {redact_text(msg)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _load(path: Path | None, overrides: list[str], base: dict | None = None, parent: bool = False):
    """The validated config, or exit 2 naming what to fix: a bad key, a model entrypoint that does not import, or
    (`parent`: a command that trains) a training.init_from that names no model or checkpoint, or does not fit."""
    from shardline.core.config import ConfigError, load_config

    try:
        config = load_config(path, overrides, base=base)
    except ConfigError as e:
        _fail(str(e), 2)
    tokenizer = config.data.tokenizer
    if tokenizer is not None and tokenizer.file and "://" not in tokenizer.file:  # a file here: read before any work
        from shardline.core.encoding.columns import DataError
        from shardline.core.encoding.text import read_tokenizer_file

        try:
            read_tokenizer_file(tokenizer.file)
        except DataError as e:
            _fail(str(e), 2)
    if config.model.entrypoint:
        from shardline.trainer.contract import ModelContractError, check_params

        try:
            check_params(config.model.entrypoint, config.model.params, config.model.code_dir)
        except ModelContractError as e:
            _fail(str(e), 2)
    if parent:
        _check_parent(config)
    return config


FORCE_HELP = "recompute this step and every step after it: ingest, encode, train, evaluate or register"


@contextlib.contextmanager
def _flow_run(verbose: bool, again: str, errors: tuple[type[Exception], ...] = ()):
    """Around a flow run: a temporary Prefect API without a server (one that Ctrl-C does not stop under the run),
    the user's mistakes kept off the console (`quiet_console`), errors as exit statuses (Ctrl-C, or a SIGTERM
    before the training could take it: what to do `again`)."""
    from prefect.exceptions import TerminationSignal

    from shardline.app.console import interrupt, quiet_console
    from shardline.core import failures
    from shardline.core.encoding.columns import DataError
    from shardline.core.tracking.tracker import TrackingUnreachable
    from shardline.core.unreachable import StorageUnreachable

    def stop(signum, frame):  # where Prefect's flow run hands a SIGTERM back, after its own handling of it
        raise TerminationSignal(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    interrupted = signal.signal(signal.SIGINT, interrupt)  # Ctrl-C, but never inside an import (it hung the run)
    try:
        start_ephemeral_api()
        with quiet_console(verbose):
            yield
    except KeyboardInterrupt:
        _fail(f"interrupted; {again}", 130)
    except TerminationSignal:
        _fail(f"stopped by SIGTERM; {again}", failures.PREEMPTED_EXIT_CODE)
    except Exception as e:
        if isinstance(e, failures.Preempted):  # a distinct status: preempted, not broken; the same command resumes
            _fail(f"{e}", failures.PREEMPTED_EXIT_CODE)
        if isinstance(e, failures.BudgetExceeded):  # its own status: out of budget, not broken; raise it to resume
            _fail(f"{e}", failures.BUDGET_EXIT_CODE)
        if full := failures.out_of_space(e):  # a full disk: which, and what to do
            _fail(full)
        from shardline.core.storage import ChecksumMismatch

        said = (DataError, ValueError, FileNotFoundError, PermissionError, ChecksumMismatch, StorageUnreachable)
        quiet = (*said, TrackingUnreachable, *errors)
        if isinstance(e, quiet) or failures.raised_in_your_code(e):  # or a bug in the user's own model code
            _fail(f"{e}{failures.raised_in_your_code(e)}")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, interrupted)


def _run_pipeline(config, force: str | None = None, verbose: bool = False) -> dict:
    from shardline.flows.pipeline import pipeline
    from shardline.tasks.caching import STEPS

    if force is not None and force not in STEPS:
        _fail(f"--force {force}: not a step; choose one of {', '.join(STEPS)}", 2)
    with _flow_run(verbose, "run the same command again to resume"):
        return pipeline(config, force=force)


@app.command()
def demo(
    home: Path = typer.Option(
        Path("shardline-home"), "--home", help="folder for the demo data, shards, checkpoints and the MLflow store"
    ),
    games: int = typer.Option(160, help="number of generated games (one parquet file each)"),
    frames: int = typer.Option(2000, help="frames per game"),
    seed: int = typer.Option(0, help="seed of the data generator"),
    set_: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="override a config key, e.g. --set training.epochs=1 (repeatable)"
    ),
    force: str | None = typer.Option(None, "--force", metavar="STEP", help=FORCE_HELP),
) -> None:
    """Make the demo data set, then run the whole pipeline on it with embedded defaults (no server, CPU/GPU auto)."""
    from shardline.app.demo_home import demo_raw_data

    home = home.resolve()
    raw = home / "data" / "raw"
    demo_raw_data(raw, games, frames, seed, say=typer.echo)  # games added: the new files alone, the others kept
    base = {
        "data": {"source": str(raw / "*.parquet")},
        "storage": {"root": str(home / "store")},
        "mlflow": {"tracking_uri": f"sqlite:///{home / 'mlflow.db'}"},
    }
    from shardline.core.config import read_yaml

    defaults = read_yaml(DEMO_CONFIG)
    for section, values in base.items():
        defaults.setdefault(section, {}).update(values)
    config = _load(None, list(set_), base=defaults)
    summary(_run_pipeline(config, force))


@app.command()
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml", help="the pipeline config (may `extends:` another)"),
    set_: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="override a config key, e.g. --set training.lr=3e-4 (repeatable)"
    ),
    force: str | None = typer.Option(None, "--force", metavar="STEP", help=FORCE_HELP),
    verbose: bool = typer.Option(False, "--verbose", help="show tracebacks of errors in the config or the data"),
) -> None:
    """Run the pipeline on your own data, as the config file describes."""
    config = _load(config_path, list(set_), parent=True)
    summary(_run_pipeline(config, force, verbose))


def _check_parent(config) -> None:
    """A fine-tune whose parent (training.init_from) is not there, or does not fit the config, its columns or its
    learned positions' window: exit 2 naming the fix, as a config's mistake (the flow checks it again before any
    work, for a deployment's run). Anything else (a registry out of reach) is the flow's to say."""
    if not config.training.init_from:
        return
    from shardline.core.encoding.reuse import EncodingMismatch, check_columns
    from shardline.runs.parent import check_window, parent_encoding, resolve_parent

    try:
        parent = resolve_parent(config)
    except ValueError as e:  # names no registered version or checkpoint
        _fail(str(e), 2)
    except Exception:  # noqa: BLE001 - said by the flow, with its retries and context
        return
    try:
        encoding = parent_encoding(config, parent)
        check_columns(config.data.features.model_dump(), encoding, parent.uri)
        check_window(config, encoding, parent.uri)
    except EncodingMismatch as e:
        _fail(str(e), 2)
    except Exception:  # noqa: BLE001 - said by the flow, with its retries and context
        return


@app.command()
def node(
    job: str = typer.Argument(..., metavar="JOB", help="the training's job in storage (s3://.../ddp/job.json)"),
    endpoint: str | None = typer.Option(
        None, "--endpoint", help="the rendezvous HOST:PORT; default: the launcher's (PET_RDZV_ENDPOINT, MASTER_ADDR)"
    ),
) -> None:
    """One machine of a training on several, under a launcher (a TrainJob, JobSet, Slurm, SkyPilot).

    Torch's agent for the job that `shardline run` (compute.train_on: launcher) wrote, meeting the other machines
    at the launcher's rendezvous address. The pipeline follows it in storage."""
    from shardline.core.secrets import install_log_redaction
    from shardline.launch.torchrun import launcher_endpoint, run_node, shutdown_seconds

    install_log_redaction()
    try:
        said = run_node(job, endpoint or launcher_endpoint(), shutdown_seconds(), log=typer.echo)
    except ValueError as e:  # no rendezvous address, or a job of one machine
        _fail(str(e), 2)
    except Exception as e:  # noqa: BLE001 - torch's account of it, and a failed exit for the launcher
        _fail(f"{type(e).__name__}: {e}", 1)
    typer.echo(f"training {said}")


def _sweep_plan(
    config_path: Path,
    set_: list[str],
    grid: list[str],
    space_path: Path | None,
    n: int | None,
    seed: int,
    folds: bool = False,
    tpe: int | None = None,
):
    """The checked sweep and the space as given, or exit 2 naming what to fix (nothing has started)."""
    import yaml

    from shardline.core.config import ConfigError, apply_overrides, code_beside, read_yaml, validate_config
    from shardline.core.sweep import parse_grid, plan_sweep, read_space, with_folds

    if grid and space_path is not None:
        _fail("give --grid key=v1,v2 ... or --space SPACE.yaml, not both", 2)
    if n is not None and tpe is not None:
        _fail("give --random N or --tpe N, not both", 2)
    if (n is not None or tpe is not None) and space_path is None:
        _fail(f"--{'random' if n is not None else 'tpe'} N draws from a search space: add --space SPACE.yaml", 2)
    if not grid and space_path is None and not folds:
        _fail("nothing to sweep: give --grid key=v1,v2 (repeatable) or --random N --space SPACE.yaml", 2)
    try:
        raw = code_beside(apply_overrides(read_yaml(config_path), list(set_)), config_path)
        space = parse_grid(grid) if grid else read_space(space_path) if space_path else {}
        swept = with_folds(space, validate_config(raw, f"'{config_path}'")) if folds else space
        plan = plan_sweep(raw, swept, tpe if tpe is not None else n, seed, "tpe" if tpe is not None else None)
    except ConfigError as e:
        _fail(str(e), 2)
    _load(config_path, list(set_), parent=True)  # the user's model imports (the same check as `run`)
    given = dict(space) if grid or not space_path else yaml.safe_load(space_path.read_text())
    return plan, given


@app.command()
def sweep(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml", help="the base config every trial starts from"),
    grid: list[str] = typer.Option(
        [], "--grid", help="a key and its values, e.g. --grid training.lr=0.01,0.001 (repeatable: every combination)"
    ),
    random_n: int | None = typer.Option(None, "--random", min=1, help="draw N trials at random from --space"),
    tpe_n: int | None = typer.Option(
        None, "--tpe", min=1, help="N trials from --space proposed by Optuna's TPE sampler, each from those finished"
    ),
    prune: str | None = typer.Option(
        None,
        "--prune",
        help="stop trials that fall behind at an epoch's end, by Optuna's pruner: median or hyperband",
    ),
    space_path: Path | None = typer.Option(
        None, "--space", help="search space YAML: dotted keys to a list of values or {low, high, log, int}"
    ),
    seed: int = typer.Option(
        0, "--seed", help="seed of --random's draws and of --tpe's sampler: the same seed, the same trials"
    ),
    at_once: int | None = typer.Option(
        None,
        "--at-once",
        min=1,
        help="trials training at once (default: 2 here, each with half the cores; all on a pool)",
    ),
    folds: bool = typer.Option(
        False,
        "--folds",
        help="k-fold data: train every setting on every fold, compare settings by their mean over the folds, and "
        "retrain the best on all non-test data (training.fold: null)",
    ),
    set_: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="override a key of the base config (repeatable)"
    ),
    verbose: bool = typer.Option(False, "--verbose", help="show tracebacks of errors in the config or the data"),
) -> None:
    """Train one model per trial (the config with a few keys overridden), concurrently; register the best.

    Ingest and encode run once (once per data setting a trial changes); each trial is a cached, resumable
    training run: the same command again trains only the trials that did not finish. The trials are an Optuna
    study in the sweep's folder (grid, --random, or --tpe proposals); --prune stops those falling behind. The
    best trial by its validation score is evaluated on the test split and registered behind the champion gate.
    """
    plan, space = _sweep_plan(config_path, set_, grid, space_path, random_n, seed, folds, tpe_n)  # before Prefect
    if prune is not None:
        from shardline.core.sweep import SweepError
        from shardline.tasks.sweep import check_pruning

        try:
            check_pruning(plan, prune)
        except SweepError as e:
            _fail(str(e), 2)
    from shardline.flows.sweep import sweep as sweep_flow

    pruned = f", pruned by {prune}" if prune else ""
    typer.echo(
        f"sweep: {plan.size or len(plan.trials)} {plan.mode} trial(s) over {', '.join(plan.keys)}{pruned}", err=True
    )
    again = "run the same command again: finished trials are cached, the others resume"
    with _flow_run(verbose, again, (RuntimeError,)):
        result = sweep_flow(
            plan.base,
            space,
            trials=tpe_n if tpe_n is not None else random_n,
            seed=seed,
            at_once=at_once,
            folds=folds,
            sampler="tpe" if tpe_n is not None else None,
            prune=prune,
        )
    sweep_summary(result)


@app.command("check-config")
def check_config(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a config key (repeatable)"),
) -> None:
    """Validate a config and print it resolved (after `extends:` and `--set`), without running anything."""
    import yaml

    config = _load(config_path, list(set_), parent=True)
    typer.echo(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    typer.echo(f"# config hash {config.hash()[:16]}")
    _check_first_file(config)


def _check_first_file(config) -> None:
    """One raw file's footer against the config: a column that is not there (a typo) exits 2, naming it and
    the closest columns the file has. A source that cannot be read from here is a note, not an error."""
    from shardline.tasks.ingest import first_file_problems

    try:
        uri, problems = first_file_problems(config.data)
    except Exception as e:  # noqa: BLE001 - unreachable or unreadable from here: said, not fatal
        typer.secho(f"# note: could not read a raw file of {config.data.source}: {e}", fg=typer.colors.YELLOW)
        return
    if uri is None:
        typer.secho(f"# note: data.source {config.data.source} matches no parquet file yet", fg=typer.colors.YELLOW)
        return
    if problems:
        _fail(f"{uri} does not fit the config:\n" + "\n".join(f"  - {p}" for p in problems), 2)
    typer.echo(f"# the columns fit {uri}")


def _load_model(model_uri: str, tracking_uri: str | None):
    """The MLflow pyfunc model at `model_uri`, from `tracking_uri` (else $MLFLOW_TRACKING_URI, else
    ./shardline-home/mlflow.db when there is one); a clear error when it cannot load."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None and Path("shardline-home/mlflow.db").exists():
        uri = f"sqlite:///{Path('shardline-home/mlflow.db').resolve()}"
    import mlflow

    store = uri.removeprefix("sqlite:///") if uri and uri.startswith("sqlite:///") else None
    if store and not Path(store).is_file():  # MLflow would make an empty store there, then find no model in it
        _fail(f"no MLflow store at {store} (the tracking URI {uri}): check the path", 2)
    if uri:
        mlflow.set_tracking_uri(uri)
    elif model_uri.startswith(("models:/", "runs:/")):
        _fail("no MLflow tracking URI: pass --tracking-uri or set MLFLOW_TRACKING_URI", 2)
    from shardline.app.predict_input import registered_like
    from shardline.runs.model_files import load_checked, load_pyfunc

    try:
        # a registered version only with the files it was registered with; a path or run is the user's own choice
        return load_checked(model_uri) if model_uri.startswith("models:/") else load_pyfunc(model_uri)
    except Exception as e:  # noqa: BLE001 - any load failure: reported with the model URI
        code = getattr(e, "error_code", None)  # a URI naming nothing (MLflow says an alias it lacks otherwise)
        missing = code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "alias" in str(e))
        hint = registered_like(model_uri) if missing else ""
        _fail(f"cannot load model {model_uri} from {uri}: {str(e).rstrip('.')}{hint}", 2 if missing else 1)


@app.command()
def predict(
    model_uri: str = typer.Argument(..., help="models:/NAME@champion, models:/NAME/3, runs:/..., or a model folder"),
    input_path: str = typer.Argument(
        ...,
        metavar="INPUT.parquet",
        help="raw rows with the columns the model was trained on: a parquet file, a folder or a glob, local or s3://...",
    ),
    out: str = typer.Option(..., "--out", help="where to write the predictions (a parquet file, local or s3://...)"),
    tracking_uri: str | None = typer.Option(
        None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./shardline-home/mlflow.db)"
    ),
    forecast: bool = typer.Option(False, "--forecast", help="one per sequence: the row data.horizon past its last"),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="a text model's new tokens a row (32; 0: none)"),
) -> None:
    """Write one prediction per window in INPUT, keyed by sequence key and order column so it joins back."""

    if os.path.isdir(out):
        _fail(f"--out {out} is a folder: name the parquet file to write", 2)
    from shardline.app.predict_input import InputError, write_predictions
    from shardline.core.listing import no_bucket

    if missing := no_bucket(out):  # said before the model loads, not after the predictions are made
        _fail(f"--out {out}{missing}", 2)

    model = _load_model(model_uri, tracking_uri)
    try:  # whole files at a time where each file is a sequence (shardline/app/predict_input.py)
        n, rows = write_predictions(model, input_path, model_uri, forecast, max_tokens, out)
    except InputError as e:  # the input, or --out (named)
        _fail(str(e), 2)
    typer.echo(f"wrote {n} prediction(s) for {rows} input row(s) to {out}")


@app.command()
def generate(
    model_uri: str = typer.Argument(..., help="a registered text model: models:/NAME@champion, models:/NAME/3, ..."),
    prompt: list[str] = typer.Option(
        ...,
        "--prompt",
        help="the text to continue (a generation target's source); a model of several text columns takes one "
        "--prompt for each, in their order",
    ),
    max_tokens: int = typer.Option(32, "--max-tokens", help="new tokens at most"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy (the most likely token each step)"),
    top_k: int = typer.Option(0, "--top-k", help="sample among the k most likely tokens (0: every token)"),
    seed: int = typer.Option(0, "--seed", help="the draws' seed: the same seed, the same text"),
    tracking_uri: str | None = typer.Option(
        None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./shardline-home/mlflow.db)"
    ),
) -> None:
    """Print what a registered text model writes after PROMPT.

    For a generation target: the target it writes for PROMPT as its source. The tokenizer comes bundled in the
    model; the decoding keeps a key/value cache."""
    import pandas as pd

    from shardline.app.predict_input import placeholder

    if any(not p for p in prompt):  # before the model loads (it said "column 'text' has 1 null or empty text(s)")
        _fail("--prompt is empty: give the text the model continues", 2)
    model = _load_model(model_uri, tracking_uri)
    python_model = model.unwrap_python_model() if hasattr(model, "unwrap_python_model") else None
    spec = getattr(getattr(python_model, "predictor", None), "spec", None)
    if spec is None or spec.text is None:
        _fail(f"{model_uri} is not a text model (data.features.text): `shardline predict` scores its rows", 2)
    columns = list(spec.text.columns)
    if len(prompt) != len(columns):
        _fail(
            f"{model_uri} reads {len(columns)} text column(s) {columns}: give one --prompt for each, in that order "
            f"(got {len(prompt)})",
            2,
        )
    row: dict[str, object] = dict(zip(columns, prompt))
    # the model's other inputs (a sequence key, an order column, id columns) locate rows; generation reads none
    schema = model.metadata.get_input_schema()
    for col in schema.inputs if schema is not None else []:
        if col.name is not None and col.name not in row:
            row[col.name] = placeholder(col.type)
    frame = pd.DataFrame({name: [value] for name, value in row.items()})
    params = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "seed": seed}
    from mlflow.exceptions import MlflowException

    from shardline.core.encoding.columns import DataError

    predictor = getattr(python_model, "predictor", None)
    try:
        if predictor is None or not hasattr(predictor, "stream_text"):  # a model of another Shardline: at the end
            typer.echo(model.predict(frame, params=params)["generated"].iloc[0])
            return
        import polars as pl

        for piece in predictor.stream_text(pl.from_pandas(frame), params):  # printed as its tokens are drawn
            typer.echo(piece, nl=False)
            sys.stdout.flush()
        typer.echo("")
    except (DataError, MlflowException) as e:
        _fail(str(e), 2)


MARK_COLORS = {"PASS": typer.colors.GREEN, "FAIL": typer.colors.RED, "SKIP": typer.colors.YELLOW}


def _show_check(check, width: int) -> None:
    """One row of `rehearse`'s or `doctor`'s table: PASS, FAIL (bold) or SKIP, the name, the detail."""
    mark = typer.style(check.mark, fg=MARK_COLORS[check.mark], bold=check.ok is False)
    typer.echo(f"{mark}  {check.name.ljust(width)}  {check.detail}")


@app.command()
def rehearse(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a config key (repeatable)"),
    files: int = typer.Option(8, min=1, help="raw files copied for the rehearsal (its tiny data set)"),
    steps: int = typer.Option(20, min=3, help="optimizer steps of the one short epoch"),
    preempt_at: int | None = typer.Option(
        None, min=1, help="step at which training is preempted (default: half of --steps)"
    ),
) -> None:
    """Run the first full loop on tiny data where the real run will go, and print a pass/fail table.

    A few of your raw files, encode, one short epoch on the configured pool with checkpoints, a forced
    preemption (SIGTERM) and resume from storage, metrics, registration as NAME-rehearsal, and a download
    of the registered model that predicts raw rows. Run it before paying for the full run.
    """
    from shardline.app.rehearse import rehearse as run_rehearsal

    config = _load(config_path, list(set_))
    if preempt_at is not None and preempt_at >= steps:
        _fail(f"--preempt-at {preempt_at} must be below --steps {steps}", 2)
    typer.echo(
        f"rehearsing {config.name}: {files} raw file(s), {steps} steps, training on "
        f"{config.compute.train_deployment if config.compute.train_on == 'deployment' else 'this machine'} ..."
    )
    from shardline.app.console import quiet_console

    with quiet_console(verbose=False):  # its own preemption is no error to show: the table says how it went
        rows = run_rehearsal(
            config, files=files, steps=steps, preempt_at=preempt_at, log=lambda m: typer.echo(m, err=True)
        )
    width = max(len(r.name) for r in rows)
    typer.echo("")
    for r in rows:
        _show_check(r, width)
    failed = [r for r in rows if not r.ok]
    if failed:
        typer.secho(f"\nrehearsal failed at: {failed[0].name}", fg=typer.colors.RED, bold=True)
        raise typer.Exit(1)
    typer.secho("\nrehearsal passed: the full run can go", fg=typer.colors.GREEN, bold=True)


@app.command("cost")
def cost_command(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml"),
    gpu: str | None = typer.Option(
        None, "--gpu", help="the GPU type to cost it on (H100, A100-80GB, L4, CPU, ...); default: this machine's"
    ),
    spot: bool | None = typer.Option(
        None, "--spot/--on-demand", help="spot or on-demand prices (default: the config's compute.spot)"
    ),
    prices: Path | None = typer.Option(
        None, "--prices", help="your own prices file, laid over the shipped estimate (default: $SHARDLINE_PRICES)"
    ),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a config key (repeatable)"),
    probe_steps: int = typer.Option(20, "--probe-steps", min=1, help="optimizer steps of the probe on this machine"),
) -> None:
    """Before a run: its optimizer steps, a measured rate, and its time and cost per provider of a GPU type.

    The data is ingested and encoded first (cached: the run reuses it). The rate is this config's own run on
    that GPU type when there is one, else a short probe of the training step on this machine, which only
    stands for this machine's type: another --gpu needs a run on it (exit 1 says so). Prices: an estimate.
    """
    from shardline.app.cost import CostError, plan_cost, report
    from shardline.core.cost.prices import gpu_type, load_prices

    config = _load(config_path, list(set_))
    try:  # a bad --gpu or prices file: said before any work
        table = load_prices(prices)
        target = gpu_type(gpu) if gpu else None
        if target is not None:
            table.of(target)
    except ValueError as e:
        _fail(str(e), 2)
    try:
        plan = plan_cost(config, table, target, spot, probe_steps, log=lambda m: typer.echo(m, err=True))
    except (CostError, ValueError, FileNotFoundError) as e:  # no rate on that type; the data, as `run` says it
        _fail(str(e))
    typer.echo(report(plan))


@app.command()
def sync(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="a training run's folder: <storage.root>/runs/<id>"),
    tracking_uri: str | None = typer.Option(
        None,
        help="MLflow tracking URI (default: RUN_DIR/mlflow-run.json's, else the run's config's, where it is a local "
        "store or this machine's MLFLOW_TRACKING_URI)",
    ),
) -> None:
    """Send what a training run's MLflow journal still holds (MLflow was away when its process ended).

    Idempotent: what MLflow already has is not sent again, so a second run sends nothing.
    """
    from shardline.core.secrets import redact_text
    from shardline.core.tracking.tracker import sync_run

    try:
        report = sync_run(run_dir, tracking_uri)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        _fail(str(e), 2)
    except Exception as e:  # noqa: BLE001 - MLflow away or refusing: said, and the journal keeps everything
        if getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":  # it answered: the run is not in that store
            store = redact_text(tracking_uri or "in RUN_DIR/mlflow-run.json")
            _fail(
                f"the MLflow store {store} has no run of the journal of {run_dir}: give --tracking-uri the store the "
                "run was started in (nothing was sent; the journal keeps everything)",
                2,
            )
        _fail(
            f"MLflow did not take the journal of {run_dir} ({redact_text(' '.join(str(e).split())[:400])}); "
            "nothing is lost: run this again when it answers"
        )
    skipped = f" ({report.skipped} it already had were skipped)" if report.skipped else ""
    typer.echo(
        f"sent {report.metrics} metric value(s){skipped} and {report.params} param(s) to MLflow run "
        f"{report.run_id} at {report.tracking_uri}"
    )
    typer.echo(f"run status: {report.status}")


@app.command("doctor")
def doctor_command(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a config key (repeatable)"),
    timeout: float = typer.Option(30.0, min=1, help="seconds each network check may take"),
    probe_timeout: float = typer.Option(
        300.0, min=5, help="seconds the GPU probe's flow run may take, worker pickup and start-up included"
    ),
) -> None:
    """Check every dependency of a run before it starts and say what is wrong, in plain words.

    The config, the Prefect API, the training and pipeline deployments and a live worker on their work
    pools, the raw data, the storage root (a write, read back and delete), MLflow and its model registry,
    torch here, and (when training goes to a deployment) a tiny flow run on the GPU pool that reports
    the GPU its worker sees. One PASS/FAIL/SKIP row per check; exit 1 on any FAIL.
    """
    from shardline.app.doctor import doctor as run_doctor

    config = _load(config_path, list(set_))
    show = lambda check: _show_check(check, 19)
    rows = run_doctor(config, timeout=timeout, probe_timeout=probe_timeout, source=str(config_path), on_check=show)
    failed = [r.name for r in rows if r.ok is False]
    if failed:
        typer.secho(f"\n{len(failed)} check(s) failed: {', '.join(failed)}", fg=typer.colors.RED, bold=True)
        raise typer.Exit(1)
    typer.secho("\nall checks passed", fg=typer.colors.GREEN, bold=True)


@app.command("gc")
def gc_command(
    config_path: Path = typer.Argument(..., metavar="CONFIG.yaml"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="override a config key (repeatable)"),
    keep: int = typer.Option(
        3, "--keep", min=0, help="the newest runs kept (with their data sets) even when nothing refers to them"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would be deleted; delete nothing"),
    recent_minutes: float = typer.Option(
        60.0, "--recent-minutes", min=0, help="anything modified this recently is in use: kept"
    ),
) -> None:
    """Delete the data sets, runs and cached results that no registered model version and no recent run refers to.

    Kept: what any registered version in the config's MLflow store refers to (its run, its data set), the
    --keep newest runs, anything modified in the last --recent-minutes, what a live Prefect flow run uses,
    and the data sets and parent runs of all of those. Only datasets/, runs/ and prefect-results/ of the
    storage root are touched; never the raw data or the MLflow store. Prints what goes, its size and why.
    """
    from shardline.app.gc import GcError, apply_plan, plan_gc, report

    config = _load(config_path, list(set_))
    say = lambda m: typer.echo(m, err=True)
    try:
        plan = plan_gc(config, keep=keep, recent_minutes=recent_minutes, log=say)
        if not dry_run:
            plan = apply_plan(plan, log=say)
    except GcError as e:
        _fail(str(e))
    typer.echo(report(plan, dry_run))


def main() -> None:
    try:
        app()
    except Exception as e:  # noqa: BLE001 - unexpected: show the message, keep a non-zero exit
        typer.secho(f"error: {type(e).__name__}: {e}", fg=typer.colors.RED, err=True)
        sys.exit(1)


unwrapped_help(app)  # every command's, defined above
