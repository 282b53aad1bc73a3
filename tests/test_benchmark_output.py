"""The benchmarks' --markdown output replaces only a table a benchmark wrote, never a user's file."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_memory_plan import write_markdown  # noqa: E402


def test_markdown_output_refuses_a_file_it_did_not_write_and_replaces_its_own(tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("my own notes\n")
    with pytest.raises(SystemExit) as stopped:
        write_markdown(notes, "| a |")
    assert stopped.value.code == 2
    assert f"--markdown {notes}: not a table a benchmark wrote; refusing to overwrite it" in capsys.readouterr().err
    assert notes.read_text() == "my own notes\n"

    table = tmp_path / "table.md"
    write_markdown(table, "| first |")
    write_markdown(table, "| second |")  # its own earlier output: replaced
    assert table.read_text().startswith("command: `python ") and table.read_text().endswith("| second |\n")
