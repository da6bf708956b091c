"""The fine-tune parent: the model `training.init_from` names, resolved once per run into a `Parent` (a registered
model version, or a checkpoint and its checksum) that the steps after it are handed, never look up again: its
encoding, its tokenizer, its weights.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from shardline.core import layout, storage
from shardline.core.config import DataConfig, PipelineConfig
from shardline.core.manifest import EncodingSpec, Manifest
from shardline.core.tracking.tracker import fluent_tracking_uri, tracking_uri
from shardline.runs.model_files import registered_version
from shardline.runs.result import Parent


def resolve_parent(config: PipelineConfig) -> Parent | None:
    """What `training.init_from` names, resolved: for a registered model its name, version and run (an
    alias is resolved, so moving it starts another run), `uri` naming that version; for a checkpoint (or a run's
    checkpoints folder: its best, else its newest) its URI and checksum. An
    init_from that names nothing is an error naming it and where it was looked for."""
    uri = config.training.init_from
    if uri is None:
        return None
    if uri.startswith("models:/"):
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        where = tracking_uri(config.mlflow, config.storage.root)
        try:
            name, version = registered_version(MlflowClient(where), uri)
        except MlflowException as e:
            raise ValueError(
                f"training.init_from={uri}: no such registered model version in {where} "
                f"({e.message.splitlines()[0][:200]}); check the name and the alias or version"
            ) from None
        # named by its version, whichever way init_from named it: the same parent, the same identity
        return Parent(
            uri=f"models:/{name}/{version.version}", name=name, version=str(version.version), run_id=version.run_id
        )
    from shardline.trainer.checkpoint import best_checkpoint, latest_checkpoint

    if not storage.is_remote(uri) and not Path(storage.local_path(uri)).is_absolute():  # a --set path, from here
        uri = str(Path(storage.local_path(uri)).resolve())  # its tags name it from anywhere
    if uri.endswith(".pt"):
        found = (uri, {"sha256": storage.sha256_uri(uri)}) if storage.exists(uri) else None
    else:
        found = best_checkpoint(uri) or latest_checkpoint(uri)
    if found is None:
        raise ValueError(
            f"training.init_from={uri}: no checkpoint there; give a registered model (models:/name@alias), a "
            ".pt checkpoint or a run's checkpoints folder"
        )
    return Parent(uri=found[0], checkpoint=found[0], sha256=found[1].get("sha256"))


def pinned(config: PipelineConfig, parent: Parent | None) -> PipelineConfig:
    """`config` with `training.init_from` naming `parent` itself: an alias as the version it names now
    (models:/name/N), a run's checkpoints folder as the checkpoint it holds now (its .pt). A step handed only the
    config (the training deployment, run on its own) resolves the same parent, whatever moves meanwhile."""
    if parent is None or parent.uri == config.training.init_from:
        return config
    return config.model_copy(update={"training": config.training.model_copy(update={"init_from": parent.uri})})


def _registered_files(config: PipelineConfig, parent: Parent, dst: str, path: str) -> Path:
    """Only the file `path` of a registered parent's model folder, downloaded into `dst`; returns where it lies."""
    import mlflow

    uri = f"models:/{parent.name}/{parent.version}/{path}"
    with fluent_tracking_uri(tracking_uri(config.mlflow, config.storage.root)):
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst))


def _checkpoint_manifest(parent: Parent) -> tuple[str, Manifest]:
    """The manifest a checkpoint parent's run trained on (named in the checkpoint's sidecar): its URI, and it."""
    from shardline.trainer.checkpoint import sidecar_uri

    meta = json.loads(storage.read_text(sidecar_uri(parent.checkpoint)))
    uri = meta.get("run_meta", {}).get("manifest")
    if not uri or not storage.exists(uri):
        raise ValueError(
            f"training.init_from={parent.uri}: the checkpoint does not say which data it was trained on "
            f"(its manifest {uri!r} is gone), so its encoding cannot be reused; start from a registered "
            "model (models:/name@alias) instead"
        )
    return uri, Manifest.model_validate_json(storage.read_text(uri))


def parent_encoding(config: PipelineConfig, parent: Parent) -> EncodingSpec:
    """The encoding the model `training.init_from` names was trained with: a registered model's (its
    bundle), or a checkpoint's (the manifest its run trained on)."""
    if parent.checkpoint:
        return _checkpoint_manifest(parent)[1].encoding
    with tempfile.TemporaryDirectory() as tmp:
        bundle = json.loads(_registered_files(config, parent, tmp, "artifacts/bundle.json").read_text())
    return EncodingSpec.model_validate(bundle["encoding"])


def check_window(config: PipelineConfig, encoding: EncodingSpec, source: str) -> None:
    """A fine-tune of a text model by a built-in family with learned positions (one row per position of the window)
    on another `data.window` than its parent's: refused before any work, as loading the weights would refuse it after
    the encode (`trainer.contract.load_matching`, which also covers tabular data and a model of the user's own)."""
    from shardline.core.encoding.reuse import EncodingMismatch

    table = {"gpt": "wpe.weight", "transformer": "position.weight"}.get(config.model.family)
    if (
        config.model.entrypoint is None
        and table
        and encoding.text is not None
        and encoding.window != config.data.window
    ):
        raise EncodingMismatch(
            f"training.init_from={source}: its learned positions ({table}) cover a context of {encoding.window} "
            f"positions, this model's {config.data.window} (data.window); re-initialising them would silently "
            f"discard what the parent learned: set data.window to {encoding.window}, the parent's, or drop "
            "training.init_from"
        )


def parent_tokenizer(config: PipelineConfig, parent: Parent, encoding: EncodingSpec) -> str:
    """A text parent's tokenizer.json (the text): a registered model's bundled one, or the one beside the
    manifest a checkpoint's run trained on; checked against the sha256 its encoding records."""
    if parent.checkpoint:
        manifest_uri, manifest = _checkpoint_manifest(parent)
        where = storage.resolve(manifest_uri.rsplit("/", 1)[0], manifest.tokenizer or "tokenizer.json")
        text = storage.read_text(where) if storage.exists(where) else None
    else:
        from mlflow.exceptions import MlflowException

        where = f"{parent.uri} (artifacts/tokenizer.json)"
        with tempfile.TemporaryDirectory() as tmp:
            try:  # that file alone, not the model's weights
                found = _registered_files(config, parent, tmp, "artifacts/tokenizer.json")
            except (MlflowException, OSError):  # not in the model: said below
                found = None
            text = found.read_bytes().decode() if found and found.is_file() else None  # its sha256 is the file's
    if text is None or hashlib.sha256(text.encode()).hexdigest() != encoding.text.tokenizer_sha256:
        raise ValueError(
            f"training.init_from={parent.uri}: the tokenizer its token ids mean ({where}) is missing or not the "
            f"one it was trained with (sha256 {encoding.text.tokenizer_sha256[:12]}); start from another version"
        )
    return text


def with_parent_tokenizer(config: PipelineConfig, parent: Parent, encoding: EncodingSpec, log=print) -> DataConfig:
    """A fine-tune of a text model reads its parent's token ids: `config.data` with the parent's tokenizer
    (kept in the store under its sha256, `<root>/tokenizers/`) in place of data.tokenizer. A tokenizer file
    of the config's own that is another one is refused, before any work."""
    from shardline.core.encoding.reuse import EncodingMismatch
    from shardline.core.encoding.text import read_tokenizer_file, sha256_text

    sha = encoding.text.tokenizer_sha256
    mine = config.data.tokenizer
    # no sha256: the file was not there when the config was read (a typo, a file not copied): said naming it
    own = (mine.sha256 or sha256_text(read_tokenizer_file(mine.file))) if mine and mine.file else None
    if own not in (None, sha):
        raise EncodingMismatch(
            f"data.tokenizer.file '{mine.file}' (sha256 {own[:12]}) is not the tokenizer "
            f"{parent.uri} was trained with (sha256 {sha[:12]}); a fine-tune of a text model reads its "
            "parent's token ids: drop data.tokenizer (the parent's is used), or train without training.init_from"
        )
    data = parent_tokenized(config, encoding)
    uri = data.tokenizer.file
    if not storage.exists(uri):
        storage.write_text(uri, parent_tokenizer(config, parent, encoding))  # atomic: whole or absent
    if mine is None or mine.file is None:
        log(
            f"init_from {parent.uri}: the data is tokenized with the parent's tokenizer (sha256 {sha[:12]}), "
            + (
                f"not data.tokenizer's BPE of {mine.vocab_size} ids"
                if mine is not None
                else "as data.tokenizer is unset"
            )
        )
    return data


def parent_tokenized(config: PipelineConfig, encoding: EncodingSpec) -> DataConfig:
    """`config.data` as a fine-tune of the text model of `encoding` encodes it: data.tokenizer the parent's
    tokenizer, kept in the store under its sha256 (`with_parent_tokenizer` puts it there). Reads nothing."""
    from shardline.core.config import TokenizerConfig

    sha = encoding.text.tokenizer_sha256
    uri = layout.tokenizer(config.storage.root, sha)
    return config.data.model_copy(update={"tokenizer": TokenizerConfig(file=uri, sha256=sha)})


def init_weights(config: PipelineConfig, parent: Parent) -> dict:
    """The tensors of the model `training.init_from` names, loaded with weights_only=True."""
    import torch

    if parent.checkpoint:
        from shardline.trainer.checkpoint import load_checkpoint

        return load_checkpoint(parent.checkpoint)["model"]
    with tempfile.TemporaryDirectory() as tmp:  # the weights alone, not the rest of the model's folder
        local = _registered_files(config, parent, tmp, "artifacts/weights.pt")
        return torch.load(local, map_location="cpu", weights_only=True)
