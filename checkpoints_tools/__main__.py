"""``python -m checkpoints_tools <verb>``.

The guard matters: megatron's checkpoint writer starts a spawn-mode multiprocessing Manager,
which re-imports this module.
"""

from checkpoints_tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
