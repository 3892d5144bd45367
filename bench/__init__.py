"""megarl's benchmarks: each prints ratios against a peer measured in the same run and stores its
figures under bench/results/. Run one from the repository root as ``python -m bench.<name>``."""
