"""The suite's order (tests/conftest.py: LONGEST_FILES first) names files that exist: a renamed one would silently
drop back to collection order, where it can hold one worker alone at the end of the run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FILES

ROOT = Path(__file__).resolve().parents[1]


def test_longest_files_exist_and_are_named_once():
    missing = [path for path in LONGEST_FILES if not (ROOT / path).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
