"""torchrun, with the same shutdown grace on every torch Shardline supports:

    python -m shardline.trainer.torchrun --shutdown-timeout=SECONDS [torchrun's arguments]

After a SIGTERM, torchrun passes it on to the ranks and kills those still running after a grace period. Newer
torch sets that grace with `--shutdown-timeout`; older torch (2.11, the lent GPU machines' build, among them) has
no such option, refuses the command line that has it (every multi-process training failed there at once), and
gives the ranks a fixed 30 s, too short for rank 0 to validate and every rank to checkpoint. On such a torch this
leaves the option out and makes the grace the default of the one call that uses it (the process context's
`close`, which torchrun calls without a timeout when it stops its workers), so a SIGTERM gives the ranks the same
time on every torch.
"""

from __future__ import annotations

import sys

OPTION = "--shutdown-timeout"


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


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0].startswith(OPTION + "=") and not knows(args[0]):
        grace_by_default(int(args.pop(0).split("=", 1)[1]))
    from torch.distributed.run import main as torchrun

    torchrun(args)


if __name__ == "__main__":
    main()
