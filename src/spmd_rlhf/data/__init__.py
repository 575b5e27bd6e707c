"""Prompt data: batches and datasets (the synthetic tasks and the offline tokenizer are the tiny fixture,
``spmd_rlhf.tiny``)."""

from spmd_rlhf.data.batch import Batch

__all__ = ["Batch"]
