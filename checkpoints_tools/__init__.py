"""Checkpoint (3 of 3): CLIs converting model checkpoints <-> Hugging Face, verified.

Megatron distributed checkpoints <-> Hugging Face at any TP/PP, with verified round trips.
The format is :mod:`megarl.checkpoint` (1 of 3); the loop's step checkpoints
(:mod:`megarl.run.checkpointing`, 2 of 3) hold one such model checkpoint per role.

``python -m checkpoints_tools hf-to-mcore | mcore-to-hf | verify`` (also ``megarl convert ...``).
The checkpoint format and its save/load live in :mod:`megarl.checkpoint`; the HF name map in
:mod:`megarl.models.hf_map`.
"""
