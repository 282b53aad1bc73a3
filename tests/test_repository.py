"""The repository stands on its own: no code, comment or doc points at files outside it."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# hidden entries (.git, .venv, tool caches), run outputs, build leftovers, binary fixtures
SKIPPED = {"outputs", "__pycache__", "sana2.egg-info", "tests/data"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".rst", ".txt", ".cfg", ".json", ""}
# where the team's reference material lives on the development machines: never in a shipped file
OUTSIDE = ("../shared", "/shared/", "sana_reference", "ARCHITECTURE.md", "/work/")


def repository_text_files():
    for folder, subfolders, files in os.walk(ROOT):
        relative = Path(folder).relative_to(ROOT)
        subfolders[:] = [
            name
            for name in subfolders
            if (not name.startswith(".") or name == ".ci")
            and (relative / name).as_posix() not in SKIPPED
            and name not in SKIPPED
        ]
        for name in files:
            if Path(name).suffix in TEXT_SUFFIXES and not name.startswith("."):
                yield relative / name


def test_no_file_refers_to_files_outside_the_repository():
    checked = 0
    for relative in repository_text_files():
        if relative == Path(__file__).resolve().relative_to(ROOT):
            continue
        text = (ROOT / relative).read_text(errors="replace")
        checked += 1
        for pattern in OUTSIDE:
            assert pattern not in text, f"{relative} mentions {pattern!r}"
    assert checked > 50  # the walk found the tree
