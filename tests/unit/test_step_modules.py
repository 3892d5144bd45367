"""tools/step_modules.py records the megarl functions called while it is on, in the calling
thread and in threads started meanwhile, and nothing outside megarl or after it stops."""

from __future__ import annotations

import json
import threading

import pytest

from megarl.dtypes import dtype_from_name
from megarl.metrics import mean
from tools.step_modules import PACKAGE, CallRecorder

pytestmark = pytest.mark.unit


def test_the_recorder_sees_megarl_calls_while_on_in_new_threads_too():
    recorder = CallRecorder()
    mean(1.0)  # before: not recorded
    recorder.start()
    try:
        mean(2.0)
        json.dumps({})  # the standard library: not megarl
        worker = threading.Thread(target=dtype_from_name, args=("float32",))
        worker.start()
        worker.join()
    finally:
        recorder.stop()
    mean(3.0)  # after: not recorded
    ran = {
        path.removeprefix(str(PACKAGE) + "/"): names for path, names in recorder.functions.items()
    }
    assert ran["metrics.py"] >= {"mean"}
    assert ran["dtypes.py"] >= {"dtype_from_name"}  # in the thread started while on
    assert all(path.startswith(str(PACKAGE)) for path in recorder.functions)
    count = len(ran["metrics.py"])
    mean(4.0)
    assert len(recorder.functions[str(PACKAGE / "metrics.py")]) == count
