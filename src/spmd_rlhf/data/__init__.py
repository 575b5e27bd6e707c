"""Prompt data: synthetic tasks, tokenizers and chat templates, batches and datasets."""

from .batch import Batch

__all__ = ["Batch"]
