"""Prompt data: synthetic tasks, tokenizers and chat templates, batches and datasets."""
