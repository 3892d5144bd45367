"""Parquet prompt, preference and SFT datasets, sharded by data-parallel rank, resumable by state dict."""

from megarl.data.errors import DataError
from megarl.data.preference_dataset import PreferenceDataset, PreferenceItem
from megarl.data.prompt_dataset import PromptDataset, PromptItem
from megarl.data.sft_dataset import SFTDataset, SFTItem

__all__ = [
    "DataError",
    "PreferenceDataset",
    "PreferenceItem",
    "PromptDataset",
    "PromptItem",
    "SFTDataset",
    "SFTItem",
]
