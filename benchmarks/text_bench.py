"""Encode throughput of text data: text MB/s of Shardline's encode step (raw parquet -> token shards and
manifest, `encode_dataset`) against the `tokenizers` library's own batch encode of the same texts, in the same
run, on the same tokenizer; and where the rest of the encode's time goes.

    PYTHONPATH=. .venv/bin/python benchmarks/text_bench.py [--mb 24] [--vocab 8192] [--repeats 3]

The corpus is made on the spot from the standard library's own source files (text every Python installation
holds: nothing is downloaded), cut into paragraphs, one row each, in 4 parquet files. The tokenizer is a
byte-level BPE trained once on it (its training time is printed apart) and given to the encode as a file
(`data.tokenizer.file`), so both sides tokenize with the same one. Prints a table; the ratio is the target
(>= 0.7x of `encode_batch`).
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from shardline.core.config import validate_config
from shardline.core.encoding.splits import split_rows
from shardline.core.encoding.text import _ids, encode_text_splits, token_dtype, tokenizer, train_bpe
from shardline.core.encoding.write import file_groups, read_text_group
from shardline.tasks.encode import encode_dataset
from shardline.tasks.ingest import snapshot_source


def corpus(mb: float) -> list[str]:
    """Paragraphs of the standard library's source, up to `mb` MB of UTF-8 text."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for para in text.split("\n\n"):
            para = para.strip()
            if para:
                out.append(para)
                size += len(para.encode())
                if size >= mb * 1e6:
                    return out
    return out


def rounds(fns: dict, repeats: int) -> dict[str, float]:
    """The best time of each of `fns`, measured in interleaved rounds (a busy shared machine slows each
    side alike, rather than whichever ran last)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=24.0, help="MB of text in the corpus")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    texts = corpus(args.mb)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    with tempfile.TemporaryDirectory(prefix="shardline-text-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "raw").mkdir()
        edges = np.linspace(0, len(texts), 5).astype(int)
        for i in range(4):
            pl.DataFrame({"body": texts[edges[i] : edges[i + 1]]}).write_parquet(tmp / "raw" / f"part-{i}.parquet")
        t0 = time.perf_counter()
        tok_json = train_bpe(texts, args.vocab)
        train_s = time.perf_counter() - t0
        (tmp / "tokenizer.json").write_text(tok_json)
        tok = tokenizer(tok_json)

        config = validate_config(
            {
                "data": {
                    "source": str(tmp / "raw" / "*.parquet"),
                    "features": {"text": ["body"]},
                    "tokenizer": {"file": str(tmp / "tokenizer.json")},
                    "window": 256,
                },
                "model": {"family": "transformer"},
            }
        )
        data = config.data
        snapshot = snapshot_source(data)
        n_tokens = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))

        # the library alone, on the texts already in memory; Shardline's whole encode step (read parquet, split,
        # tokenize, lay out streams, compress, write shards, manifest; a new folder each time); and its parts, one
        # file group after another (the encode runs its groups in parallel, `data.encode_workers`)
        groups = file_groups(snapshot, data)
        read = [split_rows(read_text_group(g, data)[0], data) for g in groups]
        runs = iter(range(1000))
        column = pl.Series(texts)  # as the encode step holds it
        t = rounds(
            {
                "lib": lambda: tok.encode_batch(texts, add_special_tokens=False),
                "fast": lambda: tok.encode_batch_fast(texts, add_special_tokens=False),
                "ids": lambda: _ids(tok, column, token_dtype(args.vocab)),  # + the ids out of Python lists
                "encode": lambda: encode_dataset(snapshot, data, str(tmp / f"ds{next(runs)}")),
                "read": lambda: [split_rows(read_text_group(g, data)[0], data) for g in groups],
                "streams": lambda: [encode_text_splits(f, s, data, tok_json) for f, s in read],
            },
            args.repeats,
        )
        lib_s, fast_s, ids_s, enc_s, read_s, streams_s = (
            t[k] for k in ("lib", "fast", "ids", "encode", "read", "streams")
        )

    rows = [
        ("tokenizers encode_batch (texts in memory): the baseline", lib_s),
        ("tokenizers encode_batch_fast (no offsets)", fast_s),
        ("  + ids into one numpy array (_ids)", ids_s),
        ("Shardline encode step (parquet -> shards + manifest)", enc_s),
        (f"  its parts, {len(groups)} group(s) one by one: read parquet + split rows", read_s),
        ("  its parts, one by one: token streams + targets", streams_s),
    ]
    print(f"\ncorpus: {len(texts):,} rows, {mb:.1f} MB of text, {n_tokens:,} tokens (vocab {args.vocab}); ", end="")
    print(f"BPE training (train split, once): {train_s:.1f} s\n")
    print(f"| {'step':<62} | {'seconds':>8} | {'text MB/s':>9} | {'vs encode_batch':>15} |")
    print(f"|{'-' * 64}|{'-' * 10}:|{'-' * 11}:|{'-' * 17}:|")
    for name, s in rows:
        print(f"| {name:<62} | {s:>8.2f} | {mb / s:>9.1f} | {lib_s / s:>14.2f}x |")


if __name__ == "__main__":
    main()
