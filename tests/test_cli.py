"""What the README promises, run as a user would: the `shardline` command in a subprocess (the demo, its cached
rerun and `shardline predict` run from a fresh `pip install .` in test_packaging.py)."""

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from tests.conftest import api_env, make_raw, tiny_config

BIN = Path(sys.executable).parent / "shardline"


def shardline(*args, cwd=None, timeout=600, env=None):
    env = {**(os.environ if env is None else env), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run(
        [str(BIN), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def test_help_everywhere():
    import typer

    from shardline.app.cli import app

    commands = typer.main.get_command(app).commands
    assert {"demo", "run", "node", "sweep", "predict", "generate", "rehearse", "cost", "doctor", "gc"} <= set(commands)
    wide = {**os.environ, "COLUMNS": "1000"}  # a terminal wide enough for every paragraph on one line
    for cmd in ([], *([c] for c in commands)):
        out = shardline(*cmd, "--help", env=wide)
        assert out.returncode == 0, out.stderr
        assert "Usage" in out.stdout
        # each paragraph of the command's help on a line of its own: not broken again where the docstring's lines end
        lines = [" ".join(line.split()) for line in out.stdout.splitlines()]
        for paragraph in commands[cmd[0]].help.split("\n\n") if cmd else []:
            assert " ".join(paragraph.split()) in lines, (cmd, paragraph, out.stdout)
    # each command's line in `shardline --help` is its docstring's first paragraph, laid out as written: one line of
    # source, else the list shows a break in mid-sentence
    for name, command in commands.items():
        summary = command.help.strip().split("\n\n")[0]
        assert "\n" not in summary and summary.endswith("."), (name, summary)


def test_unknown_config_key_fails_before_any_work(tmp_path):
    make_raw(tmp_path / "raw")
    cfg = tiny_config("raw/*.parquet", "store")
    cfg["model"]["hiden"] = 64
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = shardline("run", tmp_path / "c.yaml")
    assert out.returncode == 2
    assert "unknown key 'model.hiden': remove it or check its spelling; did you mean 'model.hidden'?" in out.stderr
    assert not (tmp_path / "store").exists()


def test_predict_from_a_store_that_is_not_there_says_so_and_makes_none(tmp_path):
    """A mistyped --tracking-uri: MLflow would create an empty store at the path, then find no model in it."""
    make_raw(tmp_path / "raw")
    wrong = tmp_path / "shardline-hom" / "mlflow.db"
    rows, preds = tmp_path / "raw" / "s-000.parquet", tmp_path / "p.parquet"
    out = shardline("predict", "models:/m@champion", rows, "--out", preds, "--tracking-uri", f"sqlite:///{wrong}")
    assert out.returncode == 2 and f"no MLflow store at {wrong}" in out.stderr, out.stderr
    assert not wrong.exists() and not preds.exists()


def test_check_config_prints_the_resolved_config(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config("raw/*.parquet", "store")))
    # run from the config's folder as a shell does (its PWD set): the folder's paths are shown, not masked as a
    # secret (`pwd` reads as a credential's name; tmp_path is long enough to be masked as one)
    env = {**os.environ, "PWD": str(tmp_path)}
    out = shardline("check-config", "c.yaml", "--set", "training.epochs=9", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["training"]["epochs"] == 9
    assert resolved["data"]["source"] == str(tmp_path / "raw" / "*.parquet")


def test_a_parent_that_is_not_there_is_the_configs_mistake_said_before_any_work(tmp_path):
    """`training.init_from` naming no registered version, or no checkpoint, exits 2 before any work, as another
    mistake in the config does (check-config passed it, and the run failed with exit 1)."""
    make_raw(tmp_path / "raw")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config("raw/*.parquet", "store")))
    for parent, said in (
        ("models:/pretrained@champion", "training.init_from=models:/pretrained@champion: no such registered"),
        ("store/runs/none/checkpoints", "no checkpoint there; give a registered model"),
    ):
        for command in ("check-config", "run"):
            out = shardline(command, tmp_path / "c.yaml", "--set", f"training.init_from={parent}", cwd=tmp_path)
            assert out.returncode == 2 and said in out.stderr, (command, out.stderr[-2000:])
            assert not (tmp_path / "store" / "datasets").exists()  # nothing ingested or encoded


def test_a_typo_in_a_column_is_caught_before_any_work_and_said_once(tmp_path):
    """check-config reads one file's footer: a column that is not there is named, with the closest
    columns the file has; the run says it once for all the files, not once per file."""
    make_raw(tmp_path / "raw")  # 4 files
    cfg = tiny_config("raw/*.parquet", "store")
    cfg["data"]["features"]["categorical"] = ["knid"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = shardline("check-config", tmp_path / "c.yaml")
    assert out.returncode == 2
    assert "missing column 'knid' (the categorical in data.features); did you mean 'kind'?" in out.stderr
    assert "s-000.parquet does not fit the config" in out.stderr and "The file has: seq, t, x, y" in out.stderr
    # a column of another role is said with the setting that names it
    cfg["data"]["features"]["categorical"] = ["kind"]
    cfg["data"].update(sequence_key="sequence", id_columns=["user"])
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = shardline("check-config", tmp_path / "c.yaml")
    assert out.returncode == 2, out.stderr
    assert "missing column 'sequence' (the sequence key in data.sequence_key)" in out.stderr
    assert "missing column 'user' (the id column in data.id_columns)" in out.stderr
    # targets given as a list: said as data.targets, the setting the config has
    targets = [{"column": "label", "task": "classification"}, {"column": "remaining", "task": "regression"}]
    written = {**cfg, "data": {**{k: v for k, v in cfg["data"].items() if k != "target"}, "targets": targets}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(written))
    out = shardline("check-config", tmp_path / "c.yaml")
    assert "missing column 'remaining' (the regression target in data.targets)" in out.stderr, out.stderr
    cfg["data"].update(sequence_key="seq", id_columns=[])
    cfg["data"]["features"]["categorical"] = ["knid"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))

    from shardline.core.config import load_config, validate_config
    from shardline.core.encoding.columns import DataError
    from shardline.tasks.ingest import snapshot_source

    with pytest.raises(DataError) as e:
        snapshot_source(load_config(tmp_path / "c.yaml").data)
    msg = str(e.value)
    assert msg.count("missing column 'knid'") == 1 and "4 files (" in msg and "Fix the config" in msg
    assert "on_bad_file: skip" not in msg  # skipping every file would leave nothing to train on

    good = tiny_config("raw/*.parquet", "store")
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    ok = shardline("check-config", tmp_path / "good.yaml")
    assert ok.returncode == 0 and "# the columns fit" in ok.stdout

    # a column that is a folder name of a hive-style layout (day=1/...) above data.source's folder: said so, once
    import shutil

    for i, f in enumerate(sorted((tmp_path / "raw").glob("*.parquet"))):
        (tmp_path / "hive" / "day=1" / f"part={i}").mkdir(parents=True)
        shutil.copy(f, tmp_path / "hive" / "day=1" / f"part={i}" / "part-0.parquet")
    hive = tiny_config(str(tmp_path / "hive" / "day=1"), "store")
    hive["data"]["features"]["categorical"] = ["kind", "day", "part"]  # `part` is below it: read
    with pytest.raises(DataError) as e:
        snapshot_source(validate_config(hive).data)
    said = "missing column 'day' (the categorical in data.features); it is in a folder name (day=...: a "
    assert str(e.value).count(said + "hive-style partition) above") == 1 and "4 files (" in str(e.value), str(e.value)
    assert "'part'" not in str(e.value)


@pytest.mark.e2e
def test_run_with_a_bad_file_names_it_and_exits_nonzero(tmp_path, prefect_api):
    make_raw(tmp_path / "raw")
    pl.read_parquet(tmp_path / "raw" / "s-002.parquet").drop("y").write_parquet(tmp_path / "raw" / "s-002.parquet")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config("raw/*.parquet", "store")))
    # the session's Prefect API: the error is the same as on a laptop's temporary one (test_packaging
    # starts those), ~6 s of CPU less a command
    out = shardline("run", tmp_path / "c.yaml", env=api_env())
    assert out.returncode == 1
    assert "s-002.parquet: missing column 'y'" in out.stderr
    assert not list((tmp_path / "store").rglob("manifest.json"))
    # said once, without a traceback (a data error is the user's to fix, not a crash); --verbose shows it
    said = out.stdout + out.stderr
    assert said.count("missing column 'y'") == 1 and "Traceback" not in said
    loud = shardline("run", tmp_path / "c.yaml", "--verbose", env=api_env())
    assert loud.returncode == 1 and "Traceback" in loud.stdout + loud.stderr

    # a storage root this machine cannot write (a file where a folder must be): the setting named, no traceback
    (tmp_path / "a-file").write_text("")
    out = shardline("run", tmp_path / "c.yaml", "--set", f"storage.root={tmp_path / 'a-file' / 'store'}", env=api_env())
    said = out.stdout + out.stderr
    assert out.returncode == 1 and f"storage.root {tmp_path / 'a-file' / 'store'}: cannot make the folder" in said
    assert "Traceback" not in said


@pytest.mark.e2e
def test_rehearse_in_process_preempts_resumes_and_leaves_the_real_run_alone(tmp_path):
    # as the demo has it: the target (the next `label`) is also an input feature (the current one); and the
    # sampled files give ~12 steps of the configured batch of 32, fewer than the default 20 steps and
    # the default preemption at step 10, which then never fired. Days in hive-style folders, split by range: the
    # first 8 files (the newest, the oldest, the middle...) have no validation day, so it copies them all
    for i, path in enumerate(make_raw(tmp_path / "src", n_seq=36, rows=20)):  # a player per sequence: new ones
        folder = tmp_path / "raw" / f"day={100 + i}" / f"site={'ab'[i % 2]}"  # in each split
        folder.mkdir(parents=True)
        pl.read_parquet(path).with_columns(player=pl.col("seq").str.replace("s", "p")).write_parquet(
            folder / "part-0.parquet"
        )
    cfg = tmp_path / "cfg.yaml"
    config = tiny_config(str(tmp_path / "raw"), str(tmp_path / "store"))
    config["data"]["features"]["categorical"] = ["kind", "label", "player", "site"]
    config["data"]["split"] = {
        "method": "range",
        "column": "day",
        "ranges": {"train": [None, 106], "validation": [107, 107], "test": [108, None]},
    }
    cfg.write_text(yaml.safe_dump(config))
    out = shardline("rehearse", cfg)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    table = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(table) == 11 and all(line.startswith("PASS") for line in table), out.stdout
    sized = next(line for line in table if "sample: sized" in line)
    assert "12 file(s), 357 training windows: 20 steps of 18 (training.batch_size 32 -> 18" in sized, sized
    assert "preempted at step 10" in sized
    assert "attempt 1: Preempted; resumed from" in out.stdout and "ckpt-000000010.pt (at step 10)" in out.stdout
    # its download predicts a raw file of players the few files' training never saw: said in its row, not warned
    download = next(line for line in table if "download: the registered model predicts raw rows" in line)
    assert "predict notes: column 'player' holds" in download, download
    assert "shardline.predict" not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-4000:]  # its own preemption is no error to show
    # everything it wrote is under the rehearsal prefix; the registered model is NAME-rehearsal
    assert [p.name for p in (tmp_path / "store").iterdir() if p.name != "mlflow.db"] == ["rehearsals"]
    assert "tiny-model-rehearsal version 1" in out.stdout

    bad = shardline("rehearse", cfg, "--steps", "5", "--preempt-at", "5")
    assert bad.returncode == 2 and "--preempt-at 5 must be below --steps 5" in bad.stderr


def test_the_rehearsal_copies_the_first_rows_of_a_large_file_and_small_files_whole(tmp_path, monkeypatch):
    """A click log in one 5 GB file: the rehearsal read and wrote it whole (in memory, one `read_bytes`), and its
    tiny data set was the full data. Of a file over the bound, its first rows (about the bound of them) are copied,
    as a parquet file of the same columns and types."""
    import pyarrow.parquet as pq

    from shardline.app import rehearse
    from shardline.core.config import validate_config

    make_raw(tmp_path / "raw", n_seq=6, rows=8000)  # s-000 and s-001: 3 sequences of 8,000 rows each
    big = tmp_path / "raw" / "s-000.parquet"
    pq.write_table(pq.read_table(big), big, row_group_size=2000)  # 12 row groups
    monkeypatch.setattr(rehearse, "SAMPLE_FILE_BYTES", big.stat().st_size // 2)
    small = tmp_path / "raw" / "s-001.parquet"
    pl.read_parquet(small).head(100).write_parquet(small)
    config = validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store")))
    copied = [Path(p) for p in rehearse.copy_sample(config, str(tmp_path / "rehearsal"), 2)]
    assert [p.name for p in copied] == ["s-001.parquet", "s-000.parquet"]  # the newest first (`spread`)
    part, whole = pq.read_table(copied[1]), pq.read_table(big)
    assert part.schema == whole.schema and 0 < part.num_rows < whole.num_rows
    assert part.equals(whole.slice(0, part.num_rows))  # its first rows, as they were
    assert copied[0].read_bytes() == small.read_bytes()
    assert [rehearse.spread(n) for n in (0, 1, 3)] == [[], [0], [2, 0, 1]]  # every prefix spread over the range
    assert rehearse.spread(10) == [9, 0, 4, 2, 6, 1, 3, 5, 7, 8]


def test_an_error_from_the_users_own_code_says_where_it_was_raised(tmp_path):
    """A ValueError a user's model raises (its constructor, its loss) is said by its message alone, which named
    no file: the user's file and line are added; Shardline's own messages, which say what to do, are kept."""
    import importlib.util

    from shardline.core.config import ConfigError, validate_config
    from shardline.core.failures import raised_in_your_code

    (tmp_path / "mine.py").write_text("def build(hidden):\n    if hidden % 2:\n        raise ValueError('odd')\n")
    spec = importlib.util.spec_from_file_location("mine", tmp_path / "mine.py")
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    with pytest.raises(ValueError) as raised:
        mine.build(17)
    said = raised_in_your_code(raised.value)
    assert said == f" (ValueError raised at {tmp_path / 'mine.py'}:3; --verbose shows the traceback)"
    with pytest.raises(ConfigError) as ours:
        validate_config({"name": "x"})
    assert raised_in_your_code(ours.value) == ""


def test_a_tokenizer_file_that_is_not_there_is_refused_before_any_work(tmp_path):
    """`data.tokenizer.file` naming no file: check-config and run exit 2 naming it (run ingested first, then
    failed with exit 1)."""
    config = {
        "name": "lm",
        "data": {"source": "raw/*.parquet", "features": {"text": ["body"]}, "tokenizer": {"file": "nope.json"}},
        "model": {"family": "gpt", "hidden": 16, "layers": 1, "heads": 2},
        "storage": {"root": "store"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    for command in ("check-config", "run"):
        out = shardline(command, tmp_path / "c.yaml")
        assert out.returncode == 2 and f"data.tokenizer.file '{tmp_path / 'nope.json'}' does not exist" in out.stderr
    assert not (tmp_path / "store").exists()


def test_a_full_disk_is_said_naming_the_file_its_free_space_and_what_to_do(tmp_path):
    """ENOSPC, however deep in the chain of errors a step raised (MLflow's copy of a model's weights into the
    storage root, then Prefect's failed result write, then the flow's failure), is said as the file it could not
    write, its disk's free space and what to do; any other error is not."""
    import errno

    from shardline.core.failures import out_of_space

    dest = tmp_path / "store" / "mlflow-artifacts" / "weights.pt"
    copy = OSError(errno.ENOSPC, "No space left on device", "/tmp/aside/weights.pt", None, str(dest))
    result = OSError(errno.ENOSPC, "No space left on device")  # no file named
    flow = RuntimeError("the register step failed")
    result.__context__, flow.__context__ = copy, result
    said = out_of_space(flow)
    assert said.startswith(f"no space left on the disk of {dest} (") and " MB free): " in said, said
    assert "shardline gc CONFIG" in said and "run the same command again" in said
    assert out_of_space(OSError(errno.EACCES, "Permission denied", str(dest))) == ""
    assert out_of_space(ValueError("no")) == ""
    # and not retried: a full disk stays full (each of 2 retries trained again to the same write, and failed there)
    from shardline.core.failures import is_infrastructure_failure

    assert not is_infrastructure_failure(flow) and not is_infrastructure_failure(copy)
    assert is_infrastructure_failure(OSError(errno.EIO, "Input/output error", str(dest)))


def test_ctrl_c_inside_the_import_machinery_is_raised_again_once_the_import_is_through():
    """A Ctrl-C that lands in importlib's own code (CPython 3.11: right after it takes the global import lock, before
    the `try` that releases it) left the lock held: the run's other threads waited on their next import forever and
    the command hung. The command's handler raises it a moment later instead; anywhere else, at once."""
    import signal
    import sys
    import time

    from shardline.app.console import interrupt

    scope: dict = {}
    exec(
        compile("def inside():\n    import sys\n    return sys._getframe()\n", "<frozen importlib._bootstrap>", "exec"),
        scope,
    )
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        interrupt(signal.SIGINT, scope["inside"]())  # as if it came inside an import: not raised there...
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):  # ...but a moment later, here
            while time.monotonic() < start + 10:
                time.sleep(0.01)
        assert time.monotonic() - start < 5
        with pytest.raises(KeyboardInterrupt):
            interrupt(signal.SIGINT, sys._getframe())
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_storage_root_this_user_may_not_write_is_said_naming_the_folder_and_what_to_do(tmp_path):
    """A read-only root (an immutable folder, a read-only mount): the error named the file written aside
    (`.tmp-7a39...-ckpt-000000059.pt`) and nothing to do. It names the folder and what to change."""
    import shutil

    from shardline.core import storage

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode:
        pytest.skip("as root, only an immutable folder refuses a write, and chattr is not here")
    try:
        with pytest.raises(PermissionError) as refused:
            storage.write_bytes(str(folder / "ckpt-000000059.pt"), b"weights")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(folder)])
        folder.chmod(0o755)
    said = str(refused.value)
    assert f"this user may not write {folder}" in said and "set storage.root to a folder it may write" in said
    assert ".tmp-" not in said and said.endswith("ckpt-000000059.pt'")
    assert list(folder.iterdir()) == []
