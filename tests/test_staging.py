"""Stage-then-rename: an output appears whole or not at all, and replacing keeps one complete output."""

import pytest

from sana2.staging import NoSpaceError, ensure_free_space, staged


def test_a_staged_folder_appears_only_when_complete(tmp_path):
    final = tmp_path / "out"
    with staged(final) as temp:
        temp.mkdir()
        (temp / "a.txt").write_text("a")
        assert not final.exists()
    assert (final / "a.txt").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_write_leaves_the_previous_output_and_no_temporary(tmp_path):
    final = tmp_path / "model.pth"
    final.write_text("old")
    with pytest.raises(RuntimeError, match="disk trouble"), staged(final, replace=True) as temp:
        temp.write_text("half")
        raise RuntimeError("disk trouble")
    assert final.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth"]


def test_replacing_swaps_in_the_new_output_and_refusing_writes_nothing(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match=str(final)), staged(final) as temp:
        temp.write_text("never written")
    with staged(final, replace=True) as temp:
        temp.mkdir()
        (temp / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_too_little_free_space_names_the_path_and_the_sizes(tmp_path):
    ensure_free_space(tmp_path / "not" / "yet", 1)
    with pytest.raises(NoSpaceError, match=rf"no space left on {tmp_path}/x: needs about .* free"):
        ensure_free_space(tmp_path / "x", 1 << 60)
