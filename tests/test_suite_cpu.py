"""benchmarks/suite_cpu.py: the sampler finds a process the suite started, its CPU and the test it started under, and
names kinds of process by their command lines."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "suite_cpu", Path(__file__).resolve().parents[1] / "benchmarks" / "suite_cpu.py"
)
suite_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_cpu)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def test_a_busy_child_is_found_with_its_cpu_and_its_test_and_an_unmarked_one_is_not_ours():
    # alive well after its loop: a sampler starved on a loaded machine still reads it before it exits
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(1.5)"
    marked = {**os.environ, "SHARDLINE_SUITE_CPU": "1", "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
    unmarked = {k: v for k, v in os.environ.items() if k != "SHARDLINE_SUITE_CPU"}
    seen: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=suite_cpu.sample, args=(seen, stop), daemon=True)
    sampler.start()
    # each child waits between its fork and its exec, when it still has the test's own command and environment:
    # a sampler that saw it then marked it as not the suite's (flaky on a loaded machine)
    children = [
        subprocess.Popen([sys.executable, "-c", busy], env=env, preexec_fn=lambda: time.sleep(0.5))
        for env in (marked, unmarked)
    ]
    for child in children:
        child.wait(timeout=60)
    time.sleep(0.3)
    stop.set()
    sampler.join()
    found = {pid: p for (pid, _), p in seen.items() if int(pid) in {c.pid for c in children}}
    ours, other = found[str(children[0].pid)], found[str(children[1].pid)]
    assert ours["ours"] and not other["ours"]
    assert ours["test"] == "tests/test_x.py::test_y"
    assert ours["cpu"] >= 0.4, ours  # its busy loop, read from /proc before it exited
    assert ours["cmd"].startswith(sys.executable) and "process_time" in ours["cmd"]


def test_kinds_of_process_by_their_command_lines():
    py = "/venv/bin/python"
    assert suite_cpu.kind(f"{py} /venv/bin/shardline run /tmp/c.yaml") == "shardline run"
    assert suite_cpu.kind(f"{py} -m uvicorn --app-dir x --factory prefect.server.api.server:create_app").startswith(
        "Prefect's temporary API"
    )
    assert suite_cpu.kind(f"{py} -u -c import sys;exec(eval(sys.stdin.readline()))").startswith("pytest-xdist")
    assert suite_cpu.kind(f"{py} -B -c from multiprocessing.forkserver import main; main(1)").startswith(
        "multiprocessing"
    )
    assert suite_cpu.kind(f"{py} -m shardline.trainer.torchrun a.json") == "python -m shardline.trainer.torchrun"
    assert suite_cpu.kind("/usr/bin/git status") == "git"
    assert suite_cpu.kind("") == "(kernel or unnamed)"
