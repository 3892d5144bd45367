"""Which megarl modules one training step runs through: ``python tools/step_modules.py [CONFIG]
[key=value ...]``.

Runs the config (default: the quickstart, colocated GRPO) as one in-process rank, records every
Python function called during its second step (the first warms caches and compiles) in every
thread it starts (threads already running, such as the metrics writer, are not followed), and
prints the megarl modules they belong to, by folder, with the number of their
functions that ran. The second step is the steady state a reader of the code has to follow;
the set-up before it and the logging after it are left out (they are ``setup_run`` and
``log_step``). Profiling every call slows that step several times: the figures are modules, not
seconds. ``--json FILE`` also writes the list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megarl"
QUICKSTART_MODEL = "outputs/quickstart/model/config.json"
TRACED_STEP = 1  # 0-based: the second step


class CallRecorder:
    """Functions of megarl's package called while on (``sys.setprofile`` in every thread)."""

    def __init__(self) -> None:
        self.functions: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(str(PACKAGE)):
            with self._lock:
                self.functions[path].add(frame.f_code.co_qualname)

    def start(self) -> None:
        threading.setprofile(self._profile)  # threads started from here on (Python 3.11)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _install(recorder: CallRecorder, done: dict[str, bool]) -> None:
    """Start recording when the traced step begins and stop before its metrics are logged."""
    from megarl.run.guards import RunGuards
    from megarl.trainer import loop

    begin_step = RunGuards.begin_step
    log_step = loop.log_step

    def traced_begin_step(self: RunGuards, step: int) -> None:
        begin_step(self, step)
        if step == TRACED_STEP:
            recorder.start()

    def traced_log_step(*args: object, **kwargs: object) -> object:
        if recorder.functions and not done["step"]:
            recorder.stop()
            done["step"] = True
        return log_step(*args, **kwargs)  # type: ignore[arg-type]

    RunGuards.begin_step = traced_begin_step  # type: ignore[method-assign]
    loop.log_step = traced_log_step  # type: ignore[assignment]


def _report(recorder: CallRecorder) -> dict[str, int]:
    modules = {
        str(Path(path).relative_to(ROOT)): len(names)
        for path, names in sorted(recorder.functions.items())
    }
    by_folder: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        by_folder[str(Path(module).parent)].append(Path(module).name)
    print(f"{len(modules)} megarl modules ran functions in step {TRACED_STEP + 1}:")
    for folder, names in sorted(by_folder.items()):
        print(f"  {folder}/ ({len(names)}): " + ", ".join(sorted(names)))
    return modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs/quickstart_cpu.yaml"))
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--json", type=Path, help="also write the modules and counts here")
    args = parser.parse_args(argv)
    from megarl.ports import free_port

    if args.config.endswith("quickstart_cpu.yaml") and not (ROOT / QUICKSTART_MODEL).is_file():
        # the quickstart's model and data, offline, in seconds (as `make quickstart` does)
        subprocess.run(
            [sys.executable, "-m", "megarl.quickstart", "--out", "outputs/quickstart"],
            cwd=ROOT,
            check=True,
        )

    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    recorder, done = CallRecorder(), {"step": False}
    _install(recorder, done)
    from megarl.entry import main as rank_main

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            "trainer.total_steps=2",
            f"trainer.output_dir={out}",
            "trainer.save_freq=0",
            *args.overrides,
        ]
        code = rank_main([args.config, *overrides])
    if code != 0 or not done["step"]:
        print(f"step_modules: the run ended with {code} before its second step", file=sys.stderr)
        return code or 1
    modules = _report(recorder)
    if args.json is not None:
        args.json.write_text(json.dumps({"step": TRACED_STEP + 1, "modules": modules}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
