"""Where the test suite's CPU goes (issue #41: CI at 20 minutes or less): every process the tests start, by kind and
by the test that started it.

    .venv/bin/python benchmarks/suite_cpu.py                       # the whole suite, as ./scripts/test runs it
    .venv/bin/python benchmarks/suite_cpu.py tests/test_sweep.py   # any pytest arguments

On two cores the suite is CPU-bound (pytest-xdist's workers keep both busy), so CI's time is the CPU of the
processes the tests start: Prefect servers, `shardline` commands, flow runs, torchrun's ranks, the pytest workers
themselves. Durations (`--durations`) cannot say which: a test's wall time includes waiting while other workers run.
It samples the processes every 0.25 s (psutil), keeps each one's last CPU time (user + system), its command line and
the test that was running when it started (`PYTEST_CURRENT_TEST`, inherited from the test's process), and prints
two tables when the suite ends: the processes whose environment carries the suite's mark (what else ran on the
machine meanwhile is one figure beside them). A process that lives under 0.25 s may be missed; its CPU is small.
The sampler's own CPU (a few % of a core) is not counted. Run it on an otherwise quiet machine.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


MARK = "SHARDLINE_SUITE_CPU"  # set in the suite's environment, so in every process it starts that keeps its environment


def sample(seen: dict, stop: threading.Event) -> None:
    """Until `stop`: each process's (pid, start time) -> {cpu, cmd, test, ours}, its CPU updated at every pass
    (`ours`: started by the suite; a test that gives a command an environment of its own, test_packaging's, loses
    the mark, and its processes count with the machine's others)."""
    import psutil

    me = os.getpid()
    while not stop.is_set():
        for proc in psutil.process_iter():
            try:
                if proc.pid == me:
                    continue
                key = (str(proc.pid), proc.create_time())
                times = proc.cpu_times()
                cpu = times.user + times.system
                cmd = " ".join(proc.cmdline())
                # (an empty command line: read in its exec, or gone and not yet waited for: read again)
                if key in seen and ((seen[key]["ours"] and seen[key]["cmd"]) or seen[key]["cmd"] == cmd):
                    seen[key]["cpu"] = cpu
                    continue
                # first seen; or seen between its fork and its exec, with its parent's command and environment
                env = proc.environ()
                test = env.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
                seen[key] = {"cpu": cpu, "cmd": cmd, "test": test, "ours": MARK in env}
            except psutil.Error:
                continue  # gone meanwhile, or not ours to read
        stop.wait(0.25)


def kind(cmd: str) -> str:
    """A process's kind, from its command line: the program, or python's module or script."""
    words = cmd.split()
    if not words:
        return "(kernel or unnamed)"
    program, rest = words[0].rsplit("/", 1)[-1], words[1:]
    if "python" not in program:
        return program
    if rest[:1] == ["-m"] and len(rest) > 1:
        return {"uvicorn": "Prefect's temporary API (uvicorn)"}.get(rest[1], f"python -m {rest[1]}")
    if rest[:1] in (["-c"], ["-u"], ["-B"]):
        if "forkserver" in cmd or "spawn_main" in cmd:
            return "multiprocessing children (sweep trials, Dask)"
        xdist = "execnet" in cmd or "exec(eval" in cmd  # how pytest-xdist starts its workers
        return "pytest-xdist workers (the tests' own process)" if xdist else "python -c"
    script = rest[0].rsplit("/", 1)[-1] if rest else ""
    if script in ("shardline", "prefect", "mlflow") and len(rest) > 1:
        return f"{script} {rest[1]}"
    return f"python {script}"


def table(title: str, cpu: collections.Counter, count: collections.Counter, top: int) -> str:
    total = sum(cpu.values()) or 1
    lines = [f"\n| {title} | processes | CPU-s | share | CPU-s each |", "|---|---:|---:|---:|---:|"]
    for name, s in cpu.most_common(top):
        lines.append(f"| {name} | {count[name]} | {s:,.0f} | {s / total:.1%} | {s / count[name]:.1f} |")
    return "\n".join(lines)


def main(args: list[str]) -> int:
    seen: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(seen, stop), daemon=True)
    sampler.start()
    start = time.monotonic()
    env = {**os.environ, MARK: "1"}
    code = subprocess.call([str(ROOT / "scripts" / "test"), *args], cwd=ROOT, env=env)
    stop.set()
    sampler.join()
    by_kind, n_kind, by_test, n_test = (collections.Counter() for _ in range(4))
    others = sum(p["cpu"] for p in seen.values() if not p["ours"])
    for p in (p for p in seen.values() if p["ours"]):
        k = kind(p["cmd"])
        by_kind[k] += p["cpu"]
        n_kind[k] += 1
        test = p["test"].split("::")[0] or "(no test: the session's servers, pytest)"
        by_test[test] += p["cpu"]
        n_test[test] += 1
    wall, cpu = time.monotonic() - start, sum(by_kind.values())
    print(f"\nthe suite: exit {code}, {wall:,.0f} s wall, {cpu:,.0f} CPU-s sampled (other processes: {others:,.0f})")
    print(table("kind of process", by_kind, n_kind, 25))
    print(table("started during", by_test, n_test, 25))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
