"""docs/config.md's config reference is the one the dataclass docstrings generate (regenerate it with
``spmd-rlhf config --keys --markdown`` between the markers)."""

from __future__ import annotations

import re
from pathlib import Path

from spmd_rlhf.config import config_reference

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def test_config_reference_is_in_sync():
    text = REFERENCE.read_text()
    copied = text[text.index(START) + len(START) : text.index(END)]
    assert copied.strip() == config_reference(markdown=True).strip(), (
        "docs/config.md's config reference is stale: paste the output of "
        "`spmd-rlhf config --keys --markdown` between the markers"
    )


def test_readme_and_docs_link_only_inside_the_repository():
    """Every relative link of the README and docs/ names a file of the checkout; none leaves it."""
    root = REFERENCE.parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.is_relative_to(root) or not resolved.exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, f"links that leave the repository or name no file: {broken}"


def test_readme_is_a_front_door():
    """The README stays about one screen of reference; the rest lives in docs/."""
    lines = (REFERENCE.parents[1] / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md is {lines} lines; move reference material to docs/"
