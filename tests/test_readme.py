"""The README's config reference is the one the dataclass docstrings generate (regenerate it with
``spmd-rlhf config --keys --markdown`` between the markers)."""

from __future__ import annotations

from pathlib import Path

from spmd_rlhf.config import config_reference

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def test_config_reference_is_in_sync():
    text = README.read_text()
    copied = text[text.index(START) + len(START) : text.index(END)]
    assert copied.strip() == config_reference(markdown=True).strip(), (
        "README.md's config reference is stale: paste the output of `spmd-rlhf config --keys --markdown` between the markers"
    )
