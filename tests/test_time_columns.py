"""Time columns as users have them: ISO-8601 text and time-zone-aware timestamps as the order, through
the encode, registration and `shardline predict`, which gives each prediction the input's own key and
order values in the input's own types (a join needs no cast), with the id columns the user chose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from shardline.core.config import validate_config
from shardline.core.encoding.columns import DataError
from shardline.tasks.ingest import snapshot_source
from tests.conftest import make_raw, tiny_config
from tests.test_ingest_encode import encode_all

START = pl.datetime(2024, 1, 1, time_zone="UTC")


def with_time(raw_dir: Path, expr: pl.Expr, statistics: bool = True) -> None:
    for path in raw_dir.glob("*.parquet"):
        df = pl.read_parquet(path)
        df.with_columns(expr.alias("when"), pl.col("seq").alias("user")).write_parquet(path, statistics=statistics)


def test_an_iso_text_order_column_is_parsed_and_a_bad_value_named(tmp_path):
    raw_dir = tmp_path / "raw"
    make_raw(raw_dir)
    # ISO-8601 text, as exports and pandas round-trips write it; rows shuffled so the order matters
    iso = (START + pl.duration(seconds=pl.col("t") * 30)).dt.strftime("%Y-%m-%dT%H:%M:%SZ")
    with_time(raw_dir, iso)
    for path in raw_dir.glob("*.parquet"):
        pl.read_parquet(path).sample(fraction=1.0, shuffle=True, seed=3).write_parquet(path)
    base = tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store"))
    base["data"]["order_by"] = "when"
    _, spec, _, manifest = encode_all(validate_config(base))
    assert spec.order_by == "when" and manifest.windows["train"] > 0
    ordered = tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store2"))  # the same rows, ordered by t
    _, _, _, by_t = encode_all(validate_config(ordered))
    assert [s.sha256 for s in manifest.shards] != [] and manifest.windows == by_t.windows

    # another format, declared
    with_time(raw_dir, (START + pl.duration(seconds=pl.col("t") * 30)).dt.strftime("%d.%m.%Y %Hh%Mm%S"))
    with pytest.raises(DataError, match=r"column 'when' \(data.order_by\) holds text that does not read as an ISO"):
        encode_all(validate_config(base))
    base["data"]["order_format"] = "%d.%m.%Y %Hh%Mm%S"
    _, _, _, declared = encode_all(validate_config(base))
    assert declared.windows == by_t.windows

    # text in another format polars would guess (01/12/2024: day first, unsaid) is not ISO-8601: refused, the
    # first value named; so is text no format reads (it said "(the first value)")
    base["data"]["order_format"] = None
    for written, said in (("%m/%d/%Y %H:%M:%S", r"'\d\d/\d\d/2024 [\d:]+' and"), ("site_%S", r"'site_\d\d' and")):
        with_time(raw_dir, (START + pl.duration(seconds=pl.col("t") * 30)).dt.strftime(written))
        with pytest.raises(DataError, match=f"does not read as an ISO-8601 date-time .*: {said}"):
            encode_all(validate_config(base))
    with_time(raw_dir, (START + pl.duration(seconds=pl.col("t") * 30)).dt.strftime("%d.%m.%Y %Hh%Mm%S"))
    base["data"]["order_format"] = "%d.%m.%Y %Hh%Mm%S"

    # one bad value is named, with its file
    path = raw_dir / "s-002.parquet"
    df = pl.read_parquet(path)
    df.with_columns(
        pl.when(pl.col("t") == 7).then(pl.lit("not a date")).otherwise(pl.col("when")).alias("when")
    ).write_parquet(path)
    with pytest.raises(
        DataError, match=r"s-002.parquet: column 'when' .*='%d.%m.%Y %Hh%Mm%S': 'not a date' and 2 more"
    ):
        encode_all(validate_config(base))


@pytest.mark.e2e
def test_a_time_zone_aware_order_registers_and_predicts_in_the_inputs_types(tmp_path, prefect_api):
    """A timestamp[us, tz=UTC] order column used to fail registration after all the training (MLflow's
    signature takes naive date-times only). It registers; `shardline predict` gives back the input's
    zone and unit, the sequence key, and the id column the user chose; a too-short input is said."""
    from shardline.flows.pipeline import pipeline

    raw_dir = tmp_path / "raw"
    make_raw(raw_dir, n_seq=12, rows=60)
    with_time(raw_dir, (START + pl.duration(seconds=pl.col("t") * 30)).dt.convert_time_zone("Europe/Paris"))
    for path in raw_dir.glob("*.parquet"):  # a decimal feature, as Spark writes prices: registration failed on it
        vec = pl.concat_list(pl.col("x"), pl.col("x") * 2).cast(pl.Array(pl.Float32, 2)).alias("vec")  # an embedding
        frame = pl.read_parquet(path).with_columns(pl.col("y").round(4).cast(pl.Decimal(18, 4)), vec)
        # an integer category with nulls in training (not in the sequence predicted below): its signature is long
        null = (pl.col("t") % 7 == 3) & (pl.col("seq") != "s001")
        frame = frame.with_columns(pl.when(null).then(None).otherwise(pl.col("season")).alias("season"))
        frame.write_parquet(path)
    cfg = tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store"))
    cfg["data"]["features"]["continuous"] = ["x", "y", "vec[0:2]"]  # its elements, each a feature
    cfg["data"]["order_by"] = "when"
    cfg["data"]["id_columns"] = ["user"]
    cfg["data"]["features"]["categorical"] = ["kind", "season"]  # an int16 category
    result = pipeline(validate_config(cfg))
    assert result["registered"]["version"] == 1

    rows = pl.read_parquet(raw_dir / "s-000.parquet").filter(pl.col("seq") == "s001")
    rows.drop("label").write_parquet(tmp_path / "in.parquet")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    cmd = [str(Path(sys.executable).parent / "shardline"), "predict", "models:/tiny-model@champion"]
    uri = ["--tracking-uri", result["registered"]["tracking_uri"]]
    out = tmp_path / "preds.parquet"
    done = subprocess.run([*cmd, str(tmp_path / "in.parquet"), "--out", str(out), *uri], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "extra inputs" not in done.stderr  # the columns the model does not take are not sent
    preds = pl.read_parquet(out)
    assert preds.columns[:3] == ["seq", "user", "when"]
    assert preds.schema["when"] == rows.schema["when"] == pl.Datetime("us", "Europe/Paris")
    assert preds.height == rows.height - 3  # window 3, horizon 1
    joined = preds.join(rows, on=["seq", "when"], how="inner")  # joins without a cast
    assert joined.height == preds.height and (joined["user"] == joined["user_right"]).all()
    # each prediction is for the row its key names: label there is the previous row's kind
    assert (joined["prediction"] == joined["label"]).mean() > 0.6

    # the numbers in other types than training read, as pandas and other tools write them: float64 for float32,
    # int64 for int16, and an integer column with a null (float64 in pandas): the same predictions, from the
    # command and from MLflow's own pyfunc API (whose signature takes the wider types)
    wide = rows.drop("label").with_columns(
        pl.col("x", "y").cast(pl.Float64), pl.col("season").cast(pl.Int64), pl.col("vec").cast(pl.List(pl.Float64))
    )
    with_null = wide.with_columns(pl.when(pl.col("t") == 5).then(None).otherwise(pl.col("season")).alias("season"))
    with_null.with_columns(pl.col("season").cast(pl.Float64)).write_parquet(tmp_path / "wide.parquet")
    done = subprocess.run([*cmd, str(tmp_path / "wide.parquet"), "--out", str(tmp_path / "w.parquet"), *uri],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert pl.read_parquet(tmp_path / "w.parquet")["prediction"].to_list() == preds["prediction"].to_list()
    import mlflow

    from shardline.trainer.serving import naive_utc

    mlflow.set_tracking_uri(result["registered"]["tracking_uri"])
    served_model = mlflow.pyfunc.load_model("models:/tiny-model@champion")
    inputs = served_model.metadata.get_input_schema().input_types_dict()
    assert inputs["y"].name == "double" and str(inputs["vec"]) == "Array(double)"  # a decimal: a number
    # the int16 category with nulls in training is a long, as pandas' int64 ids pass (it was a double: refused)
    assert inputs["season"].name == "long"
    served = served_model.predict(naive_utc(wide.to_pandas()))
    assert served["prediction"].tolist() == preds["prediction"].to_list()
    # rows without the id column (data.id_columns: passed through, never a feature), as a service scores them before
    # they have one: the same predictions, without it (it was required, as if the model had been trained on it)
    assert "user" not in served_model.metadata.get_input_schema().required_input_names()
    anonymous = served_model.predict(naive_utc(wide.drop("user").to_pandas()))
    assert "user" not in anonymous.columns and anonymous["prediction"].tolist() == preds["prediction"].to_list()
    rows.drop("label", "user").write_parquet(tmp_path / "no-user.parquet")
    done = subprocess.run([*cmd, str(tmp_path / "no-user.parquet"), "--out", str(tmp_path / "u.parquet"), *uri],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert pl.read_parquet(tmp_path / "u.parquet").equals(pl.read_parquet(out).drop("user"))
    # a folder of files that differ as `shardline run` allows: a wider number type, a column one file lacks, another
    # zone (read as one table, they failed on polars' schema check); a file that is not parquet beside them
    (tmp_path / "mixed").mkdir()
    half = rows.height // 2
    wide.head(half).with_columns(pl.lit("x").alias("note")).write_parquet(tmp_path / "mixed" / "a.parquet")
    rows.drop("label").tail(rows.height - half).with_columns(pl.col("when").dt.convert_time_zone("UTC")).write_parquet(
        tmp_path / "mixed" / "b.parquet"
    )
    (tmp_path / "mixed" / "README.md").write_text("exported 2024-01-01")
    done = subprocess.run([*cmd, str(tmp_path / "mixed"), "--out", str(tmp_path / "m.parquet"), *uri],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert pl.read_parquet(tmp_path / "m.parquet")["prediction"].to_list() == preds["prediction"].to_list()
    # a number column holding text, or a fraction where training read whole numbers: named, exit 2
    for bad_rows, said in (
        (rows.drop("label").with_columns(pl.col("x").cast(pl.Utf8)), "input column 'x' is String, trained as Float32"),
        (wide.with_columns(pl.col("season") + 0.5), "input column 'season' holds 2021.5, trained as whole numbers"),
    ):
        bad_rows.write_parquet(tmp_path / "bad.parquet")
        done = subprocess.run([*cmd, str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "b.parquet"), *uri],
                              capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert done.returncode == 2 and said in done.stderr, done.stderr[-3000:]

    rows.head(3).drop("label").write_parquet(tmp_path / "short.parquet")
    short = subprocess.run([*cmd, str(tmp_path / "short.parquet"), "--out", str(tmp_path / "s.parquet"), *uri],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert short.returncode != 0 and "0 predictions: every sequence in the input has fewer than 4 rows" in short.stderr
    assert "from its last 3 rows, pass --forecast" in short.stderr, short.stderr[-2000:]  # what would predict them
    # beside a full sequence, one too short gets no prediction, and a category training never saw reads as unknown:
    # both said, the predictions made as before. --forecast on the same rows: per sequence, the one prediction a live
    # user needs, for the row after its last (not in the input yet), keyed by that last row; it is what the rows with
    # a stand-in row appended predict for that row
    other = pl.read_parquet(raw_dir / "s-000.parquet").filter(pl.col("seq") == "s002").head(2).drop("label")
    unseen = rows.drop("label").with_columns(
        pl.when(pl.col("t").is_in([10, 11])).then(pl.lit("zzz")).otherwise("kind").alias("kind")
    )
    last = unseen.sort("when").tail(1)
    stand_in = last.with_columns(pl.col("when") + pl.duration(seconds=30), pl.col("t") + 1)
    pl.concat([unseen, other]).write_parquet(tmp_path / "mixed-lengths.parquet")
    pl.concat([unseen, stand_in, other]).write_parquet(tmp_path / "appended.parquet")
    noted = subprocess.run([*cmd, str(tmp_path / "appended.parquet"), "--out", str(tmp_path / "n.parquet"), *uri],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert noted.returncode == 0, noted.stderr[-3000:]
    assert "1 sequence(s) have fewer than 4 rows (data.window=3 + data.horizon=1) and get no prediction: 's002'" in (
        noted.stderr
    ), noted.stderr[-3000:]
    assert "column 'kind' holds 1 value(s) training never saw, in 2 row(s) (the first value: 'zzz')" in noted.stderr
    by_hand = pl.read_parquet(tmp_path / "n.parquet").sort("when")
    assert by_hand.height == preds.height + 1  # and the stand-in row's
    forecast = [str(tmp_path / "mixed-lengths.parquet"), "--forecast", "--out", str(tmp_path / "f.parquet"), *uri]
    done = subprocess.run([*cmd, *forecast], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 sequence(s) have fewer than 3 rows (data.window) and get no prediction: 's002'" in done.stderr
    ahead = pl.read_parquet(tmp_path / "f.parquet")
    assert ahead.columns[:4] == ["seq", "user", "when", "horizon"] and ahead["horizon"].to_list() == [1]
    assert ahead.select("seq", "user", "when").rows() == last.select("seq", "user", "when").rows()
    assert by_hand["prediction"].tail(1).to_list() == ahead["prediction"].to_list()
    assert by_hand["probability"].tail(1).to_list() == pytest.approx(ahead["probability"].to_list(), rel=1e-5)

    # a column the model takes is missing: the file and the column named (not MLflow's dump of the whole frame)
    rows.drop("label", "x").write_parquet(tmp_path / "no-x.parquet")
    bad = subprocess.run([*cmd, str(tmp_path / "no-x.parquet"), "--out", str(tmp_path / "b.parquet"), *uri],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and f"{tmp_path / 'no-x.parquet'} lacks column(s) ['x']" in bad.stderr, bad.stderr
    # --out a folder: said before any work, nothing left beside it; a folder's unreadable file named
    (tmp_path / "outdir").mkdir()
    (tmp_path / "inputs").mkdir()
    rows.drop("label").write_parquet(tmp_path / "inputs" / "a.parquet")
    (tmp_path / "inputs" / "b.parquet").write_bytes(b"not parquet")
    (tmp_path / "partial").mkdir()  # one file of two lacks a column: named (it read as nulls in the others' rows)
    rows.drop("label").write_parquet(tmp_path / "partial" / "a.parquet")
    rows.drop("label", "x").write_parquet(tmp_path / "partial" / "c.parquet")
    (tmp_path / "twice").mkdir()  # a file beside its copy: two predictions a row, the copies in every window
    rows.drop("label").write_parquet(tmp_path / "twice" / "a.parquet")
    rows.drop("label").write_parquet(tmp_path / "twice" / "a-copy.parquet")
    for args, said in (
        ([str(tmp_path / "in.parquet"), "--out", str(tmp_path / "outdir")], f"--out {tmp_path / 'outdir'} is a folder"),
        (
            [str(tmp_path / "inputs"), "--out", str(tmp_path / "c.parquet")],
            f"cannot read {tmp_path / 'inputs' / 'b.parquet'}",
        ),
        (
            [str(tmp_path / "partial"), "--out", str(tmp_path / "c.parquet")],
            f"{tmp_path / 'partial' / 'c.parquet'} (of {tmp_path / 'partial'}) lacks column(s) ['x']",
        ),
        ([str(tmp_path / "twice"), "--out", str(tmp_path / "c.parquet")], "row(s) repeat another row whole"),
    ):
        done = subprocess.run([*cmd, *args, *uri], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 2 and said in done.stderr, done.stderr
    # a misspelt model: a bad command line (2, not a failed run), the store's closest name said
    typo = [*cmd[:2], "models:/tiny-modle@champion", str(tmp_path / "in.parquet"), "--out", str(tmp_path / "t.parquet")]
    done = subprocess.run([*typo, *uri], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "; the store has tiny-model" in done.stderr, done.stderr
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_date_time_feature_is_its_instant_whatever_its_unit_or_zone(tmp_path):
    """A date-time used as a continuous feature is its instant (microseconds since 1970 UTC, then
    standardised): the same rows in nanoseconds and without the zone (a pandas round trip, as MLflow
    serves them) encode to the same numbers."""
    from shardline.core.encoding.columns import prepare
    from shardline.core.encoding.frame import encode_frame

    raw_dir = tmp_path / "raw"
    make_raw(raw_dir)
    with_time(raw_dir, (START + pl.duration(hours=pl.col("t"))).dt.convert_time_zone("Asia/Tokyo"))
    cfg = tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store"))
    cfg["data"]["features"]["continuous"] = ["x", "when"]
    _, spec, _, manifest = encode_all(validate_config(cfg))
    stat = next(c for c in spec.continuous if c.name == "when")
    assert 1.70e15 < stat.mean < 1.71e15 and stat.std > 3600e6  # hours apart, in microseconds
    rows = pl.read_parquet(raw_dir / "s-000.parquet")
    served = rows.with_columns(
        pl.col("when").dt.convert_time_zone("UTC").dt.replace_time_zone(None).dt.cast_time_unit("ns")
    )
    a, _ = encode_frame(prepare(rows, "seq", "t", "a"), spec, with_target=False)
    b, _ = encode_frame(prepare(served, "seq", "t", "b"), spec, with_target=False)
    assert (a["cont"] == b["cont"]).all() and abs(float(a["cont"][:, 1].mean())) < 3


def test_files_whose_order_is_in_different_zones_encode_as_one(tmp_path):
    """One file's date-times in UTC, the others' in Europe/Paris (two exports): the same instants, read as one
    group (its concat failed on the types: a traceback naming no file); one file's without a zone is said."""
    raw_dir = tmp_path / "raw"
    make_raw(raw_dir)
    with_time(raw_dir, (START + pl.duration(seconds=pl.col("t") * 30)).dt.convert_time_zone("Europe/Paris"))
    cfg = tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store"))
    cfg["data"].update(order_by="when", files_per_group=4)
    _, _, _, paris = encode_all(validate_config(cfg))
    one = raw_dir / "s-001.parquet"
    pl.read_parquet(one).with_columns(pl.col("when").dt.convert_time_zone("UTC")).write_parquet(one)
    cfg["storage"]["root"] = str(tmp_path / "store2")
    _, _, _, mixed = encode_all(validate_config(cfg))
    assert mixed.windows == paris.windows and [s.sha256 for s in mixed.shards] == [s.sha256 for s in paris.shards]
    pl.read_parquet(one).with_columns(pl.col("when").dt.replace_time_zone(None)).write_parquet(one)
    cfg["storage"]["root"] = str(tmp_path / "store3")
    with pytest.raises(DataError, match=r"column 'when' holds date-times without a time zone in .*s-001.parquet"):
        encode_all(validate_config(cfg))
    # the same file in a group of its own (it passed: each group read alone, its instants off by the zone's
    # offset), and a file without a zone appended to a source ingested before (only its footer is read then)
    cfg["data"].update(files_per_group=1)
    with pytest.raises(DataError, match=r"column 'when' holds date-times without a time zone in .*s-001.parquet"):
        encode_all(validate_config(cfg))
    one.unlink()
    data = validate_config(cfg).data
    checked = snapshot_source(data)
    pl.read_parquet(raw_dir / "s-002.parquet").with_columns(pl.col("when").dt.replace_time_zone(None)).write_parquet(
        one
    )
    with pytest.raises(DataError, match=r"column 'when' holds date-times without a time zone in .*s-001.parquet and "
                       r"with one in .*s-000.parquet"):  # fmt: skip
        snapshot_source(data, checked)


def test_forecast_is_refused_where_no_row_comes_after_the_input():
    """`--forecast` predicts the row past each sequence's last. Ranking data, a horizon of 0 (rows without a
    sequence key) and a model without a target have no such row: said, naming why, where it gave one prediction for
    the whole input, keyed by its last row (seen with examples/two_tower). A file that is one sequence in its rows'
    order has one."""
    import json

    from shardline.core.manifest import EncodingSpec
    from shardline.trainer.inference import load_model
    from shardline.trainer.serving import Predictor
    from tests.test_compat import DATA  # a model the demo trained, its checkpoint and a raw game

    bundle = json.loads((DATA / "model" / "artifacts" / "bundle.json").read_text())
    spec = EncodingSpec.model_validate(bundle["encoding"])
    model, rows = load_model(str(DATA / "checkpoint")), pl.read_parquet(DATA / "input.parquet")
    assert Predictor(spec, model).predict_frame(rows, forecast=True).height == 1  # one game: its next frame
    in_file_order = spec.model_copy(update={"sequence_key": "@file", "order_by": None})
    assert Predictor(in_file_order, model).predict_frame(rows, forecast=True).height == 1
    for update, said in (
        ({"group_key": "game_id"}, "ranking data"),
        ({"horizon": 0}, r"with data.horizon 0 \(rows without data.sequence_key"),
        ({"targets": []}, "a model without a target"),
    ):
        with pytest.raises(DataError, match=f"--forecast: {said}.*; predict without it"):
            Predictor(spec.model_copy(update=update), model).predict_frame(rows, forecast=True)


def test_rows_of_several_files_are_predicted_a_file_at_a_time_where_the_file_is_the_sequence():
    """A model whose sequence is the file (`@file`, here without an order column: rows in file order) given the
    rows of two files, each named in `file` (as `shardline predict` reads a folder): each file's windows are its
    own, keyed by the file and the row's number in it, the same as predicting that file alone; without `file` the
    rows are one file."""
    import json

    from shardline.core.manifest import EncodingSpec
    from shardline.trainer.inference import load_model
    from shardline.trainer.serving import Predictor, file_key
    from tests.test_compat import DATA  # a model the demo trained, its checkpoint and a raw game

    bundle = json.loads((DATA / "model" / "artifacts" / "bundle.json").read_text())
    in_files = {"sequence_key": "@file", "order_by": None}
    spec = EncodingSpec.model_validate(bundle["encoding"]).model_copy(update=in_files)
    predictor, rows = Predictor(spec, load_model(str(DATA / "checkpoint"))), pl.read_parquet(DATA / "input.parquet")
    assert file_key(spec) == "file"
    half = rows.height // 2
    a, b = rows.head(half), rows.tail(rows.height - half)
    both = pl.concat([a.with_columns(file=pl.lit("a.parquet")), b.with_columns(file=pl.lit("b.parquet"))])
    got = predictor.predict_frame(both)
    k = spec.window + spec.horizon - 1  # rows of a file with no prediction: its first window's history
    assert got.columns[:2] == ["file", "row"] and got.height == rows.height - 2 * k
    for name, part in (("a.parquet", a), ("b.parquet", b)):
        alone = predictor.predict_frame(part)
        mine = got.filter(pl.col("file") == name).drop("file")
        assert mine.equals(alone) and mine["row"][0] == k  # numbered in its own file
    assert predictor.predict_frame(rows).height == rows.height - k  # no `file`: one file


def test_predict_reads_only_the_columns_the_model_takes(tmp_path):
    """A folder of files whose other columns do not go together (a column of numbers in one file, of lists in
    another: a wide export, a column added later) predicts from the columns the model takes: those alone are read,
    so the rest neither fails the input ('cannot put the files ... together') nor fills the memory (the demo's
    80 columns for a model of 8). A file that lacks a column the model takes is still named."""
    from mlflow.types import ColSpec, Schema

    from shardline.app.predict_input import read_input

    schema = Schema([ColSpec("string", "seq"), ColSpec("long", "t"), ColSpec("double", "x")])
    (tmp_path / "in").mkdir()
    pl.DataFrame({"seq": ["a", "a"], "t": [1, 2], "x": [0.5, 1.5], "notes": [1, 2]}).write_parquet(
        tmp_path / "in/1.parquet"
    )
    pl.DataFrame({"seq": ["b"], "t": [1], "x": [2.5], "notes": [[1, 2]]}).write_parquet(tmp_path / "in/2.parquet")
    rows = read_input(str(tmp_path / "in"), schema)
    assert rows.columns == ["seq", "t", "x"] and rows["x"].to_list() == [0.5, 1.5, 2.5]
    with pytest.raises(ValueError, match="cannot put the files"):  # all of them, as before: the lists do not go
        read_input(str(tmp_path / "in"))
    pl.DataFrame({"seq": ["c"], "t": [1]}).write_parquet(tmp_path / "in/3.parquet")
    with pytest.raises(ValueError, match=r"3.parquet \(of .*\) lacks column\(s\) \['x'\] that the model takes"):
        read_input(str(tmp_path / "in"), schema)
    # a CSV export given for the input: said to be no parquet, and how to make it one
    pl.DataFrame({"seq": ["c"], "t": [1], "x": [2.5]}).write_csv(tmp_path / "in.csv")
    with pytest.raises(ValueError, match=r"in\.csv: .*reads parquet.*pl\.scan_csv\(path\)\.sink_parquet"):
        read_input(str(tmp_path / "in.csv"), schema)
