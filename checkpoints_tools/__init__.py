"""Megatron distributed checkpoints <-> Hugging Face at any TP/PP, with verified round trips.

``python -m checkpoints_tools hf-to-mcore | mcore-to-hf | verify`` (also ``megarl convert ...``).
The checkpoint format and its save/load live in :mod:`megarl.checkpoint`; the HF name map in
:mod:`megarl.models.hf_map`.
"""
