"""A quiet console by default: megarl's own lines, warnings and errors; the libraries' routine
chatter hidden unless ``--verbose`` (``MEGARL_VERBOSE=1`` in the ranks' environment).

Hidden when quiet: vLLM's INFO/WARNING log lines (engine start-up, "Successfully reset prefix
cache" at every rollout; its errors still show), torch's C++ warnings, vLLM's and transformers' weight-loading progress bars,
W&B's advertisement for Weave, and the deprecation warnings listed in ``KNOWN_WARNINGS``, which come from
libraries megarl calls, not from anything a user can change.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

VERBOSE_ENV = "MEGARL_VERBOSE"

# Environment of the ranks when quiet; a value the user has set already wins.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "WANDB_DISABLE_WEAVE": "true",  # W&B's hint to install Weave, printed at every start
    # transformers' "Loading weights" bar, one per rank and model (read when transformers imports)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

# (category, message regex): warnings raised inside libraries on every run, harmless to megarl.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # megatron-core and vLLM call torch.distributed APIs that torch 2.13 renamed.
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
    # megatron-core's optimizer probes .grad of non-leaf tensors (main_grad bookkeeping).
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor"),
    # megatron's sequence-parallel layers: on CUDA megarl sets the variable itself where megatron
    # needs it (megarl.gpu_defaults.launch_env); on CPU it means nothing.
    (
        UserWarning,
        r"When using sequence parallelism it is recommended to set the environment variable",
    ),
)


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "0") == "1"


def rank_env(verbose: bool) -> dict[str, str]:
    """Variables to add to the ranks' environment (before they import torch or vLLM)."""
    env = {VERBOSE_ENV: "1" if verbose else "0"}
    if not verbose:
        env.update({k: v for k, v in QUIET_ENV.items() if k not in os.environ})
    return env


def quiet_rank_console() -> None:
    """Call first in a rank's entry point: applies the quiet defaults unless verbose."""
    if is_verbose():
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # vLLM logs a few warnings at import, before it applies VLLM_LOGGING_LEVEL to its loggers.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


START_ENV = "MEGARL_START_TIME"  # when the user's command started (time.time()), set by the CLI


def start_time() -> float:
    """When the user's command started (the CLI sets it for the ranks), else this process."""
    try:
        return float(os.environ[START_ENV])
    except (KeyError, ValueError):
        return _PROCESS_START


_PROCESS_START = time.time()


def announce(what: str) -> None:
    """A start-up progress line on global rank 0: ``megarl: [  12.3s] what``, the time counted
    from the user's command, so that the minutes before the first step are not silent."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"megarl: [{time.time() - start_time():6.1f}s] {what}", file=sys.stderr, flush=True)
