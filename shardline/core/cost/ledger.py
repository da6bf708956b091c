"""What a training run has cost: `cost.json` in its run folder, one entry per attempt (a process that trained
it, until it finished, was preempted, failed, stopped at its budget or was killed), and the arithmetic of
useful and wasted GPU-hours and USD from it.

An entry's `marks` are (step, seconds) at each checkpoint it saved. Time an attempt spent on steps that a
later attempt trained again (after the checkpoint that attempt resumed from: a kill, a failure, a preemption
without a checkpoint) is wasted; the rest is useful.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardline.core import storage
from shardline.core.config import settings
from shardline.core.cost.prices import CPU, PriceTable, detect_gpu, load_prices

LEDGER_FILE = "cost.json"
LEDGER_ENV = "SHARDLINE_COST_LEDGER_SECONDS"  # how often progress between checkpoints is written (default 60)
MAX_MARKS = 64  # checkpoints remembered per attempt: a resume starts from one of the newest
INTERRUPTIONS = ("preempted", "killed")  # what a resume recovers from (a budget stop or a failure is no preemption)
PREEMPTION_KEYS = ("steps_redone", "gpu_seconds_redone", "recovery_seconds")
ESTIMATE = (
    "an estimate: GPU-hours x list prices from a table (shardline/configs/prices.yaml or SHARDLINE_PRICES), not a bill"
)


@dataclass(frozen=True)
class Pricing:
    """What one attempt's GPU-hours cost: the machine's GPU type and count, the provider, on-demand or spot,
    USD per GPU-hour (None: the table has no such price), the table's date, and how it was chosen."""

    gpu: str
    gpus: int
    provider: str | None
    spot: bool
    usd_per_gpu_hour: float | None
    as_of: str
    note: str


def choose_price(table: PriceTable, gpu: str, gpus: int, provider: str | None, spot: bool) -> Pricing:
    """The price of `gpu` at `provider` (None: the cheapest listed for it), on-demand or spot; a price the
    table lacks is None with the reason in `note` (the run is still timed)."""
    kind = "spot" if spot else "on-demand"

    def unpriced(why: str) -> Pricing:
        return Pricing(gpu, gpus, provider, spot, None, table.as_of, why)

    try:
        prices = table.of(gpu)
    except ValueError as e:
        return unpriced(str(e))
    if provider is not None:
        found = [p for p in prices if p.provider == provider]
        if not found:
            listed = ", ".join(p.provider for p in prices)
            return unpriced(f"compute.provider '{provider}' has no {gpu} price in the table (it lists {listed})")
        rate = found[0].per_hour(spot)
        if rate is None:
            return unpriced(f"{provider} lists no spot price for {gpu} (compute.spot: true)")
        note = f"{gpu} at {provider}'s {kind} price"
    else:
        priced = [(p.per_hour(spot), p.provider) for p in prices if p.per_hour(spot) is not None]
        if not priced:
            return unpriced(f"no provider in the table lists a {kind} price for {gpu}")
        rate, provider = min(priced)
        note = f"compute.provider unset: {gpu} at the cheapest {kind} price listed, {provider}'s"
    return Pricing(gpu, gpus, provider, spot, rate, table.as_of, note)


def machine_pricing(provider: str | None, spot: bool, machines: int) -> Pricing:
    """This machine's pricing: its GPU type (`detect_gpu`: SHARDLINE_GPU_TYPE, torch, nvidia-smi, else CPU), the
    GPUs visible to this process (a machine is billed for all of them, whichever the run uses; a CPU machine
    counts as one), times `machines` (a training on several: the others taken to be like this one), priced
    from the table (`SHARDLINE_PRICES` laid over the shipped one)."""
    import torch

    gpu, _how = detect_gpu()
    gpus = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    pricing = choose_price(load_prices(), gpu, gpus * machines, provider, spot)
    if machines > 1:
        note = f"{pricing.note}; {machines} machines (compute.nodes), each taken to have this one's {gpus}"
        pricing = dataclasses.replace(pricing, note=note)
    return pricing


# ---------------------------------------------------------------- the arithmetic


def _seconds_before(attempt: dict, step: int) -> float:
    """Seconds of `attempt` spent before it went past `step`: all of them when it never did, else up to its
    newest checkpoint at or below `step` (none: nothing of it stands)."""
    if step >= attempt["last_step"]:
        return float(attempt["seconds"])
    marks = [(s, t) for s, t in attempt.get("marks", []) if s <= step]
    return float(max(marks)[1]) if marks else 0.0


def _wall(attempt: dict) -> float:
    """The wall-clock time of an attempt's last record (its start, to the millisecond, plus its seconds)."""
    return dt.datetime.fromisoformat(attempt["started"]).timestamp() + attempt["seconds"]


def interruption(before: dict, after: dict) -> dict:
    """What the preemption or kill of attempt `before` cost, as `after` sees it at its first optimizer step (it
    resumed from the checkpoint at its `first_step`): the steps `before` had reached past that checkpoint, the
    time it spent on them on every GPU it was billed for (what `gpu_hours_wasted` counts of it: the steps times
    their measured seconds each), and the seconds from `before`'s last record to this first new step. That last
    record is, after a notice, its end once its checkpoint was saved (the notice came at most one step and that
    save earlier: a lower bound); after a kill, its last ledger write, at most SHARDLINE_COST_LEDGER_SECONDS
    before the kill (which no record survives: an upper bound, and the steps redone a lower bound)."""
    resumed = after["first_step"]
    return {
        "after": before["outcome"],
        "steps_redone": max(0, before["last_step"] - resumed),
        "gpu_seconds_redone": (before["seconds"] - _seconds_before(before, resumed)) * before["gpus"],
        "recovery_seconds": _wall(after) - _wall(before),
    }


def useful_seconds(attempts: list[dict]) -> list[float]:
    """Per attempt, the seconds whose steps no later attempt trained again: each attempt that resumed from
    step S makes every earlier attempt's time after S (after its checkpoint at S) wasted."""
    useful = [float(a["seconds"]) for a in attempts]
    for k in range(1, len(attempts)):
        resumed = attempts[k]["first_step"]
        for j in range(k):
            useful[j] = min(useful[j], _seconds_before(attempts[j], resumed))
    return useful


def summarize(attempts: list[dict]) -> dict | None:
    """The run's spend so far: seconds, GPU-hours and USD in all, and how much of each was wasted; the last
    attempt's GPU, provider and price; None when no attempt was recorded. An attempt without a price counts
    in the hours, not in the USD (`unpriced_attempts` says how many)."""
    if not attempts:
        return None
    useful = useful_seconds(attempts)
    gpu_h = wasted_h = usd = usd_wasted = 0.0
    unpriced = 0
    for a, kept in zip(attempts, useful):
        hours, lost = a["seconds"] * a["gpus"] / 3600, (a["seconds"] - kept) * a["gpus"] / 3600
        gpu_h, wasted_h = gpu_h + hours, wasted_h + lost
        rate = a.get("usd_per_gpu_hour")
        if rate is None:
            unpriced += 1
        else:
            usd, usd_wasted = usd + hours * rate, usd_wasted + lost * rate
    last = attempts[-1]
    all_unpriced = unpriced == len(attempts)
    cuts = [a["interruption"] for a in attempts if a.get("interruption")]
    return {
        "attempts": len(attempts),
        "seconds": sum(a["seconds"] for a in attempts),
        "gpu_hours": gpu_h,
        "gpu_hours_useful": gpu_h - wasted_h,
        "gpu_hours_wasted": wasted_h,
        "usd": None if all_unpriced else usd,
        "usd_useful": None if all_unpriced else usd - usd_wasted,
        "usd_wasted": None if all_unpriced else usd_wasted,
        "unpriced_attempts": unpriced,
        "preemptions": len(cuts),  # those resumed to a first new step; their costs summed:
        "kills": sum(c["after"] == "killed" for c in cuts),  # of them, kills: the steps redone a lower bound
        **{k: sum(c[k] for c in cuts) for k in PREEMPTION_KEYS},
        "gpu": last["gpu"],
        "gpus": last["gpus"],
        "provider": last.get("provider"),
        "spot": last.get("spot", False),
        "usd_per_gpu_hour": last.get("usd_per_gpu_hour"),
        "prices_as_of": last.get("prices_as_of"),
        "estimate": ESTIMATE,
    }


# ---------------------------------------------------------------- the ledger


def read_ledger(run_dir: str) -> dict:
    """A run folder's `cost.json` ({"attempts": []} when it has none)."""
    uri = storage.join(run_dir, LEDGER_FILE)
    if not storage.exists(uri):
        return {"format": 1, "attempts": []}
    doc = json.loads(storage.read_text(uri))
    if not isinstance(doc, dict) or not isinstance(doc.get("attempts"), list):
        raise ValueError(f"{uri} is not a cost ledger (a JSON object with an `attempts` list)")
    return doc


class CostLedger:
    """This attempt's entry in the run folder's `cost.json`, kept current: written when it starts, at each
    checkpoint (a mark), at most every `SHARDLINE_COST_LEDGER_SECONDS` from progress reports between them,
    and at its end with its outcome. An earlier entry still `running` belonged to a process that ended
    without a word (SIGKILL, a lost machine): it is marked `killed`. One writer: the run folder's lease."""

    def __init__(self, run_dir: str, pricing: Pricing, first_step: int, clock: Callable[[], float] = time.monotonic):
        self.uri = storage.join(run_dir, LEDGER_FILE)
        self.clock = clock
        self.every = settings.number(LEDGER_ENV)
        self.doc = read_ledger(run_dir)
        for earlier in self.doc["attempts"]:
            if earlier.get("outcome") == "running":
                earlier["outcome"] = "killed"
        self.earlier = list(self.doc["attempts"])
        self.pricing = pricing
        self.entry = {
            "host": socket.gethostname(),
            "gpu": pricing.gpu,
            "gpus": pricing.gpus,
            "provider": pricing.provider,
            "spot": pricing.spot,
            "usd_per_gpu_hour": pricing.usd_per_gpu_hour,
            "prices_as_of": pricing.as_of,
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
            "seconds": 0.0,
            "first_step": first_step,
            "last_step": first_step,
            "outcome": "running",
            "marks": [[first_step, 0.0]],
        }
        self.doc["attempts"].append(self.entry)
        self.t0 = clock()
        self._written = self.t0
        self._write()

    def _now(self, step: int | None) -> None:
        self.entry["seconds"] = self.clock() - self.t0
        if step is not None:
            self.entry["last_step"] = max(self.entry["last_step"], int(step))

    def _write(self) -> None:
        # one line an attempt: readable, and small however many checkpoints it marked
        attempts = ",\n  ".join(json.dumps(a) for a in self.doc["attempts"])
        head = json.dumps({k: v for k, v in self.doc.items() if k != "attempts"})[:-1]
        storage.write_text(self.uri, f'{head}{", " if len(head) > 1 else ""}"attempts": [\n  {attempts}\n]}}\n')
        self._written = self.clock()

    def progress(self, step: int) -> dict | None:
        """Where training is (a progress report): written when the last write is `every` seconds old. The first
        report past this attempt's first step after a preemption or a kill records what that cost (`interruption`),
        written at once and returned (fit reports every SHARDLINE_PROGRESS_SECONDS: its recovery is timed late by
        up to that; not fit's first step itself, which would change the trainer's code, and so every run's folder)."""
        self._now(step)
        cut = None
        if "interruption" not in self.entry and self.entry["last_step"] > self.entry["first_step"]:
            # the last attempt that trained a step (one stopped before its first, at its budget say, is skipped)
            trained = [a for a in self.earlier if a["last_step"] > a["first_step"]]
            if trained and trained[-1]["outcome"] in INTERRUPTIONS:
                cut = self.entry["interruption"] = interruption(trained[-1], self.entry)
        if cut or self.clock() - self._written >= self.every:
            self._write()
        return cut

    def checkpoint(self, step: int, age: float = 0.0) -> None:
        """A checkpoint at `step` is complete, its state taken `age` seconds ago (written meanwhile): a later
        attempt may resume from it."""
        self._now(step)
        marks = self.entry["marks"]
        marks.append([int(step), max(marks[-1][1], self.entry["seconds"] - age)])
        if len(marks) > MAX_MARKS:  # the start and the newest: a resume starts from a recent checkpoint
            del marks[1 : len(marks) - MAX_MARKS + 1]
        self._write()

    def end(self, outcome: str, step: int | None = None) -> dict | None:
        """This attempt ended (`finished`, `preempted`, `failed` or `budget`) at `step`; the run's summary. An
        attempt that found its run finished and trained nothing is not recorded. Said once: a later call
        changes nothing."""
        if self.entry["outcome"] != "running":
            return self.summary()
        self._now(step)
        self.entry["outcome"] = outcome
        if outcome == "finished" and self.entry["last_step"] == self.entry["first_step"]:
            self.doc["attempts"].remove(self.entry)
        self._write()
        return self.summary()

    def summary(self) -> dict | None:
        """The run's spend up to now (this attempt's time counted to this moment while it runs)."""
        if self.entry["outcome"] == "running":
            self._now(None)
        return summarize(self.doc["attempts"])

    # ------------------------------------------------------------ the budget

    def deadline(self, max_hours: float | None, max_cost: float | None) -> tuple[float, str] | None:
        """The `time.monotonic()` at which this attempt reaches the run's budget, and which limit that is
        ("max_hours" or "max_cost"); None without one. Earlier attempts count at their own price (one with
        none at this attempt's); an unpriced attempt with a max_cost is an error naming what is missing."""
        if max_hours is None and max_cost is None:
            return None
        limits = []
        if max_hours is not None:
            before = sum(a["seconds"] for a in self.earlier)
            limits.append((max_hours * 3600 - before, "max_hours"))
        if max_cost is not None:
            rate = self.pricing.usd_per_gpu_hour
            if rate is None:
                raise ValueError(
                    f"training.max_cost={max_cost:g} needs a price for this machine ({self.pricing.gpu}): "
                    f"{self.pricing.note}. Add one to your prices file (SHARDLINE_PRICES), set compute.provider "
                    "to a provider that lists it, or unset training.max_cost"
                )
            spent = sum(
                a["seconds"] * a["gpus"] / 3600 * (rate if a.get("usd_per_gpu_hour") is None else a["usd_per_gpu_hour"])
                for a in self.earlier
            )
            per_second = rate * self.pricing.gpus / 3600
            left = (max_cost - spent) / per_second if per_second > 0 else math.inf
            limits.append((left, "max_cost"))
        left, limit = min(limits)
        return self.t0 + left, limit

    def spent_text(self, max_hours: float | None, max_cost: float | None, limit: str) -> str:
        """The limit reached and the spend so far, for the message of a budget stop."""
        s = self.summary()
        hours = s["seconds"] / 3600
        usd = "unpriced" if s["usd"] is None else f"{s['usd']:.4g} USD"
        where = f"{s['gpu']} x{s['gpus']}" + (f" at {s['provider']}" if s["provider"] else "")
        spent = (
            f"{hours:.4g} hours of training in {s['attempts']} attempt(s), {s['gpu_hours']:.4g} GPU-hours on {where}, "
            f"{usd} (an estimate, prices as of {s['prices_as_of']})"
        )
        if limit == "max_hours":
            return f"training.max_hours={max_hours:g} reached: {spent}"
        return f"training.max_cost={max_cost:g} USD reached: {spent}"


def add_up(summaries: list[dict | None]) -> dict | None:
    """What several runs cost together (a sweep's trials): the sums of their GPU-hours, USD and seconds, and
    how many runs had no ledger (`uncosted`); the USD is None when no run was priced, and counts the priced
    ones otherwise (`unpriced_runs` says how many were not). None when there is nothing to add."""
    if not summaries:
        return None
    costed = [c for c in summaries if c]
    priced = [c for c in costed if c.get("usd") is not None]
    total = {
        k: sum(c[k] for c in costed)
        for k in ("seconds", "gpu_hours", "gpu_hours_useful", "gpu_hours_wasted", "attempts")
    }
    for k in ("usd", "usd_useful", "usd_wasted"):
        total[k] = sum(c[k] for c in priced) if priced else None
    total.update(runs=len(costed), uncosted=len(summaries) - len(costed), unpriced_runs=len(costed) - len(priced))
    return total


def describe(summary: dict) -> str:
    """One line for a log or a summary: GPU-hours (wasted), USD, GPU and price, and that it is an estimate."""
    wasted = f" ({summary['gpu_hours_wasted']:.3g} wasted)" if summary["gpu_hours_wasted"] else ""
    usd = summary["usd"]
    price = (
        f"about {usd:.3g} USD at {summary['provider']}'s {'spot' if summary['spot'] else 'on-demand'} "
        f"{summary['usd_per_gpu_hour']:g} USD/GPU-hour"
        if usd is not None
        else "no price for it in the table"
    )
    gpu = summary["gpu"] if summary["gpu"] != CPU else "CPU (no GPU)"
    cuts = summary.get("preemptions")
    # after a kill no record holds its last steps (`interruption`): what was redone is a lower bound
    least = "at least " if summary.get("kills") else ""
    kills = f", {summary['kills']} of them kill(s)" if summary.get("kills") else ""
    redone = (
        f"; {cuts} preemption(s){kills}: {least}{summary['steps_redone']} step(s), {least}"
        f"{summary['gpu_seconds_redone']:.3g} GPU-seconds redone, {summary['recovery_seconds']:.3g} s to the first "
        "new step"
        if cuts
        else ""
    )
    return (
        f"{summary['gpu_hours']:.3g} GPU-hours on {gpu} x{summary['gpus']}{wasted} in {summary['attempts']} "
        f"attempt(s), {price} (an estimate, prices as of {summary['prices_as_of']}){redone}"
    )
