"""torchrun (torch's elastic agent) in this process, with the same shutdown grace on every torch Shardline supports
and torch's account of a failure kept as a record:

    python -m shardline.trainer.torchrun [--error-record=URI] [--exit-barrier-timeout=SECONDS]
        --shutdown-timeout=SECONDS [torchrun's arguments]

`--error-record`: when the agent stops on a failure, torch's own account of it is written there (a local path or
a URI in storage), as JSON: `{"host", "at", "failures": [...]}` with one entry per failed rank of the last round
(torch's `ProcessFailure`: the exit code, the signal that killed it, and the rank's own error record, which
`shardline.trainer.ddp_run` writes through torch's `@record`), or `{"host", "at", "agent": {...}}` when the agent
itself failed (its rendezvous timed out or lost its store). Nothing is read from logs.

After a SIGTERM, torchrun passes it on to the ranks and kills those still running after a grace period. Newer
torch sets that grace with `--shutdown-timeout`; older torch (2.11, the lent GPU machines' build, among them) has
no such option and gives the ranks a fixed 30 s: on such a torch this leaves the option out and makes the grace
the default of the one call that uses it (the process context's `close`).

`--exit-barrier-timeout`: how long an agent whose ranks are done waits for the other machines' agents before it
exits (torch's exit barrier, which keeps the rendezvous' store up for agents still finishing: 300 s in torch, and
not one of torchrun's options). An agent stopped by a notice never comes to it, so after a stop on several machines
the others' agents wait this long, then exit 0.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

OPTION = "--shutdown-timeout"
RECORD = "--error-record="
BARRIER = "--exit-barrier-timeout="


def knows(option: str) -> bool:
    """Whether this torch's torchrun accepts `option` (one of its own arguments, before the script)."""
    from torch.distributed.run import get_args_parser

    return not get_args_parser().parse_known_args([option, "script.py"])[1]


def grace_by_default(seconds: int) -> None:
    """Make `seconds` the grace torchrun gives its workers when it stops them (torch without --shutdown-timeout)."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close

    def close_with_grace(self, death_sig=None, timeout: int = seconds):
        return close(self, death_sig, timeout)

    api.PContext.close = close_with_grace


def exit_barrier(seconds: float) -> None:
    """Make `seconds` the time torch's agent waits at its exit barrier for the other machines' agents."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    init = LocalElasticAgent.__init__

    def with_barrier(self, *args, **kwargs):
        kwargs.setdefault("exit_barrier_timeout", seconds)  # torch's launch_agent gives every argument by name
        init(self, *args, **kwargs)

    LocalElasticAgent.__init__ = with_barrier


def failure_record(error: BaseException) -> dict:
    """torch's account of why the agent stopped: each failed rank of its last round (ChildFailedError), or the
    agent's own error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    record: dict = {"host": socket.gethostname(), "at": time.time()}
    if isinstance(error, ChildFailedError):
        failures = []
        for rank, f in sorted(error.failures.items()):
            data = f.error_file_data.get("message") if isinstance(f.error_file_data, dict) else None
            data = data if isinstance(data, dict) else {}  # a rank killed by a signal wrote none
            message = f.message.get("message") if isinstance(f.message, dict) else f.message
            failures.append(
                {
                    "rank": rank,
                    "local_rank": f.local_rank,
                    "pid": f.pid,
                    "exitcode": f.exitcode,
                    "signal": f.signal_name() if f.exitcode < 0 else None,
                    "timestamp": f.timestamp,
                    "message": message,
                    "error": (data.get("extraInfo") or {}).get("shardline"),
                }
            )
        record["failures"] = failures
    else:
        record["agent"] = {
            "error": type(error).__name__,
            "bases": [c.__name__ for c in type(error).__mro__],
            "message": str(error),
        }
    return record


def own_options(args: list[str]) -> tuple[str | None, int | None, float | None, list[str]]:
    """This module's options among torchrun's, before the script: where the error record goes, the shutdown
    grace where this torch's torchrun has no `--shutdown-timeout` (None: torchrun takes the option itself) and the
    exit barrier's timeout (None: torch's); then torchrun's arguments without them."""
    record_to, grace, barrier, rest = None, None, None, []
    for i, arg in enumerate(args):
        if not arg.startswith("-"):  # the script (or `-m`'s module) and its own arguments: torchrun's from here
            rest.extend(args[i:])
            break
        if arg.startswith(RECORD):
            record_to = arg[len(RECORD) :]
        elif arg.startswith(BARRIER):
            barrier = float(arg[len(BARRIER) :])
        elif arg.startswith(OPTION + "=") and not knows(arg):
            grace = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return record_to, grace, barrier, rest


def main(argv: list[str] | None = None) -> None:
    record_to, grace, barrier, args = own_options(list(sys.argv[1:] if argv is None else argv))
    if grace is not None:
        grace_by_default(grace)
    if barrier is not None:
        exit_barrier(barrier)
    # a rendezvous round after a lost node publishes its own master address (torch's shared store keeps the first
    # round's, and a replaced node then waits for a key nobody writes)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(args))
    except Exception as e:
        if record_to:
            from shardline.core.storage import write_text

            try:
                write_text(record_to, json.dumps(failure_record(e), default=str))
            except Exception as not_written:  # noqa: BLE001 - the storage gone too: torch's log still says it
                print(f"shardline: torch's error record could not be written to {record_to}: {not_written}")
        raise


if __name__ == "__main__":
    main()
