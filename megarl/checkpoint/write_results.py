"""Where megatron-core's checkpoint writer leaves its results: a queue in the saving process.

megatron-core's ``FileSystemWriterAsync`` reports what each rank wrote through a queue it creates
on a rank's first save: ``multiprocessing.get_context("spawn").Manager().Queue()``, a manager
server that starts a new interpreter, which imports the rank's main module (torch, megatron,
vLLM: about 3 s of CPU on 2 cores, 2-2.5 s of the first save's wall time) and then stays until
the rank ends. It exists so that an asynchronous save's writer process, started elsewhere, can
send results back. megarl saves synchronously: ``dist_checkpointing.save`` writes in the rank
(its forked workers report through a queue of their own) and only the rank puts into and reads
from this one, so an in-process queue does the same job. Set before the first save; a queue
megatron already made (another caller's asynchronous save) is left as it is.
"""

from __future__ import annotations

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async


def in_process_write_results() -> None:
    """Give megatron's checkpoint writer an in-process results queue, once per process."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
