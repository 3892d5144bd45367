"""The output folder's lock (megarl.run.run_lock): a live run's folder is refused, naming the run;
a lock file left by a dead run is taken over with a note; a finished run leaves none."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megarl.errors import ConfigError
from megarl.run.run_lock import LOCK_FILE, acquire_run_lock

pytestmark = pytest.mark.unit


def test_a_held_folder_is_refused_naming_the_live_run(tmp_path):
    out = tmp_path / "run"
    with acquire_run_lock(out):
        # another process (a second `megarl train`) into the same folder
        code = (
            "import sys\n"
            "from megarl.errors import ConfigError\n"
            "from megarl.run.run_lock import acquire_run_lock\n"
            "try:\n"
            f"    acquire_run_lock({str(out)!r})\n"
            "except ConfigError as e:\n"
            "    print(e)\n"
            "    sys.exit(2)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        message = proc.stdout
        assert "in use by a live run" in message
        assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in message
        assert time.strftime("%Y-%m-%d") in message
        with pytest.raises(ConfigError, match="in use by a live run"):  # in this process too
            acquire_run_lock(out)
    assert not out.exists()  # released: the file goes, and the folder it was made for
    out.mkdir()
    with acquire_run_lock(out):  # the folder can be taken again
        pass
    assert out.is_dir()  # a folder that was there stays


def test_a_lock_file_of_a_dead_run_is_taken_over_with_a_note(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    started = time.time() - 3600
    (out / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": 4242, "started": started}))
    with acquire_run_lock(out):
        err = capsys.readouterr().err
        assert err.count("\n") == 1  # one line
        assert "megarl: note:" in err and "has ended" in err and "host node7, pid 4242" in err
        record = json.loads((out / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()


def test_a_link_planted_as_the_lock_file_is_not_followed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (out / LOCK_FILE).symlink_to(victim)
    with pytest.raises(ConfigError, match=r"cannot lock trainer\.output_dir"):
        acquire_run_lock(out)
    assert victim.read_text() == "keep me"


def test_the_lock_stays_at_the_folder_when_overwrite_moves_the_earlier_run_aside(tmp_path):
    out = tmp_path / "run"
    with acquire_run_lock(out) as lock:
        aside = tmp_path / "run.old-1"
        out.rename(aside)  # what trainer.overwrite=true does (megarl.run.output_dir.move_aside)
        lock.moved_to(aside)
        assert not (aside / LOCK_FILE).exists()
        with pytest.raises(ConfigError, match="in use by a live run"):
            acquire_run_lock(out)
    assert not (out / LOCK_FILE).exists()
