"""The repository stands on its own: no code, comment or doc points at files outside it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# hidden entries (.git, .venv, tool caches), run outputs, binary data and build leftovers
SKIPPED = {"outputs", "__pycache__", "data", "sana2.egg-info"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".rst", ".txt", ".cfg", ".json", ""}
# where the team's reference material lives on the development machines: never in a shipped file
OUTSIDE = ("../shared", "/shared/", "sana_reference", "ARCHITECTURE.md", "/work/")


def repository_text_files():
    for path in sorted(ROOT.rglob("*")):
        relative = path.relative_to(ROOT)
        hidden = any(part.startswith(".") and part != ".ci" for part in relative.parts)
        if path.is_file() and path.suffix in TEXT_SUFFIXES and not hidden and not SKIPPED & set(relative.parts):
            yield relative


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
