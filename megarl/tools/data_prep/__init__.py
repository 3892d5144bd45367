"""Offline data preparation for ``scripts/prepare_*.py``: public sources turned into the parquet
schema that :mod:`megarl.data` reads. Nothing here runs inside a training run."""
