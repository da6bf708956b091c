"""The full-size benchmark's code path at CI size (issue #45): a few hundred small games in a moto bucket,
`shardline run` on s3://, the bytes each step reads counted where the S3 server sends them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.tasks.ingest import FOOTER_READ

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_seed_scale_small_reads_each_raw_byte_once_and_reruns_from_the_cache(tmp_path, prefect_api):
    from prefect.settings import PREFECT_API_URL

    saved = tmp_path / "measures.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "seed_scale.py"), "--games", "200", "--frames", "200"]
    cmd += ["--parts", "floor,again", "--steps", "3", "--set", "data.files_per_group=25"]
    # the session's Prefect API: the steps' spans are read from it, by the flow runs each command links to
    cmd += ["--doc", "none", "--json", str(saved), "--prefect-api", PREFECT_API_URL.value()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(saved.read_text())
    first, again, floor = m["runs"]["first"], m["runs"]["again"], m["runs"]["floor"]
    raw = m["raw_mb"] * 1e6
    assert set(first["spans"]) >= {"ingest", "encode", "train", "evaluate", "register"}
    # ingest reads footers only (the ends of the files; and one file whole, for a sample of its rows), the encode
    # every byte once (and one file's footer again: the target's type), nothing else reads raw bytes
    ingest, encode = first["step_bytes"]["ingest"], first["step_bytes"]["encode"]
    one_file = max(m["sizes"].values())
    assert 0 < ingest[0] <= 200 * FOOTER_READ + one_file and ingest[1] <= FOOTER_READ, ingest
    assert raw <= encode[0] <= 1.1 * raw and encode[1] <= one_file, encode
    # the whole command: besides, a file whole for the ingest's row sample, for the target's type and for the
    # registered model's input example
    # besides: the ingest's footers, evaluation's one footer (its key columns' types), a file's first rows or three
    assert first["bytes"][0] <= raw + 201 * FOOTER_READ + 3 * one_file
    assert floor["bytes"][0] >= raw  # polars read every byte too
    # the same command again: every step cached, not one object byte read
    assert "ingest cached, encode cached, train cached, evaluate cached, register cached" in again["steps"]
    assert again["bytes"][0] == 0 and again["wall"] < first["wall"]
    assert first["first_step"] and first["spans"]["train"][0] <= first["first_step"] <= first["spans"]["train"][1]
    assert first["main"] > 100 and len(first["samples"]) > 10
    for line in ("bytes the encode reads from S3 / raw bytes", "cached rerun / first run (wall)"):
        assert any(line in row and ("PASS" in row or "FAIL" in row) for row in out.stdout.splitlines()), line
    assert "| peak RSS of the command, 200 games / the demo's size | not run |" in out.stdout
