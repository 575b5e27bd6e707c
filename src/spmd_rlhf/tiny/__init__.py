"""The tiny fixture, in one place: a random-init model of any supported family (``model.py``), the small offline
tokenizer it ships with (``tokenizer.py``), and the arithmetic task with its rule score and cost (``task.py``), so
tests, benchmarks and the CPU demos run without a model hub.

    spmd-rlhf make-tiny --family qwen2 --out tiny/model
    spmd-rlhf make-task --task arithmetic --out tiny/task

``ensure_tiny_assets`` builds both at the config defaults (``model.path=tiny/model``, ``tiny/task/*.parquet``) on first
use. The modules are imported on demand (the model's needs ``transformers``): import from them, e.g.
``from spmd_rlhf.tiny.model import make_tiny``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd_rlhf.config import FrameworkConfig

TINY_MODEL_DIR = "tiny/model"
TINY_TASK_DIR = "tiny/task"


def ensure_tiny_assets(config: FrameworkConfig) -> None:
    """Build the tiny model and task at their default paths on first use (no network needed)."""
    if config.model.path == TINY_MODEL_DIR and not os.path.isdir(TINY_MODEL_DIR):
        from spmd_rlhf.tiny.model import make_tiny

        make_tiny(family="qwen2", out_dir=TINY_MODEL_DIR)
    if any(path.startswith(TINY_TASK_DIR + "/") and not os.path.exists(path) for path in config.data.train_files):
        from spmd_rlhf.tiny.task import make_task

        make_task(task="arithmetic", out_dir=TINY_TASK_DIR)
