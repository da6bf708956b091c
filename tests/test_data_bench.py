"""Smoke test of the data-path benchmark (benchmarks/data_bench.py --quick): it runs and prints its tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", cell)]


def test_data_bench_quick_prints_the_tables():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_bench.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]

    def row(prefix: str) -> list[str]:
        found = [cells for name, cells in rows.items() if name.startswith(prefix)]
        assert found, f"no row '{prefix}...' in:\n{out.stdout}"
        return found[0]

    for prefix in ("floor: polars", "encode: raw parquet"):
        seconds, fps, mbs, _ratio = row(prefix)
        assert all(_numbers(c)[0] > 0 for c in (seconds, fps, mbs)), (prefix, seconds, fps, mbs)
    for prefix in ("(a) naive", "(b) materialised", "Shardline `WindowLoader`"):
        w0, w2, mbs, disk = row(prefix)[:4]
        assert _numbers(w0)[0] > 0 and _numbers(w2)[0] > 0 and _numbers(mbs)[0] > 0 and _numbers(disk)[0] > 0, (
            prefix,
            w0,
            w2,
            mbs,
            disk,
        )
    peaks = [cells for name, cells in rows.items() if name.isdigit()]
    assert len(peaks) == 2 and all(_numbers(c[4])[0] > 0 for c in peaks), peaks  # peak RSS at two scales
    verdicts = [
        cells[-1].strip("*") for name, cells in rows.items() if cells and cells[-1].strip("*") in ("PASS", "FAIL")
    ]
    assert len(verdicts) >= 7, out.stdout
    assert re.search(r"memcpy bandwidth .*: [\d.]+ GB/s", out.stdout)
    # the encode's CPU against the floor's: the least the encode's time can be, said with the figures
    work = re.search(r"The encode does ([\d.]+)x the floor's work", out.stdout)
    assert work and float(work.group(1)) > 0, out.stdout


def test_encode_ab_quick_compares_this_tree_with_a_commit():
    """benchmarks/encode_ab.py against HEAD: both sides' encodes run (each in its own tree) and are
    timed against the same polars floor; the temporary worktree is gone afterwards."""

    def worktrees() -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True
        ).stdout

    before = worktrees()
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "encode_ab.py"), "HEAD", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:]
        for line in out.stdout.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert set(rows) == {"side", "this tree", "HEAD"}, out.stdout
    for side in ("this tree", "HEAD"):
        ratio, median, seconds = (_numbers(c) for c in rows[side][:3])
        # an encode reads the very files the floor reads, and then codes and writes them
        assert ratio[0] > 1 and median[0] > 1 and seconds[0] > 0, (side, rows[side])
    assert "this tree's encode takes" in out.stdout
    assert worktrees() == before
