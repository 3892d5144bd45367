"""Parquet prompt and preference datasets, sharded by data-parallel rank, resumable by state dict."""

from megarl.data.errors import DataError
from megarl.data.preference_dataset import PreferenceDataset, PreferenceItem
from megarl.data.prompt_dataset import PromptDataset, PromptItem

__all__ = ["DataError", "PreferenceDataset", "PreferenceItem", "PromptDataset", "PromptItem"]
