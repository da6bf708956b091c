"""The terminal's progress bar: drawn for a run whose stderr is a terminal, absent from a pipe or a log."""

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# a real, tiny training (two epochs of the trainer tests' shards) with the bar `training_run` uses
CHILD = """
import sys, tempfile, time
from pathlib import Path
from tests.test_trainer import K, H, make_arrays, write_shard, spec_for, train_cfg
from shardline.trainer.data import SplitData
from shardline.trainer.loop import Callbacks, FitOptions, fit
from shardline.trainer.progress import TerminalProgress

scratch = tempfile.TemporaryDirectory()  # removed when the child exits
folder = Path(scratch.name)
train = SplitData([write_shard(folder, "t.bin", make_arrays(0, [300, 250]))], K, H)
val = SplitData([write_shard(folder, "v.bin", make_arrays(7, [120]))], K, H)
bar = TerminalProgress()
slow = lambda step, resumed: time.sleep(0.01)  # a run long enough to redraw the bar
fit(train, val, spec_for(), train_cfg(), "classification", str(folder / "ckpt"),
    Callbacks(log=lambda m: None, on_progress=bar.show, after_step=slow), FitOptions(progress_seconds=0))
bar.close()
print("bar on" if bar.on else "bar off", "trained", flush=True)
"""


def run(with_terminal: bool) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    cmd = [sys.executable, "-c", CHILD]
    if not with_terminal:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout + out.stderr
    main, child = pty.openpty()  # the child's stdout and stderr are a terminal
    proc = subprocess.Popen(cmd, stdin=child, stdout=child, stderr=child, env=env, cwd=REPO, close_fds=True)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_the_bar_is_drawn_on_a_terminal_and_nowhere_else():
    drawn = run(with_terminal=True)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)  # the colours and cursor moves left out
    assert "bar on trained" in shown
    # epochs, steps, windows/s and the time left: redrawn while it trained, the last state at the end
    bars = re.findall(r"train epoch (\d)/2 .*? (\d+)/(\d+) steps · ([\d,]+) windows/s · ETA (\S+)", shown)
    assert len({b[1] for b in bars}) >= 3, shown[-2000:]
    epoch, done, total, _, eta = bars[-1]
    assert (epoch, eta) == ("2", "0:00") and int(done) == int(total) > 0

    piped = run(with_terminal=False)
    assert "bar off trained" in piped
    assert "train epoch" not in piped and "windows/s" not in piped and "\x1b[" not in piped
