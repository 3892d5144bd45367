"""Rank entry point of ``megarl train``: ``python -m megarl.trainer.run CONFIG.yaml [key=value ...]``
under torchrun or Slurm srun (``megarl train --nproc-per-node N`` starts torchrun itself)."""

from __future__ import annotations

import sys

from megarl.errors import MegarlError


def main(argv: list[str] | None = None) -> int:
    from megarl.config import load_config
    from megarl.trainer.loop import train

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(
            "usage: python -m megarl.trainer.run CONFIG.yaml [section.key=value ...]",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = load_config(args[0], args[1:])
        train(cfg)
    except MegarlError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
