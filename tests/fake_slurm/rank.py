"""A rank for the Slurm launcher's test: records the variables srun gave it (megarl's ranks map
them to RANK/WORLD_SIZE/LOCAL_RANK, see megarl.launch) and, in the first attempt only, dies by
SIGKILL as rank 3."""

import json
import os
import signal
import sys

from megarl.run.elastic import AttemptRecord

record = AttemptRecord.from_env()
keys = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURMD_NODENAME", "MASTER_ADDR")
with open(os.environ["FAKE_RANK_LOG"], "a") as f:
    row = {k: os.environ[k] for k in keys}
    f.write(json.dumps({**row, "restarts": record.restarts, "args": sys.argv[1:]}) + "\n")
if record.restarts == 0 and os.environ["SLURM_PROCID"] == "3":
    os.kill(os.getpid(), signal.SIGKILL)
