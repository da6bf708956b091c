"""A registered model's files, checked before they run. A registered model is code (`pyfunc_model.py`, Shardline's
and the user's modules) beside its weights, under the storage root's `mlflow-artifacts/`: anyone who can write
there could change what runs when it loads. At registration every file's sha256 goes into a list (the run's
`model-files.json`) whose own sha256 is a tag of the version, in MLflow's database; `load_checked` downloads the
version, checks the list against the tag and every file against the list, and loads only a model that matches,
naming the file that does not."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path

from shardline.core.storage import sha256_file

FILES_TAG = "shardline.model_files_sha256"
FILES_ARTIFACT = "model-files.json"
DOWNLOAD_NOTES = {"registered_model_meta"}  # what MLflow writes beside a model it downloads: not the model's


class ModelFilesChanged(RuntimeError):
    """A registered model's files are not the ones it was registered with."""


def file_list(folder: Path) -> dict[str, str]:
    """Every file under `folder` (a model's), by its path there, with its sha256."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in DOWNLOAD_NOTES)
    return {path.relative_to(folder).as_posix(): sha256_file(path) for path in files}


def list_bytes(listing: dict[str, str]) -> bytes:
    return json.dumps(listing, indent=1, sort_keys=True).encode()


def record(model_uri: str) -> tuple[dict[str, str], str]:
    """At registration: the logged model's file list, and the sha256 of that list (the version's tag)."""
    import mlflow

    with tempfile.TemporaryDirectory(prefix="shardline-model-files-") as tmp:
        listing = file_list(Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=tmp)))
    return listing, hashlib.sha256(list_bytes(listing)).hexdigest()


@contextmanager
def code_paths_last():
    """What MLflow puts on `sys.path` meanwhile goes to its end. Loading a model (or validating one as it is logged),
    MLflow puts the model's code folders first on `sys.path`, for good: the processes this one spawns afterwards
    (Dask's local workers, a sweep's trials: multiprocessing hands them its `sys.path`) then imported Shardline
    from that model's copy, which holds only what predicting imports (see also `version.spawning_this_shardline`).
    Last, the folders still serve the model's own modules (the user's code), and Shardline imports from where it is
    installed."""
    before = list(sys.path)
    try:
        yield
    finally:
        now, n = list(sys.path), len(sys.path) - len(before)
        if n > 0 and now[n:] == before:  # prepended (a folder loaded twice is there twice)
            sys.path[:] = before + now[:n]
        else:
            added = [p for p in now if p not in before]
            sys.path[:] = [p for p in now if p not in added] + added


def load_pyfunc(uri: str):
    """`mlflow.pyfunc.load_model(uri)`, its code folders last on `sys.path` (`code_paths_last`)."""
    import mlflow

    with code_paths_last():
        return mlflow.pyfunc.load_model(uri)


def registered_version(client, model_uri: str):
    """The model's name, and the version that `models:/name/N` or `models:/name@alias` names."""
    name, at, ref = model_uri[len("models:/") :].partition("@")
    if at:
        return name, client.get_model_version_by_alias(name, ref)
    name, _, number = name.partition("/")
    return name, client.get_model_version(name, number)


def load_checked(model_uri: str):
    """The MLflow model `models:/name/N` (or `@alias`), loaded only when its files are the ones it was registered
    with; a version registered before files were recorded loads with a warning saying it was not checked. Its
    files are downloaded into a temporary folder that lives as long as the loaded model (it may read them as it
    runs) and is removed with it, or when the process exits."""
    folder = tempfile.mkdtemp(prefix="shardline-model-")
    try:
        model = _load_checked(model_uri, Path(folder))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    weakref.finalize(model, shutil.rmtree, folder, True)
    return model


def _load_checked(model_uri: str, folder: Path):
    import mlflow
    from mlflow import MlflowClient

    from shardline.core.tracking.tracker import mlflow_client_defaults

    mlflow_client_defaults()

    name, version = registered_version(MlflowClient(), model_uri)
    expected = (version.tags or {}).get(FILES_TAG)
    where = f"models:/{name}/{version.version}"
    for sub in ("model", "list"):  # MLflow downloads into a folder that exists
        (folder / sub).mkdir()
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=where, dst_path=str(folder / "model")))
    if expected is None:
        logging.getLogger("shardline").warning(
            "%s was registered before Shardline recorded its files: loaded without checking them", where
        )
        return load_pyfunc(str(local))
    listed = mlflow.artifacts.download_artifacts(
        artifact_uri=f"runs:/{version.run_id}/{FILES_ARTIFACT}", dst_path=str(folder / "list")
    )
    raw = Path(listed).read_bytes()
    if hashlib.sha256(raw).hexdigest() != expected:
        raise ModelFilesChanged(f"{where}: its file list ({FILES_ARTIFACT}) is not the one recorded at registration")
    want, got = json.loads(raw), file_list(local)
    changed = sorted(p for p in want.keys() | got.keys() if want.get(p) != got.get(p))
    if changed:
        how = {p: "added" if p not in want else "missing" if p not in got else "changed" for p in changed}
        said = ", ".join(f"{p} ({what})" for p, what in how.items())
        raise ModelFilesChanged(
            f"{where}: refused, its files are not the ones it was registered with: {said}. Nothing of it was run; "
            "register the model again from its run (shardline run CONFIG --force register)"
        )
    return load_pyfunc(str(local))


def integer_example(sample, integers: set[str]):
    """The input example with each of `integers` (the raw files' integer columns) as pandas' int64, as the signature
    declares them (`widened_signature`): pandas reads a column with a null as floats. A null of the example is given
    the column's smallest value there (MLflow's long takes no missing value: `shardline predict` does)."""
    out = sample.copy()
    for c in integers:
        if out[c].dtype.kind not in "iu":
            out[c] = out[c].fillna(out[c].min() if out[c].notna().any() else 0).astype("int64")
    return out


def widened_signature(signature, optional: list[str] = (), integers: set[str] = frozenset()):
    """Integer inputs as long and floating ones as double: MLflow upcasts narrower numbers to them, so a model
    trained on float32 and int16 columns takes pandas' own float64 and int64 too (the model casts them back to
    the training's types: `input_types` in its bundle). The `integers` (columns of an integer type in the raw files)
    are long though their sample's nulls made them floats in pandas: a double took no int64 user ids, and ids past
    2**53 lose digits as floats. The `optional` inputs (id columns that only pass through) are not required."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, Schema

    wide = {DataType.integer: DataType.long, DataType.float: DataType.double}

    def widened(t):  # (an object column's type: "any", unhashable); a list column's elements too (`vec[0:4]`)
        if isinstance(t, Array) and isinstance(t.dtype, DataType):
            return Array(wide.get(t.dtype, t.dtype))
        return wide.get(t, t) if isinstance(t, DataType) else t

    inputs = [
        ColSpec(
            DataType.long if c.name in integers else widened(c.type),
            c.name,
            required=c.required and c.name not in optional,
        )
        if isinstance(c, ColSpec)
        else c
        for c in signature.inputs.inputs
    ]
    return ModelSignature(Schema(inputs), signature.outputs, signature.params)
