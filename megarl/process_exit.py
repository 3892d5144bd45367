"""A rank's end: once its work is written, the process exits without the interpreter's teardown.

After a run's last line of output, Python's normal exit took about 5-7 s on a 2-core machine
(py-spy, a one-step GRPO run): vLLM's engine shutdown at exit (its distributed groups, a garbage
collection over the whole heap), the shutdown of a multiprocessing manager (megatron-core's
checkpoint writer starts one), then the destruction of every module and object. None of it is the
run's work: by the time a rank's program returns, its metrics file, checkpoints and trackers
(MLflow, TensorBoard, W&B) are written and closed by the trainer.

So :func:`end_process` does only what must outlive the process - flushes the console, runs
multiprocessing's own exit handler (it shuts down manager processes and joins or ends children,
so none is left behind), removes temporary directories still registered for removal at exit
(W&B's media folders) - then calls ``os._exit``. Only a program that returned (or raised a
megarl user error) ends this way; an unexpected exception keeps Python's normal exit, with its
traceback.

A helper process whose libraries' exit handlers are cheap and theirs to run (the MLflow writer:
MLflow's own clean-ups, about 10 ms) runs them first (``exit_handlers=True``); what it skips is
the same teardown, there about 1 s of garbage collection over MLflow's and SQLAlchemy's objects
after the run had ended (py-spy: ``gc_collect_main`` in nearly every sample).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import sys
import tempfile
import weakref
from contextlib import suppress
from typing import NoReturn


def _remove_temporary_directories() -> None:
    """Run the at-exit clean-ups of live ``tempfile.TemporaryDirectory`` objects (they are
    ``weakref.finalize`` callbacks, which ``os._exit`` would skip)."""
    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer in list(registry):
        info = registry.get(finalizer)
        if info is not None and info.func == getattr(tempfile.TemporaryDirectory, "_cleanup", None):
            with suppress(Exception):
                finalizer()


def end_process(code: int, exit_handlers: bool = False) -> NoReturn:
    """Exit now with ``code``: console flushed, helper processes stopped, temporary folders
    removed, and with ``exit_handlers`` the :mod:`atexit` handlers run; nothing else of the
    interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    if exit_handlers:
        atexit._run_exitfuncs()  # what Python's own exit runs first
    # multiprocessing's at-exit handler: managers shut down, children joined or ended
    multiprocessing.util._exit_function()  # type: ignore[attr-defined]
    _remove_temporary_directories()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)
