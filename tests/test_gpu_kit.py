"""The GPU kit (scripts/gpu-kit, scripts/gpu-kit-run) off the GPU: a lent GPU machine is rare and its calls are
short, so everything in the kit that does not need CUDA must already have run here.

- what the kit resolves for the GPU machine (no torch, no S3 stack, all of Shardline's own needs);
- its packing: real wheels unpacked for Python 3.12 into one .tar.xz cut into parts, and gpu-kit-run's unpacking
  of them (an incomplete or damaged kit refused, naming the part);
- gpu-kit-run's whole loop on the CPU (DEVICE=cpu QUICK=1 --no-install): the demo, launch-bound,
  gpt and an example's rows each PASS (rehearse, kill-and-resume and the real examples ran on the GPU; their
  commands are tested elsewhere; the examples step runs here on an example that trains nothing), the table and
  the logs copied out, a second call keeping the first's rows.
"""

from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import api_env

ROOT = Path(__file__).resolve().parents[1]


def load_kit():
    loader = importlib.machinery.SourceFileLoader("gpu_kit", str(ROOT / "scripts" / "gpu-kit"))
    spec = importlib.util.spec_from_loader("gpu_kit", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A real (tiny, pure-Python) wheel, as a build backend writes it."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    entries = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{k},,\n" for k in entries) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in {**entries, f"{info}/RECORD": record}.items():
            z.writestr(k, v)
    return path


def run_kit(*args: str, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-kit-run"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows(results: Path) -> dict[str, tuple[str, str]]:
    with results.open() as f:
        return {r[0]: (r[1], r[2]) for r in csv.reader(f, delimiter="\t")}


def test_the_kit_leaves_out_what_the_gpu_machine_has_and_fetches_all_shardline_needs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-kit"), "--dry-run"], capture_output=True, text=True, check=True
    ).stdout
    names = {p.split("==")[0] for p in out.splitlines()[1].split()}
    assert {"prefect", "mlflow", "polars", "pydantic", "pyyaml", "sqlalchemy", "alembic"} <= names
    assert not names & {"torch", "numpy", "pandas", "pyarrow", "fsspec", "scipy", "matplotlib", "triton"}
    assert not names & {"tokenizers", "torchmetrics", "lightning-utilities"}, "the GPU machine's image has them"
    assert not names & {"s3fs", "botocore"}, "the GPU machine reaches no S3: --with-s3 fetches them"
    assert not [n for n in names if n.startswith("nvidia-")]


def test_packed_parts_unpack_there_and_an_incomplete_or_damaged_kit_is_refused(tmp_path):
    kit = load_kit()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # random text, so that the .tar.xz is cut into 3 parts of at most 40 KiB
    blob = os.urandom(100_000).hex()  # 4 bits of entropy a character: ~100 KB once compressed
    made = [
        wheel(wheels, "kit_probe_a", "1.0", {"kit_probe_a/__init__.py": "VALUE = 'a'\n", "kit_probe_a/blob.txt": blob}),
        wheel(wheels, "kit_probe_b", "2.0", {"kit_probe_b/__init__.py": "VALUE = 'b'\n"}),
    ]
    out = tmp_path / "kit"
    chunks = kit.pack(made, out, 40 * 1024, ["kit_probe_a==1.0", "kit_probe_b==2.0"])
    assert [c.parent.name for c in chunks] == ["part-1", "part-2", "part-3"]
    assert all(c.stat().st_size <= 40 * 1024 for c in chunks)
    whole = b"".join(c.read_bytes() for c in chunks)
    with tarfile.open(fileobj=io.BytesIO(whole), mode="r:xz") as tar:
        names = tar.getnames()
    assert "./kit_probe_a/blob.txt" in names and "./kit_probe_b-2.0.dist-info/METADATA" in names
    assert not [n for n in names if n.startswith("./bin")]

    site = tmp_path / "site"
    env = {"SHARDLINE_GPU_KIT": str(out), "SHARDLINE_GPU_SITE": str(site), "SHARDLINE_GPU_WORK": str(tmp_path / "w")}
    # part-2 not carried yet
    part2 = chunks[1].read_bytes()
    chunks[1].unlink()
    done = run_kit("--install-only", env=env)
    assert done.returncode == 2 and "site.tar.xz.2 (not here)" in done.stderr and "of 3 part(s)" in done.stderr
    # part-2 cut short in transfer
    chunks[1].write_bytes(part2[:-10])
    done = run_kit("--install-only", env=env)
    assert done.returncode == 2 and "site.tar.xz.2 (damaged: carry it again)" in done.stderr
    assert not site.exists(), "nothing unpacked from an incomplete kit"

    chunks[1].write_bytes(part2)
    done = run_kit("--install-only", env=env)
    assert done.returncode == 0, done.stderr
    assert "unpacked" in done.stdout and "install: PASS" in done.stdout
    probe = subprocess.run(
        [sys.executable, "-c", "import kit_probe_a, kit_probe_b; print(kit_probe_a.VALUE + kit_probe_b.VALUE)"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "ab", probe.stderr
    # the next call (the machine still warm) does not unpack it again
    again = run_kit("--install-only", env=env)
    assert again.returncode == 0 and "already unpacked" in again.stdout


@pytest.mark.e2e
def test_gpu_kit_run_whole_loop_on_the_cpu(tmp_path, prefect_api):
    work, out = tmp_path / "work", tmp_path / "out"
    env = {
        # the session's Prefect API: on the GPU machine each command starts a temporary one (the demo's, as
        # test_packaging runs it), here that would be ~5 s of CPU a command
        "PREFECT_API_URL": api_env()["PREFECT_API_URL"],
        "DEVICE": "cpu",
        "QUICK": "1",
        "SHARDLINE_GPU_WORK": str(work),
        "SHARDLINE_GPU_OUT": str(out),
        "SHARDLINE_CACHE": str(tmp_path / "cache"),
    }
    # not `team`, `rehearse` nor `kill`: they ran on the GPU (2026-11-25, 27), and what they run is tested in test_cli,
    # test_remote_e2e and test_crash_e2e; here they added 1-3 minutes to CI (over its 25)
    first = run_kit("--no-install", "demo", env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    table = rows(out / "results.tsv")
    assert table["install"][0] == "PASS" and "prefect 3." in table["install"][1]
    assert table["cuda"][0] == "SKIP"
    assert table["demo"][0] == "PASS" and "steps/s" in table["demo"][1] and "data wait" in table["demo"][1]
    # the demo's config for `team`, `rehearse` and `kill` (they ran on the GPU; team-loop ran here on 2026-11-27)
    assert yaml.safe_load((work / "gpu.yaml").read_text())["training"]["device"] == "cpu"

    # the next call: the steps that need the demo's data, which the first call left in SHARDLINE_GPU_WORK, and the
    # `examples` step on an example that trains nothing (each real example ran on the GPU on 2026-11-25 and runs
    # from its README in test_examples; one here added half a minute to CI, over its 20): its README's first bash
    # block run as written, with `python` and `shardline` on PATH, and each training's result.json read back
    example = tmp_path / "tiny_example"
    example.mkdir()
    result = "{'device': 'cpu', 'precision': 'fp32'}"
    (example / "README.md").write_text(
        "# A tiny example\n\n```bash\n# a comment line is not a command\nshardline --help > /dev/null\n"
        "python -c \"import json, pathlib; p = pathlib.Path('store/runs/a'); p.mkdir(parents=True); "
        f"(p / 'result.json').write_text(json.dumps({result}))\"\n```\n\n```bash\nexit 1\n```\n"
    )
    second = run_kit("--no-install", "launch", "gpt", "examples", env={**env, "SHARDLINE_GPU_EXAMPLES": str(example)})
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    table = rows(out / "results.tsv")
    assert table["demo"][0] == "PASS", "the first call's rows are kept"
    assert table["launch-bound"][0] == "PASS" and "eager" in table["launch-bound"][1]
    assert "preempted yes" in table["launch-bound"][1]
    # with deterministic kernels (on the CPU with either setting) the resume and a second run are bit-identical
    assert "training.deterministic true: preempted yes" in table["launch-bound"][1]
    assert "largest weight difference resumed 0 (run to run 0)" in table["launch-bound"][1]
    assert table["gpt-quick"][0] == "PASS" and "shardline fit" in table["gpt-quick"][1]
    assert table["example-tiny_example"][0] == "PASS", table["example-tiny_example"]
    assert "2 command(s); 1 training(s) on cpu fp32" in table["example-tiny_example"][1]
    with tarfile.open(out / "logs.tgz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {"demo.log", "launch.log", "launch.json", "gpt-quick.md", "example-tiny_example.log"} <= logs
    assert "launch-bound" in second.stdout and "demo" in second.stdout  # the table of both calls

    bad = run_kit("--no-install", "train", env=env)
    assert bad.returncode == 2 and "unknown step 'train'" in bad.stderr
