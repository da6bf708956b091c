"""`training.cuda_graphs`: the whole optimizer step of full batches (forward, loss, backward, clipping, the
AdamW update) captured once as a CUDA graph and replayed, so that a small model's step is one launch instead of
hundreds of Python-issued kernels.

The step is the training loop's own step function, unchanged: the graph records exactly the kernels an eager
step launches, with the learning rate read from a device tensor (set before each step) and AdamW in its
capturable form (its step count on the device). A few eager warm-up steps come first, on a side stream, as
CUDA graph capture requires; shapes that differ from the captured one (an epoch's last, shorter batch) run
eagerly. The second warm-up step runs with torch's synchronising calls reported: a model whose forward or loss
reads a value back (`.item()`, a boolean mask's indexing) is never captured, and the note names the line (a failed
capture would leave CUDA's random number generators unusable in the process: seen on an H100 with
examples/pretrain_finetune, 2026-11-27). Any other step that cannot be captured is said once, and the run goes on
eagerly: nothing of the failed capture ran, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from shardline.trainer.data import Batch, portable

StepFn = Callable[[list[Batch]], tuple[torch.Tensor, torch.Tensor]]
TORCH_DIR = Path(torch.__file__).resolve().parent
TRAINER_DIR = Path(__file__).resolve().parent  # the step, the loss and the built-in models: captured as they are


def graphs_blocker(device: torch.device, precision: str, processes: int) -> str | None:
    """Why this run cannot capture its step (None: it can)."""
    if device.type != "cuda":
        return f"it trains on {device.type}, and CUDA graphs are a CUDA feature"
    if precision == "fp16":
        return "fp16's loss scaler reads the gradients back to skip a step on overflow; bf16 needs no scaler"
    if processes > 1:
        return "several processes train together (DDP), and their gradient all-reduce is not captured"
    return None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The step's learning rate: written into the device tensor a captured step reads, or set as a number."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def match_optimizer(optimizer: torch.optim.Optimizer, device: torch.device, graphs: bool) -> None:
    """AdamW in the form this run steps it: for a captured step, the learning rate a device tensor and the step
    count on the device (capturable); else a number, not capturable (a checkpoint of a captured run resumed
    without graphs, on another device, brings capturable groups). Called after any `load_state_dict`."""
    for group in optimizer.param_groups:
        group["capturable"] = graphs
        lr = group["lr"]
        if graphs and not (isinstance(lr, torch.Tensor) and lr.device == device):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        elif not graphs and isinstance(lr, torch.Tensor):
            group["lr"] = float(lr)
    if graphs:
        for state in optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor) and state["step"].device != device:
                state["step"] = state["step"].to(device)
        # its warm-up steps run uncaptured on purpose: the once-per-optimizer warning about that is noise here
        optimizer._warned_capturable_if_run_uncaptured = True


class GraphedStep:
    """Replays the captured step for batches of `shape` (the micro-batch sizes of a full optimizer step)."""

    WARMUP = 3  # eager steps before the capture: lazy initialisation (AdamW's state, cuBLAS) happens there
    TIMED = 3  # the replay timed against the eager steps (synchronised before and after: once a run)
    PROBED = 2  # the warm-up step whose synchronising calls are looked for (the first one initialises lazily)

    def __init__(
        self,
        step: StepFn,
        shape: tuple[int, ...],
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        device: torch.device,
        log: Callable[[str], None],
        chosen: bool = True,
    ):
        self.step, self.shape, self.optimizer, self.params = step, shape, optimizer, params
        self.device, self.log, self.chosen = device, log, chosen  # chosen: training.cuda_graphs true, not the default
        self.eager_s = math.inf  # the fastest eager warm-up step (after the first), against which a replay is timed
        self.warm = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[Batch] = []
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.grads: list[torch.Tensor | None] = []  # the graph's gradient buffers, kept alive
        self.off = False
        self.replays = 0

    def takes(self, micro: list[Batch]) -> bool:
        """Whether this step is one the graph covers (else the loop runs it eagerly)."""
        return not self.off and tuple(len(m) for m in micro) == self.shape

    def __call__(self, micro: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is not None:
            for static, batch in zip(self.static, micro):
                for dst, src in zip(
                    (static.cont, static.cat, *static.targets), (batch.cont, batch.cat, *batch.targets)
                ):
                    dst.copy_(portable(src), non_blocking=True)  # host -> device and the widening, in one copy
            timed = self.replays == self.TIMED
            if timed:  # once: what a replay gains over an eager step, said with the capture's note
                torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
            self.graph.replay()
            self.replays += 1
            if timed:
                torch.cuda.synchronize(self.device)
                self._said_gain(time.perf_counter() - t0)
            return self.out
        if self.warm < self.WARMUP:
            self.warm += 1
            t0 = time.perf_counter()
            out = self._on_side_stream(micro, probe=self.warm == self.PROBED)
            if self.warm > 1:  # the first one initialises lazily
                self.eager_s = min(self.eager_s, time.perf_counter() - t0)
            return out
        return self._capture(micro)

    def _syncs_of_users_code(self, caught: list[warnings.WarningMessage]) -> list[str]:
        """Where the probed step synchronised with the GPU from code that is neither torch's nor Shardline's trainer
        (a model's forward or loss): file:line of each, once. torch's own synchronising paths are left to the
        capture, which they may avoid while capturing."""
        places = []
        for w in caught:
            if "synchroniz" not in str(w.message):
                continue
            where = Path(w.filename).resolve()
            if TORCH_DIR in where.parents or TRAINER_DIR in where.parents or not where.is_file():
                continue
            place = f"{where.name}:{w.lineno}"
            if place not in places:
                places.append(place)
        return places

    def _said_gain(self, replay_s: float) -> None:
        gain = f"{self.eager_s / replay_s:.1f}x" if replay_s > 0 and math.isfinite(self.eager_s) else "unmeasured"
        self.log(
            f"training.cuda_graphs: a captured step took {1e3 * replay_s:.2f} ms against {1e3 * self.eager_s:.2f} ms "
            f"for an eager one ({gain})"
            + ("" if self.chosen else "; captured by default on a GPU, training.cuda_graphs: false trains eagerly")
        )

    def _on_side_stream(self, micro: list[Batch], probe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """An eager step on a side stream. `probe`: with torch's synchronising calls reported (as warnings, so the
        step itself runs as ever): a model whose forward or loss reads a value back (`.item()`, a boolean mask's
        indexing, a shape from the data) is found here and never captured. A capture that fails leaves CUDA's
        random number generators unusable in this process (torch: "Offset increment outside graph capture")."""
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        recording = warnings.catch_warnings(record=True) if probe else contextlib.nullcontext([])
        with torch.cuda.stream(side), recording as caught:  # other steps' warnings reach the user as ever
            if probe:
                warnings.simplefilter("always")
                before = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = self.step([m.to(self.device, non_blocking=True) for m in micro])
            finally:
                if probe:
                    torch.cuda.set_sync_debug_mode(before)
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)  # what the side stream allocated is now safe to free anywhere
        if probe and (places := self._syncs_of_users_code(caught)):
            self.off = True
            self.log(
                f"note: training.cuda_graphs: every step runs eagerly: the model reads a value back from the GPU at "
                f"{', '.join(places[:3])} (.item(), a boolean mask's indexing, a shape that depends on the data), "
                "which a captured step cannot do. Without it the step could be captured as one launch"
            )
        return out

    def _capture(self, micro: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        static = [m.to(self.device) for m in micro]  # the graph's own input buffers (a host batch is always copied)
        torch.cuda.synchronize(self.device)
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the gradients itself
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the loader's threads keep pinning and gathering the next batches while this thread
            # captures (the default, global, would count their CUDA calls against the capture)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.step(static)
        except RuntimeError as e:  # torch's and CUDA's errors; nothing recorded ran: the step is taken eagerly
            self.off = True
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(self.device)
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            self.log(
                f"note: training.cuda_graphs: the training step could not be captured as a CUDA graph "
                f"({type(e).__name__}: {reason}); the run goes on with eager steps (training.cuda_graphs: false "
                "skips the attempt). A model's forward or loss "
                "that reads a value back to Python (.item(), a bool of a tensor) or whose shapes depend on the "
                "data cannot be captured"
            )
            try:
                return self._on_side_stream(micro)
            except RuntimeError as again:  # a plain RuntimeError: a code error, not retried
                if "Offset increment outside graph capture" not in str(again):
                    raise
                raise RuntimeError(
                    "training.cuda_graphs: the failed capture above left CUDA's random number generator unusable in "
                    f"this process (torch: {again}); set training.cuda_graphs: false for this model, or make its "
                    "forward and loss read nothing back from the GPU"
                ) from None
        self.graph, self.static, self.out = graph, static, out
        self.grads = [p.grad for p in self.params]
        self.log(f"training.cuda_graphs: the step of {'+'.join(map(str, self.shape))} windows is captured")
        graph.replay()  # this step's batch is already in the graph's input buffers
        self.replays += 1
        return out
