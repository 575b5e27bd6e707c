from pathlib import Path

import pytest

from spmd_rlhf.tiny.model import make_tiny


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny model (qwen2 family, tied embeddings) in Hugging Face format."""
    path = tmp_path_factory.mktemp("mapping") / "tiny" / "model"
    make_tiny(family="qwen2", out_dir=str(path))
    return path
