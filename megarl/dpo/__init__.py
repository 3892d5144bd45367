"""The DPO trainer (``megarl train-dpo``): preference optimisation against a frozen reference."""
