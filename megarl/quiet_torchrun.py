"""torchrun for megarl's own launches: ``python -m megarl.quiet_torchrun [torchrun args]``.

When a rank fails, torchrun's own report (a traceback of ``ChildFailedError`` and a table of
failures, ~30 lines) would follow the rank's message. megarl's ranks print their error
themselves (``megarl: error: ...`` for user errors, a traceback otherwise), so this launcher ends
with that output and exits with the rank's exit code. ``MEGARL_VERBOSE=1`` keeps torchrun's report.
With ``MEGARL_FAILURE_FILE`` set, the first failed rank and its exit code are also written there
as JSON (the elastic supervisor reads which rank to leave out of a restart). When the ranks
meet at a loopback address (megarl's single-node launches), the agent's rendezvous store listens
on loopback only (megarl.loopback), and the agent is not dumpable (megarl.hardening).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from megarl.console import is_verbose
from megarl.hardening import make_undumpable
from megarl.loopback import is_loopback, loopback_store
from megarl.parent_death import children_env, end_with_parent
from megarl.rank_exit import FAILURE_FILE_ENV, exit_code_of, failure_note, first_cause


def _store_on_loopback() -> None:
    """The agent's rendezvous store (torchrun's static rendezvous) listens on 127.0.0.1 only:
    the ranks are told to meet there, and TCPStore would otherwise listen on every interface."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    def store(host, port, world_size, is_master, timeout, **kwargs):
        return loopback_store(int(port), world_size, bool(is_master), timeout, **kwargs)

    static_tcp_rendezvous.TCPStore = store


def main(argv: list[str] | None = None) -> int:
    make_undumpable()  # the agent holds the job's environment too
    end_with_parent()  # it ends with megarl's launcher, and its ranks with it
    os.environ.update(children_env())  # its ranks check that it still runs as they start
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    verbose = is_verbose()
    if not verbose:  # torchrun's own log lines: failures, "closing signal SIGTERM" to other ranks
        logging.disable(logging.ERROR)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if is_loopback(args.master_addr):
        _store_on_loopback()
    try:
        run(args)
    except ChildFailedError as e:
        # torchrun's first failure is by time seen; the cause is the rank that did not lose a peer
        rank = first_cause({r: (f.exitcode, f.timestamp) for r, f in e.failures.items()})
        failure = e.failures[rank]
        record = os.environ.get(FAILURE_FILE_ENV)
        if record:
            with open(record, "w") as f:
                json.dump({"rank": rank, "exit_code": failure.exitcode}, f)
        if verbose:
            raise
        note = failure_note(rank, failure.exitcode)
        if note:
            print(note, file=sys.stderr, flush=True)
        return exit_code_of(failure.exitcode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
