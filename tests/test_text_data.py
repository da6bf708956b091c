"""Text data (`data.features.text`): a text column becomes one token stream per sequence in the shards (uint16
ids, `<sep>` between columns and rows, `<eos>` at the end), generation targets only on the target's tokens,
a tokenizer trained deterministically on the training split only, the encoding-hash refusal, and bad input
refused (or skipped) with what to do. The encode runs without Prefect (`encode_dataset`): seconds each."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch
from tokenizers import Tokenizer, models

from shardline.core import storage
from shardline.core.config import ConfigError, validate_config
from shardline.core.encoding.columns import DataError
from shardline.core.encoding.text import EOS_ID, PAD_ID, SEP_ID, decode, train_bpe
from shardline.core.manifest import EncodedGroup, Manifest, RawFile
from shardline.runs.result import Parent
from shardline.runs.training_run import load_manifest
from shardline.tasks.encode import encode_dataset, log_skipped_rows
from shardline.tasks.ingest import snapshot_source
from shardline.trainer.contract import default_loss
from shardline.trainer.data import open_split
from shardline.trainer.serving import data_spec

WORDS = "the quick brown fox jumps over a lazy dog while seven cats sing softly near old river".split()


def sentences(n: int, seed: int = 0, lo: int = 2, hi: int = 9) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(lo, hi))) for _ in range(n)]


def text_config(tmp_path: Path, **data) -> dict:
    return {
        "data": {
            "source": str(tmp_path / "raw" / "*.parquet"),
            "features": {"text": ["body"]},
            "tokenizer": {"kind": "bpe", "vocab_size": 300},
            "window": 8,
            "split": {"method": "hash", "seed": 1, "fractions": {"train": 0.6, "validation": 0.2, "test": 0.2}},
            **data,
        },
        "model": {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2},
        "storage": {"root": str(tmp_path / "store")},
    }


def write(tmp_path: Path, frame: pl.DataFrame, name: str = "a.parquet") -> None:
    (tmp_path / "raw").mkdir(parents=True, exist_ok=True)
    frame.write_parquet(tmp_path / "raw" / name)


def encode(tmp_path: Path, raw: dict, out: str = "ds") -> tuple[Manifest, str]:
    config = validate_config(raw)
    uri = encode_dataset(snapshot_source(config.data), config.data, str(tmp_path / out))
    return Manifest.model_validate_json(storage.read_text(uri)), uri


def tokenizer_of(uri: str) -> str:
    return Path(uri).with_name("tokenizer.json").read_text()


def streams(manifest: Manifest, uri: str, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each sequence's (tokens, targets) as the shards store them, by its key."""
    out = {}
    folder = uri.rsplit("/", 1)[0]
    for info in manifest.shards_of(split):
        view = open_split(manifest, uri, split)  # one shard per split here
        arrays = view.view(0).arrays
        keys = pl.read_parquet(io.BytesIO(storage.read_bytes(storage.resolve(folder, info.keys_path))))["sequence"]
        offsets = np.asarray(arrays["offsets"])
        for i, key in enumerate(keys.to_list()):
            a, b = offsets[i], offsets[i + 1]
            out[key] = (np.asarray(arrays["cat"][a:b, 0]), np.asarray(arrays["target"][a:b]))
    return out


def test_documents_and_sequences_become_uint16_streams_that_decode_to_their_texts(tmp_path):
    titles, bodies = sentences(60, 1), sentences(60, 2)
    titles[0] = "markup <pad> and <eos> or <sep> as text"  # literal special tokens are text, not the special ids
    write(tmp_path, pl.DataFrame({"title": titles, "body": bodies}))
    manifest, uri = encode(tmp_path, text_config(tmp_path, features={"text": ["title", "body"]}))
    tok = tokenizer_of(uri)
    spec = data_spec(manifest.encoding)
    assert (spec.categorical, spec.cardinalities, spec.continuous, spec.boolean) == (["tokens"], [300], [], [])
    assert spec.targets[0].name == "next_token" and spec.targets[0].n_classes == 300
    assert spec.targets[0].positions == "all" and spec.text["pad_id"] == PAD_ID and spec.window == 8
    seen = 0
    for split in ("train", "validation", "test"):
        for key, (tokens, targets) in streams(manifest, uri, split).items():
            row = int(key.rsplit("#", 1)[1])  # a document: its file and row
            assert tokens.dtype == np.uint16
            real = tokens[: np.flatnonzero(tokens == EOS_ID)[0] + 1]
            assert decode(tok, real) == titles[row] + bodies[row]  # the special tokens are not text
            assert (tokens[len(real) :] == PAD_ID).all() and len(tokens) >= 9  # padded to a window and its next
            assert (real == SEP_ID).sum() == 1 and real[-1] == EOS_ID  # title <sep> body <eos>
            np.testing.assert_array_equal(targets, tokens)  # pre-training: every token is a target, <pad> is 0
            seen += 1
    assert seen == 60

    # a sequence key's rows, in order, separated by <sep>: one stream per sequence
    (tmp_path / "raw" / "a.parquet").unlink()
    lines = sentences(40, 3)
    docs = pl.DataFrame(
        {"doc": [f"d{i // 4}" for i in range(40)], "line": [3 - i % 4 for i in range(40)], "body": lines}
    )
    write(tmp_path, docs)
    manifest, uri = encode(tmp_path, text_config(tmp_path, sequence_key="doc", order_by="line"), out="ds2")
    tok = tokenizer_of(uri)
    got = {k: v for split in ("train", "validation", "test") for k, v in streams(manifest, uri, split).items()}
    assert sorted(got) == sorted({f"d{i}" for i in range(10)})
    for key, (tokens, _) in got.items():
        rows = docs.filter(pl.col("doc") == key).sort("line")["body"].to_list()
        cut = np.flatnonzero((tokens == SEP_ID) | (tokens == EOS_ID))
        pieces = np.split(tokens[: cut[-1]], cut[:-1] + 1)
        assert [decode(tok, p[p != SEP_ID]) for p in pieces] == rows and tokens[cut[-1]] == EOS_ID


def test_generation_targets_are_the_summary_tokens_and_the_loss_ignores_the_rest(tmp_path):
    articles, summaries = sentences(50, 4, 4, 12), sentences(50, 5, 1, 4)
    write(tmp_path, pl.DataFrame({"article": articles, "summary": summaries}))
    raw = text_config(
        tmp_path, features={"text": ["article"]}, target={"column": "summary", "task": "generation"}, window=12
    )
    manifest, uri = encode(tmp_path, raw)
    tok = tokenizer_of(uri)
    assert data_spec(manifest.encoding).targets[0].name == "summary"
    from shardline.core.encoding.text import prompt_ids

    trimmed = 0
    for key, (tokens, targets) in streams(manifest, uri, "train").items():
        row = int(key.rsplit("#", 1)[1])
        sep = np.flatnonzero(tokens == SEP_ID)[0]
        eos = np.flatnonzero(tokens == EOS_ID)[0]
        # the source's last 11 tokens and its <sep> (window 12 + horizon 1 - 1): what any window with a target
        # reads of it; a longer source's first tokens are read by windows without a target only, left out
        (article,) = prompt_ids(tok, [[articles[row]]], generation=False)
        assert tokens[:sep].tolist() == article[-11:] and sep == min(len(article), 11)
        trimmed += len(article) > 11
        assert decode(tok, tokens[sep + 1 : eos]) == summaries[row]
        assert (targets[: sep + 1] == 0).all() and (targets[eos + 1 :] == 0).all()  # the source is context only
        np.testing.assert_array_equal(targets[sep + 1 : eos + 1], tokens[sep + 1 : eos + 1])  # summary and <eos>
    assert trimmed >= 5  # the test covers sources longer than the context

    # through the loader: position k's target is the next token where that is the summary's, else 0
    train = open_split(manifest, uri, "train")
    batch = train.batch(np.arange(train.n_windows))
    cat, y = batch.cat[..., 0].long(), batch.targets[0].long()
    arrays = train.view(0).arrays
    start = train.view(0).starts
    nxt = torch.from_numpy(np.asarray(arrays["cat"][:, 0]).astype(np.int64))[start[:, None] + np.arange(1, 13)]
    tgt = torch.from_numpy(np.asarray(arrays["target"]).astype(np.int64))[start[:, None] + np.arange(1, 13)]
    assert torch.equal(y, tgt) and torch.equal(y[y != 0], nxt[y != 0]) and (y == 0).any() and (y != 0).any()
    assert (y != 0).any(dim=1).all()  # every window trains on some of a summary: none is spent on source alone
    assert torch.equal(
        cat, torch.from_numpy(np.asarray(arrays["cat"][:, 0]).astype(np.int64))[start[:, None] + np.arange(12)]
    )

    # the default loss counts the summary's positions only: what the model says elsewhere changes nothing
    spec = data_spec(manifest.encoding)
    logits = torch.randn(*y.shape, 300)
    other = logits.clone()
    other[y == 0] = torch.randn(int((y == 0).sum()), 300) * 10
    assert torch.allclose(
        default_loss({"summary": logits}, {"summary": y}, spec), default_loss({"summary": other}, {"summary": y}, spec)
    )
    changed = logits.clone()
    changed[y != 0] += torch.randn(int((y != 0).sum()), 300)
    assert not torch.allclose(
        default_loss({"summary": logits}, {"summary": y}, spec),
        default_loss({"summary": changed}, {"summary": y}, spec),
    )


def test_the_generation_baseline_answers_the_training_targets_commonest_and_scores_it_on_the_test_rows(tmp_path):
    from shardline.core.metrics.text import text_generation_scores
    from shardline.tasks.evaluate import majority_answer, test_pairs

    # a "generation" that is a label: most training rows say "yes"; a model must say more than that to beat it
    answers = ["yes please", "no", "yes please", "maybe so", "yes please", "no"] * 20
    write(tmp_path, pl.DataFrame({"article": sentences(120, 4, 4, 12), "summary": answers}))
    raw = text_config(
        tmp_path, features={"text": ["article"]}, target={"column": "summary", "task": "generation"}, window=12
    )
    manifest, uri = encode(tmp_path, raw)
    config = validate_config(raw)
    tok = tokenizer_of(uri)
    train = [decode(tok, r) for _, r in test_pairs(open_split(manifest, uri, "train"), 10**6, SEP_ID, EOS_ID)]
    commonest = max(set(train), key=train.count)
    assert commonest == "yes please" and train.count("no") < train.count(commonest)
    assert decode(tok, majority_answer(manifest, uri, config, SEP_ID, EOS_ID)) == commonest
    # the baseline's scores are that answer's on the test rows: exact where a test row says it, half a match on none
    refs = [decode(tok, r) for _, r in test_pairs(open_split(manifest, uri, "test"), 10**6, SEP_ID, EOS_ID)]
    said = text_generation_scores([commonest] * len(refs), refs)
    assert said["exact_match"] == refs.count("yes please") / len(refs)
    assert 0 < said["exact_match"] < 1 and said["token_f1"] == said["exact_match"]
    # a pass stops opening shards once it has what it asked for
    opened = []
    data = open_split(manifest, uri, "train")
    assert data.each_shard(lambda v, s: opened.append(s), until=lambda: True) == [] and opened == []


def test_the_tokenizer_is_byte_identical_on_re_encode_and_trained_on_the_train_split_only(tmp_path):
    bodies = sentences(80, 6)
    write(tmp_path, pl.DataFrame({"body": bodies}))
    raw = text_config(tmp_path)
    manifest, uri = encode(tmp_path, raw)
    first = tokenizer_of(uri)
    again = tokenizer_of(encode(tmp_path, raw, out="again")[1])
    assert again == first  # same data -> the same bytes
    assert manifest.encoding.text.tokenizer_sha256 == hashlib.sha256(first.encode()).hexdigest()

    def row_of(split: str) -> int:
        return int(next(iter(streams(manifest, uri, split))).rsplit("#", 1)[1])

    for split, changes in (("test", False), ("validation", False), ("train", True)):
        edited = list(bodies)
        edited[row_of(split)] = "zebra zebra xylophone quartz " * 6
        write(tmp_path, pl.DataFrame({"body": edited}))
        assert (tokenizer_of(encode(tmp_path, raw, out=f"edit-{split}")[1]) != first) is changes, split


def test_shards_tokenized_otherwise_are_refused_naming_both_tokenizers(tmp_path):
    write(tmp_path, pl.DataFrame({"body": sentences(40, 7)}))
    files = []
    for i, size in enumerate((270, 290)):
        path = tmp_path / f"tok{i}.json"
        path.write_text(train_bpe(sentences(200, 8 + i), size))
        files.append(path)
    raw = text_config(tmp_path, tokenizer={"file": str(files[0])})
    _, uri = encode(tmp_path, raw)
    config = validate_config(raw)
    load_manifest(uri, config)  # the config it was encoded for
    # a training worker without the file: the config, as the pipeline sends it, still names its tokenizer
    sent = config.model_dump(mode="json")
    files[0].rename(tmp_path / "elsewhere.json")
    load_manifest(uri, validate_config(sent))
    (tmp_path / "elsewhere.json").rename(files[0])
    other = text_config(tmp_path, tokenizer={"file": str(files[1])})
    with pytest.raises(ValueError) as err:
        load_manifest(uri, validate_config(other))
    shas = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    assert "data.tokenizer" in str(err.value) and shas[0] in str(err.value) and shas[1] in str(err.value)
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_manifest(uri, validate_config(text_config(tmp_path)))  # a trained BPE is not that file either


def test_a_tokenizer_file_on_an_object_store_is_read_where_the_config_file_says(tmp_path):
    """A config file's relative paths are taken from its folder; a URL (`s3://...`) is not a relative path: it
    was rewritten into a path below the config's folder, so a team's tokenizer on the store was 'not there'."""
    import fsspec
    import yaml

    from shardline.core.config import load_config
    from shardline.core.encoding.text import read_tokenizer_file

    url = "memory://shardline-test/tok.json"
    text = train_bpe(sentences(200, 8), 270)
    with fsspec.open(url, "w") as f:
        f.write(text)
    write(tmp_path, pl.DataFrame({"body": sentences(40, 7)}))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(text_config(tmp_path, tokenizer={"file": url})))
    config = load_config(tmp_path / "run.yaml", [])
    assert config.data.tokenizer.file == url
    assert read_tokenizer_file(config.data.tokenizer.file) == text  # every machine reads it from the store


def test_bad_text_input_is_refused_or_skipped_with_what_to_do(tmp_path):
    bodies = sentences(30, 9)
    bodies[3], bodies[7], bodies[11] = None, "", None
    write(tmp_path, pl.DataFrame({"body": bodies}, schema={"body": pl.String}))
    raw = text_config(tmp_path)
    with pytest.raises(DataError) as err:
        encode(tmp_path, raw)
    said = str(err.value)
    assert "a.parquet" in said and "'body'" in said and "3 null or empty" in said and "on_bad_rows: skip" in said
    manifest, uri = encode(tmp_path, text_config(tmp_path, on_bad_rows="skip"))
    assert sum(manifest.rows.values()) == 27
    # the rows left out are said in the encode's log, per file and column
    groups = [
        EncodedGroup.model_validate_json(g.read_text()) for g in (tmp_path / "ds" / "groups").glob("*/group.json")
    ]
    logged = []
    skipped = log_skipped_rows(groups, SimpleNamespace(warning=lambda msg, *args: logged.append(msg % args)))
    assert list(skipped.values()) == [{"body": 3}] and "3 in all" in logged[0] and "a.parquet" in logged[0]

    # every text row skipped: an empty corpus after the split, refused naming the rows left out and data.split (not
    # data.window: every document gives a window, however short)
    write(tmp_path, pl.DataFrame({"body": [None] * 30}, schema={"body": pl.String}))
    said = r"train, validation, test with no window.*no sequence of text \(rows of no text left out.*data.split"
    with pytest.raises(DataError, match=said):
        encode(tmp_path, text_config(tmp_path, on_bad_rows="skip"), out="empty")

    # a column that is not text, declared as text: the file is refused before any work, naming it
    write(tmp_path, pl.DataFrame({"body": [1, 2, 3]}))
    with pytest.raises(DataError, match="column 'body' has type int64, but as the text it must be a string"):
        snapshot_source(validate_config(raw).data)
    write(tmp_path, pl.DataFrame({"body": [["a", "b"], ["c"], ["d"]]}))  # a text's pieces: joined, not elements
    with pytest.raises(DataError, match=r"join a row's pieces into one string \(polars: pl.col\('body'\).list.join"):
        snapshot_source(validate_config(raw).data)
    write(tmp_path, pl.DataFrame({"body": sentences(30, 9)}))

    # a tokenizer file that is not there, does not parse, or lacks the special ids: refused naming the path
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    plain = tmp_path / "plain.json"
    plain.write_text(Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str())
    for path, said in (
        (tmp_path / "missing.json", "does not exist"),
        (bad, "not a tokenizer.json"),
        (plain, "<pad>=0, <sep>=1, <eos>=2"),
    ):
        with pytest.raises(DataError, match=said) as err:
            encode(tmp_path, text_config(tmp_path, tokenizer={"file": str(path)}), out=path.stem)
        assert str(path) in str(err.value)

    # a vocabulary the storage type cannot hold is refused naming data.tokenizer; the narrowest type otherwise
    from shardline.core.encoding.text import token_dtype

    sizes = (300, 1 << 16, (1 << 16) + 1, 1 << 32)
    assert [token_dtype(v) for v in sizes] == [np.uint16, np.uint16, np.uint32, np.uint32]
    with pytest.raises(DataError, match="data.tokenizer: the vocabulary has 4,294,967,297 ids.*uint32"):
        token_dtype((1 << 32) + 1)

    # a parent whose learned positions cover another context than data.window: refused, not re-initialised
    from shardline.trainer.contract import ModelContractError, load_matching

    class LM(torch.nn.Module):
        shardline_position_tables = ("wpe.weight",)  # as the gpt family declares its learned positions

        def __init__(self, window, width=4):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(10, width), torch.nn.Embedding(window, width)

    with pytest.raises(ModelContractError, match=r"covers? a context of 8 positions, this model's 16 \(data.window\)"):
        load_matching(LM(16), LM(8).state_dict(), "runs:/parent/model")
    assert load_matching(LM(8), LM(8).state_dict(), "runs:/parent/model")["skipped"] == []
    # another width is another architecture, not another context: skipped as any mismatch (then "none matches")
    with pytest.raises(ModelContractError, match="none of its 2 tensors matches"):
        load_matching(LM(16, width=8), LM(16).state_dict(), "runs:/parent/model")
    # a model that declares no position table: a mismatching one is skipped and listed, as any other tensor
    plain = torch.nn.Module()
    plain.wte, plain.wpe = torch.nn.Embedding(10, 4), torch.nn.Embedding(16, 4)
    assert load_matching(plain, LM(8).state_dict(), "runs:/parent/model")["skipped"] == ["wpe.weight [8, 4] -> [16, 4]"]

    # text mixed with other roles, or without a tokenizer, or asked for the last position only: the config says so
    for data, said in (
        ({"features": {"text": ["body"], "continuous": ["x"]}}, "cannot be mixed"),
        ({"tokenizer": None}, "needs data.tokenizer"),
        ({"target_positions": "last"}, "must be 'all'"),
        ({"target": {"column": "body", "task": "generation"}}, "also in data.features.text"),
    ):
        with pytest.raises(ConfigError, match=said):
            validate_config(text_config(tmp_path, **data))


def test_a_fine_tune_of_a_text_model_refuses_data_of_another_tokenizer():
    from shardline.core.encoding.reuse import EncodingMismatch, reuse_encoding
    from shardline.core.manifest import EncodingSpec, TextSpec

    def spec(sha):
        text = None
        if sha:
            text = TextSpec(columns=["doc"], vocab_size=300, tokenizer_sha256=sha, tokenizer={"kind": "bpe"})
        return EncodingSpec(
            sequence_key=None, order_by=None, window=8, horizon=1, continuous=[], boolean=[], categorical=[], text=text
        )

    assert reuse_encoding(spec("a" * 64), spec("a" * 64), "models:/lm/1").text.tokenizer_sha256 == "a" * 64
    with pytest.raises(EncodingMismatch, match=r"bbbbbbbbbbbb\) is not the one models:/lm/1 was trained with"):
        reuse_encoding(spec("b" * 64), spec("a" * 64), "models:/lm/1")
    with pytest.raises(EncodingMismatch, match="not a text model"):
        reuse_encoding(spec("b" * 64), spec(None), "models:/tabular/1")


def test_a_text_fine_tune_with_another_tokenizer_is_refused_when_its_manifest_is_built(tmp_path):
    from shardline.core.encoding.reuse import EncodingMismatch
    from shardline.core.encoding.write import build_manifest

    write(tmp_path, pl.DataFrame({"body": sentences(100)}))
    manifest, _ = encode(tmp_path, text_config(tmp_path))
    data = validate_config(text_config(tmp_path)).data
    records = sorted((tmp_path / "ds" / "groups").glob("*/group.json"))
    groups = [EncodedGroup.model_validate_json(p.read_text()) for p in records]
    tok = (tmp_path / "ds" / "tokenizer.json").read_text()

    def built(parent):
        return build_manifest(snapshot_source(data), groups, data, base=(parent, "models:/lm/1"), tokenizer=tok)

    # the parent's own tokenizer: the manifest is built, its tokenizer the parent's
    assert built(manifest.encoding).encoding.text.tokenizer_sha256 == manifest.encoding.text.tokenizer_sha256
    # another tokenizer of the same vocabulary size: its ids would be other words to the parent's embeddings
    other = manifest.encoding.text.model_copy(update={"tokenizer_sha256": "a" * 64})
    with pytest.raises(EncodingMismatch, match=r"is not the one models:/lm/1 was trained with \(aaaaaaaaaaaa\)"):
        built(manifest.encoding.model_copy(update={"text": other}))


def test_a_text_fine_tune_takes_its_parent_s_tokenizer_and_refuses_another_before_any_work(tmp_path):
    """Text columns are one token stream whatever their names (a pre-trained LM's `doc` fine-tuned on a
    summarizer's `body`); what must match is the tokenizer, which the fine-tune takes from its parent."""
    from shardline.core.encoding.reuse import EncodingMismatch, check_columns
    from shardline.core.manifest import EncodingSpec, TextSpec
    from shardline.runs.parent import with_parent_tokenizer

    lm = EncodingSpec(
        sequence_key=None, order_by=None, window=8, horizon=1, continuous=[], boolean=[], categorical=[],
        text=TextSpec(columns=["doc"], vocab_size=300, tokenizer_sha256="a" * 64, tokenizer={"kind": "bpe"}),
    )  # fmt: skip
    check_columns({"text": ["body"], "continuous": [], "boolean": [], "categorical": []}, lm, "models:/lm/1")
    with pytest.raises(EncodingMismatch, match=r"models:/lm/1 is a text model and this data is not text"):
        check_columns({"continuous": ["x"]}, lm, "models:/lm/1")
    tabular = lm.model_copy(update={"text": None})
    with pytest.raises(EncodingMismatch, match=r"models:/tab/2 is not a text model and this data is text"):
        check_columns({"text": ["body"]}, tabular, "models:/tab/2")

    # a tokenizer file of the config's own that is not the parent's: refused naming both, nothing written
    (tmp_path / "mine.json").write_text(train_bpe(sentences(50), 300))
    config = validate_config(
        {
            **text_config(tmp_path, tokenizer={"file": str(tmp_path / "mine.json")}),
            "training": {"init_from": "models:/lm/1"},
        }
    )
    with pytest.raises(EncodingMismatch, match=r"mine.json' \(sha256 \w{12}\) is not the tokenizer models:/lm/1 "):
        with_parent_tokenizer(config, Parent(uri="models:/lm/1"), lm)
    assert not (Path(config.storage.root) / "tokenizers").exists()
    # without a tokenizer of its own, a text fine-tune's config is valid (its parent's is used); not otherwise
    raw = text_config(tmp_path)
    del raw["data"]["tokenizer"]
    assert validate_config({**raw, "training": {"init_from": "models:/lm/1"}}).data.tokenizer is None
    with pytest.raises(ConfigError, match="a fine-tune \\(training.init_from a text model\\) uses its parent's"):
        validate_config(raw)
    # its learned positions cover the parent's window: another data.window is refused before any work (it was said
    # once ingest and encode had run, as the weights were loaded)
    from shardline.runs.parent import check_window

    for family, table in (("gpt", "wpe.weight"), ("transformer", "position.weight")):
        wider = validate_config(
            {**raw, "data": {**raw["data"], "window": 16}, "model": {"family": family, "hidden": 16, "heads": 2},
             "training": {"init_from": "models:/lm/1"}}
        )  # fmt: skip
        said = rf"models:/lm/1: its learned positions \({table}\) cover a context of 8 positions, this model's 16"
        with pytest.raises(EncodingMismatch, match=said):
            check_window(wider, lm, "models:/lm/1")
        check_window(wider, lm.model_copy(update={"window": 16}), "models:/lm/1")  # the parent's window: taken


def test_a_tokenizer_file_saved_with_truncation_and_padding_still_tokenizes_every_text_whole(tmp_path):
    from shardline.core.encoding.text import prompt_ids

    texts = sentences(60, lo=20, hi=30)  # far longer than the file's 6 tokens
    write(tmp_path, pl.DataFrame({"body": texts}))
    whole = train_bpe(texts, 300)
    saved = Tokenizer.from_str(whole)
    saved.enable_truncation(max_length=6)
    saved.enable_padding(pad_id=0, pad_token="<pad>", length=64)
    (tmp_path / "t.json").write_text(saved.to_str())
    manifest, uri = encode(tmp_path, text_config(tmp_path, tokenizer={"file": str(tmp_path / "t.json")}))
    n = 0
    for split in ("train", "validation", "test"):
        for key, (tokens, _) in streams(manifest, uri, split).items():
            row = int(key.rsplit("#", 1)[1])
            real = tokens[: np.flatnonzero(tokens == EOS_ID)[0]]
            assert decode(whole, real) == texts[row] and len(real) > 6  # every token, no padding inside
            n += 1
    assert n == 60
    # serving tokenizes a prompt whole too, as training did
    full = Tokenizer.from_str(whole).encode(texts[0], add_special_tokens=False).ids
    assert prompt_ids(saved.to_str(), [[texts[0]]], generation=False) == [full]


def test_a_tokenizer_file_whose_ids_are_not_contiguous_is_refused_naming_it_and_its_largest_id(tmp_path):
    from tokenizers import pre_tokenizers

    write(tmp_path, pl.DataFrame({"body": sentences(100)}))
    for first in (500, 70_000):  # past the vocabulary; past what uint16 holds
        vocab = {"<pad>": 0, "<sep>": 1, "<eos>": 2, "[UNK]": 3}
        vocab.update({w: first + i for i, w in enumerate(WORDS[:4])})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        (tmp_path / "t.json").write_text(tok.to_str())
        with pytest.raises(DataError) as e:
            encode(tmp_path, text_config(tmp_path, tokenizer={"file": str(tmp_path / "t.json")}))
        said = str(e.value)
        assert f"data.tokenizer.file '{tmp_path / 't.json'}'" in said and f"{first + 3:,}" in said
        assert "has 8 tokens" in said and "re-number the vocabulary 0..N-1" in said
        assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_tokenizer_file_edited_after_the_config_was_read_is_refused_naming_it(tmp_path):
    from shardline.tasks.encode import dataset_id

    write(tmp_path, pl.DataFrame({"body": sentences(100)}))
    path = tmp_path / "t.json"
    path.write_text(train_bpe(sentences(100, seed=1), 300))
    config = validate_config(text_config(tmp_path, tokenizer={"file": str(path)}))
    snapshot = snapshot_source(config.data)
    before = dataset_id(snapshot, config.data)
    path.write_text(train_bpe(sentences(100, seed=2), 400))  # edited after the config was read
    with pytest.raises(DataError, match=rf"data.tokenizer.file '{path}' changed since the config was read.*run again"):
        encode_dataset(snapshot, config.data, str(tmp_path / "ds"))
    assert not (tmp_path / "ds" / "manifest.json").exists()
    # read again: the data set's id is the new file's, and its shards are tokenized by it
    config = validate_config(text_config(tmp_path, tokenizer={"file": str(path)}))
    assert dataset_id(snapshot, config.data) != before
    uri = encode_dataset(snapshot, config.data, str(tmp_path / "ds"))
    assert tokenizer_of(uri) == path.read_text()


def test_a_categorical_text_column_encodes_to_the_tokens_of_the_same_column_as_strings(tmp_path):
    import pandas as pd

    from shardline.core.encoding.write import read_text_group

    texts = sentences(100)
    results = {}
    frames = {
        "plain": pl.DataFrame({"body": texts}),
        "categorical": pl.DataFrame({"body": pl.Series(texts, dtype=pl.Categorical)}),
        "enum": pl.DataFrame({"body": pl.Series(texts, dtype=pl.Enum(sorted(set(texts))))}),
    }
    for name, frame in frames.items():
        write(tmp_path / name, frame)
        manifest, uri = encode(tmp_path / name, text_config(tmp_path / name))
        results[name] = (tokenizer_of(uri), {s: streams(manifest, uri, s) for s in ("train", "validation", "test")})
    # a pandas category column (dictionary-encoded in the file), in a group beside a plain file
    pd.DataFrame({"body": pd.Series(texts[:50], dtype="category")}).to_parquet(tmp_path / "mixed.parquet")
    pl.DataFrame({"body": texts[50:]}).write_parquet(tmp_path / "mixed2.parquet")
    data = validate_config(text_config(tmp_path)).data
    files = [RawFile(uri=str(tmp_path / f), size=0, version="0") for f in ("mixed.parquet", "mixed2.parquet")]
    assert read_text_group(files, data)[0]["body"].to_list() == texts

    plain_tok, plain = results.pop("plain")
    for name, (tok, got) in results.items():
        assert tok == plain_tok, name
        for split in plain:
            assert got[split].keys() == plain[split].keys(), name
            for key, (tokens, targets) in plain[split].items():
                np.testing.assert_array_equal(got[split][key][0], tokens)
                np.testing.assert_array_equal(got[split][key][1], targets)

    # a text column of another type, where ingest did not see it (the file replaced since): said naming the
    # file, the column and its type
    pl.DataFrame({"body": list(range(50))}).write_parquet(tmp_path / "mixed2.parquet")
    with pytest.raises(DataError, match=rf"{tmp_path / 'mixed2.parquet'}: text column 'body' is Int64, not text"):
        read_text_group(files, data)


def split_of_rows(manifest: Manifest, uri: str) -> dict[str, str]:
    """Each document's split, by its key (its file and row)."""
    folder = uri.rsplit("/", 1)[0]
    out = {}
    for info in manifest.shards:
        keys = pl.read_parquet(io.BytesIO(storage.read_bytes(storage.resolve(folder, info.keys_path))))["sequence"]
        out.update(dict.fromkeys(keys.to_list(), info.split))
    return out


def test_leaving_out_a_bad_text_row_moves_no_other_row_to_another_split(tmp_path):
    # a row's split is drawn from its file and its place in the file as written: emptying the first row of a
    # file (left out, data.on_bad_rows: skip) must not move the file's later rows, nor another file's, to
    # another split (test rows would end up in training)
    a, b = sentences(200, 3), sentences(120, 4)
    write(tmp_path, pl.DataFrame({"body": a}))
    write(tmp_path, pl.DataFrame({"body": b}), "b.parquet")
    raw = text_config(tmp_path, on_bad_rows="skip")
    before = split_of_rows(*encode(tmp_path, raw))
    assert len(before) == 320 and set(before.values()) == {"train", "validation", "test"}
    a[0] = ""
    write(tmp_path, pl.DataFrame({"body": a}))
    after = split_of_rows(*encode(tmp_path, raw, out="ds2"))
    gone = set(before) - set(after)
    assert len(gone) == 1 and next(iter(gone)).endswith("a.parquet#0") and set(after) < set(before)
    assert after == {k: before[k] for k in after}


def test_the_same_tokenizer_file_at_another_path_finds_the_same_encoded_groups(tmp_path):
    # the config loader makes data.tokenizer.file absolute: a moved project or a teammate's checkout at another
    # path must not encode every group again; the file's content decides
    from shardline.core.encoding.write import file_groups
    from shardline.tasks.encode import TOKENIZER_CACHE, group_key

    write(tmp_path, pl.DataFrame({"body": sentences(50)}))
    tok = train_bpe(sentences(50), 300)
    for d, text in (("x", tok), ("y", tok), ("z", train_bpe(sentences(50, 1), 300))):
        (tmp_path / d).mkdir()
        (tmp_path / d / "tokenizer.json").write_text(text)

    def keys(d: str):
        data = validate_config(text_config(tmp_path, tokenizer={"file": str(tmp_path / d / "tokenizer.json")})).data
        snapshot = snapshot_source(data)
        inputs = {"snapshot": snapshot, "data": data, "out_dir": str(tmp_path / "ds")}
        groups = [group_key(g, data, data.tokenizer.sha256) for g in file_groups(snapshot, data)]
        return groups, TOKENIZER_CACHE.key(inputs)

    x, y, z = keys("x"), keys("y"), keys("z")
    assert x == y  # the same bytes elsewhere: the same groups and tokenizer
    assert x[0] != z[0] and x[1] != z[1]  # another tokenizer: other groups


def test_texts_tokenized_in_small_batches_give_byte_identical_shards(tmp_path, monkeypatch):
    # a group's texts are tokenized a batch at a time (its memory bounded by the batch, not the group): the
    # shards are the same bytes whatever the batch, down to one text, or a few, at a time
    from shardline.core.encoding import text

    rng = np.random.default_rng(5)
    n = 300
    titles = sentences(n, 6, 1, 4)
    bodies = [" ".join(sentences(int(rng.integers(1, 12)), i)) for i in range(n)]  # a few bytes to ~600
    write(tmp_path, pl.DataFrame({"title": titles, "body": bodies}))
    raw = text_config(tmp_path, features={"text": ["title", "body"]})

    def shards(out: str) -> list[tuple[str, str]]:
        manifest, _ = encode(tmp_path, raw, out=out)
        return sorted((s.split, s.sha256) for s in manifest.shards)

    whole = shards("whole")
    assert len(whole) == 3
    for texts, size in ((7, 1 << 20), (1000, 200), (1, 1)):
        monkeypatch.setattr(text, "TOKENIZE_TEXTS", texts)
        monkeypatch.setattr(text, "TOKENIZE_BYTES", size)
        assert shards(f"b{texts}-{size}") == whole


def small_text_predictor(tmp_path: Path):
    """A predictor of an untrained small transformer over 60 sentences' tokens (the serving path, no training)."""
    from shardline.core.config import ModelConfig
    from shardline.trainer.models import model_from_spec, model_spec_for
    from shardline.trainer.serving import Predictor, data_spec

    write(tmp_path, pl.DataFrame({"body": sentences(60, 7)}))
    manifest, uri = encode(tmp_path, text_config(tmp_path))
    torch.manual_seed(0)
    model = model_from_spec(
        model_spec_for(ModelConfig(family="transformer", hidden=16, layers=1, heads=2), data_spec(manifest.encoding))
    ).eval()
    return Predictor(manifest.encoding, model, tokenizer_of(uri))


def test_a_text_model_serves_categorical_text_and_refuses_other_types_naming_the_column(tmp_path):
    predictor = small_text_predictor(tmp_path)
    rows = pl.DataFrame({"body": ["the quick brown", "a lazy"]})
    plain = predictor.predict_frame(rows, params={"max_tokens": 3})
    categorical = predictor.predict_frame(
        rows.with_columns(pl.col("body").cast(pl.Categorical)), params={"max_tokens": 3}
    )
    assert plain.equals(categorical)
    for bad, dtype in (([[1, 2], [3]], "List"), ([1, 2], "Int64")):
        with pytest.raises(DataError, match=rf"input column 'body' is {dtype}.*, not text; the model reads strings"):
            predictor.predict_frame(pl.DataFrame({"body": bad}))
    # a text model has no rows to come to forecast: said, not ignored (`shardline generate` writes on)
    with pytest.raises(DataError, match=r"--forecast: a text model predicts each row's next token"):
        predictor.predict_frame(rows, forecast=True)


def test_a_text_row_without_text_has_no_prediction_and_a_warning_names_it(tmp_path):
    from shardline.trainer.serving import kept_notes

    predictor = small_text_predictor(tmp_path)
    rows = pl.DataFrame({"body": ["the quick brown", None, "a lazy", ""]})
    with kept_notes() as said:  # what predict warns of its input
        out = predictor.predict_frame(rows, params={"max_tokens": 3})
    # one file of a batch with a blank row is predicted, not refused: each row with text as it is alone, under its
    # own row number; the others named in a warning (training refused or left out such rows: data.on_bad_rows)
    assert out["row"].to_list() == [0, 2]
    alone = predictor.predict_frame(rows[[0, 2]], params={"max_tokens": 3})
    assert out.drop("row").equals(alone.drop("row"))
    assert said == [
        "column 'body' has 2 null or empty text(s) (row(s) [1, 3]): those rows have no prediction (the "
        "model was trained on none); 2 of 4 predicted"
    ], said
    with pytest.raises(DataError, match=r"column 'body' has 2 null or empty text\(s\) \(row\(s\) \[0, 1\]\): give"):
        predictor.predict_frame(pl.DataFrame({"body": ["", None]}, schema={"body": pl.String}))


def crlf_model_files(tmp_path: Path) -> tuple[Manifest, str, dict[str, str]]:
    """Text encoded with a tokenizer file whose lines end in CRLF (a tokenizer.json checked out on Windows), and
    a model's files as registration bundles them (weights, bundle.json, the tokenizer beside its shards)."""
    import json

    from shardline.core.config import ModelConfig
    from shardline.tasks.register import text_artifacts
    from shardline.trainer.models import model_from_spec, model_spec_for
    from shardline.trainer.serving import bundle_dict

    write(tmp_path, pl.DataFrame({"body": sentences(60, 7)}))
    crlf = json.dumps(json.loads(train_bpe(sentences(60, 7), 300)), indent=1).replace("\n", "\r\n")
    (tmp_path / "t.json").write_bytes(crlf.encode())
    manifest, uri = encode(tmp_path, text_config(tmp_path, tokenizer={"file": str(tmp_path / "t.json")}))
    assert manifest.encoding.text.tokenizer_sha256 == hashlib.sha256(crlf.encode()).hexdigest()
    torch.manual_seed(0)
    spec = model_spec_for(ModelConfig(family="transformer", hidden=16, layers=1, heads=2), data_spec(manifest.encoding))
    model = model_from_spec(spec)
    folder = tmp_path / "bundle"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "weights.pt")
    (folder / "bundle.json").write_text(json.dumps(bundle_dict(manifest.encoding, spec)))
    files = {"weights": str(folder / "weights.pt"), "bundle": str(folder / "bundle.json")}
    return manifest, uri, files | text_artifacts(manifest, uri, folder)


def test_a_model_of_a_tokenizer_file_with_crlf_line_ends_serves_from_its_bundle(tmp_path):
    from shardline.trainer.serving import Predictor

    manifest, uri, files = crlf_model_files(tmp_path)
    predictor = Predictor.from_files(files["bundle"], files["weights"], files["tokenizer"])
    assert predictor.tokenizer == Path(uri).with_name("tokenizer.json").read_bytes().decode()  # CRLF kept
    out = predictor.predict_frame(pl.DataFrame({"body": ["the quick brown", "a lazy"]}), params={"max_tokens": 2})
    assert out.height == 2


def test_a_fine_tune_of_a_registered_model_of_a_crlf_tokenizer_file_takes_its_tokenizer(tmp_path):
    import mlflow

    from shardline.core.tracking.tracker import fluent_tracking_uri
    from shardline.runs.model_code import PYFUNC_CODE
    from shardline.runs.parent import resolve_parent, with_parent_tokenizer

    manifest, uri, files = crlf_model_files(tmp_path)
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    with fluent_tracking_uri(tracking):
        mlflow.set_experiment("lm")
        with mlflow.start_run():
            mlflow.pyfunc.log_model(name="model", python_model=str(PYFUNC_CODE), artifacts=files)
            mlflow.register_model(f"runs:/{mlflow.active_run().info.run_id}/model", "lm")
    raw = text_config(tmp_path, target={"column": "title", "task": "generation"})
    del raw["data"]["tokenizer"]  # the parent's is used
    config = validate_config(
        {**raw, "training": {"init_from": "models:/lm/1"}, "mlflow": {"tracking_uri": tracking, "experiment": "lm"}}
    )
    data = with_parent_tokenizer(config, resolve_parent(config), manifest.encoding, log=lambda _: None)
    assert data.tokenizer.sha256 == manifest.encoding.text.tokenizer_sha256
    assert Path(data.tokenizer.file).read_bytes() == (tmp_path / "t.json").read_bytes()  # CRLF kept


def test_a_text_fine_tune_whose_tokenizer_file_is_missing_is_refused_naming_it_before_any_work(tmp_path):
    from shardline.core.manifest import EncodingSpec, TextSpec
    from shardline.runs.parent import with_parent_tokenizer

    lm = EncodingSpec(
        sequence_key=None, order_by=None, window=8, horizon=1, continuous=[], boolean=[], categorical=[],
        text=TextSpec(columns=["doc"], vocab_size=300, tokenizer_sha256="a" * 64, tokenizer={"kind": "bpe"}),
    )  # fmt: skip
    missing = tmp_path / "parent-tokenizer.json"  # a typo, or a file not copied here
    config = validate_config(
        {**text_config(tmp_path, tokenizer={"file": str(missing)}), "training": {"init_from": "models:/lm/1"}}
    )
    with pytest.raises(DataError, match=rf"data.tokenizer.file '{missing}' does not exist"):
        with_parent_tokenizer(config, Parent(uri="models:/lm/1"), lm)
    assert not (Path(config.storage.root) / "tokenizers").exists()


def all_streams(manifest: Manifest, uri: str, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`streams` over every shard of the split."""
    out = {}
    folder = uri.rsplit("/", 1)[0]
    view = open_split(manifest, uri, split)
    for s, info in enumerate(manifest.shards_of(split)):
        arrays = view.view(s).arrays
        keys = pl.read_parquet(io.BytesIO(storage.read_bytes(storage.resolve(folder, info.keys_path))))["sequence"]
        offsets = np.asarray(arrays["offsets"])
        for i, key in enumerate(keys.to_list()):
            out[key] = (
                np.asarray(arrays["cat"][offsets[i] : offsets[i + 1], 0]).tolist(),
                np.asarray(arrays["target"][offsets[i] : offsets[i + 1]]).tolist(),
            )
    return out


def test_a_large_text_file_is_encoded_in_parts_of_its_rows(tmp_path):
    """A corpus as one large parquet file (a dataset hub's shard: 300-500 MB) was one group, ~26x its bytes at once.
    Where each row is a document, the file is cut into parts by ranges of its rows, which keep their place in the
    file: the same tokenizer, each document in the same split with the same name and tokens, as the file whole; the
    rows left out (`data.on_bad_rows: skip`) add up over the parts."""
    from shardline.core.encoding.write import file_groups
    from shardline.core.manifest import FilePart

    bodies = sentences(3000, 5)
    bodies[10], bodies[2500] = "", None
    write(tmp_path, pl.DataFrame({"body": bodies}, schema={"body": pl.String}))
    big = tmp_path / "raw" / "a.parquet"
    pl.read_parquet(big).write_parquet(big, row_group_size=250)
    size = big.stat().st_size
    got = {}
    for name, group_mb in (("whole", 10 * size / 1e6), ("parts", size / 5 / 1e6)):
        raw = text_config(tmp_path, on_bad_rows="skip", group_mb=group_mb)
        data = validate_config(raw).data
        groups = file_groups(snapshot_source(data), data)
        manifest, uri = encode(tmp_path, raw, name)
        records = [
            EncodedGroup.model_validate_json(p.read_text()) for p in (tmp_path / name).glob("groups/*/group.json")
        ]
        skipped = log_skipped_rows(records, SimpleNamespace(warning=lambda *_: None))
        got[name] = (groups, manifest, uri, skipped)
    (whole, a, uri_a, skipped_a), (parts, b, uri_b, skipped_b) = got["whole"], got["parts"]
    assert len(whole) == 1 and [(g[0].part, g[0].parts) for g in parts] == [(j, 5) for j in range(5)]
    assert all(isinstance(g[0], FilePart) for g in parts)
    assert tokenizer_of(uri_a) == tokenizer_of(uri_b)
    assert a.rows == b.rows and a.windows == b.windows and len(b.shards) > len(a.shards)
    assert skipped_a == skipped_b == {str(big): {"body": 2}}
    for split in ("train", "validation", "test"):
        sa, sb = all_streams(a, uri_a, split), all_streams(b, uri_b, split)
        assert sa == sb and len(sa) > 100, split


def test_a_tokenizer_file_that_reads_the_special_strings_as_its_ids_or_cannot_read_a_text_is_said(tmp_path):
    """A vocabulary holding `<pad>`, `<sep>`, `<eos>` as words (split on whitespace) read a text holding them as the
    special ids, which the docs say is never done: refused naming the file. One without an unknown token stopped the
    encode on a character it lacked with the library's bare error: said naming the column and the text."""
    from tokenizers import pre_tokenizers

    write(tmp_path, pl.DataFrame({"body": ["a cat sat", "the <eos> of it", "dog 🐱"]}))
    vocab = {"<pad>": 0, "<sep>": 1, "<eos>": 2, "[UNK]": 3, **{w: 4 + i for i, w in enumerate(["a", "cat", "sat"])}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "words.json").write_text(words.to_str())
    with pytest.raises(DataError) as e:
        encode(tmp_path, text_config(tmp_path, tokenizer={"file": str(tmp_path / "words.json")}), out="words")
    said = str(e.value)
    assert f"data.tokenizer.file '{tmp_path / 'words.json'}'" in said
    assert "tokenizes to the special id(s) <pad>=[0], <sep>=[1], <eos>=[2]" in said and "added special tokens" in said

    no_unknown = Tokenizer(models.WordLevel({"<pad>": 0, "<sep>": 1, "<eos>": 2, "a": 3, "cat": 4, "sat": 5}))
    no_unknown.pre_tokenizer = pre_tokenizers.Whitespace()  # `<eos>` is three pieces: no word of its own
    (tmp_path / "closed.json").write_text(no_unknown.to_str())
    with pytest.raises(DataError, match=r"cannot tokenize body's text 'the <eos> of it' \(.*\): a tokenizer without"):
        encode(tmp_path, text_config(tmp_path, tokenizer={"file": str(tmp_path / "closed.json")}), out="closed")


def test_a_text_column_of_bytes_that_are_not_utf8_is_said_so_naming_the_file(tmp_path):
    """A string column holding bytes that are not UTF-8 (written by a tool that does not check): said as such, naming
    the file and the column, before any work (it read as 'the registered model could not take column(s)')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.tasks.ingest import check_registrable, snapshot_source

    (tmp_path / "raw").mkdir()
    body = pa.array([t.encode() for t in sentences(30, 3)] + [b"bad \xff\xfe text"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"body": body}), tmp_path / "raw" / "a.parquet")
    data = validate_config(text_config(tmp_path)).data
    with pytest.raises(DataError, match=r"a\.parquet: column\(s\) \['body'\] hold bytes that are not UTF-8 text"):
        check_registrable(data, snapshot_source(data))
