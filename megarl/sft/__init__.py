"""The supervised fine-tuning trainer (``megarl train-sft``): token-mean NLL of the response tokens."""
