"""Stage-then-rename: an output appears whole or not at all, and replacing keeps one complete output."""

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from sana2.staging import (
    NoSpaceError,
    OutputRefused,
    claim_output,
    ensure_free_space,
    mark_output,
    reporting_full_disk,
    staged,
    written_files,
)


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


def test_an_output_is_claimed_only_when_new_or_this_commands_own(tmp_path):
    out = tmp_path / "out"
    assert claim_output(out, "tool data") is False  # nothing there
    out.mkdir()
    assert claim_output(out, "tool data") is True  # an empty folder: nothing to lose
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match=rf"refusing to replace {out}: it is not an earlier tool data output"):
        claim_output(out, "tool data")
    mark_output(out, "tool other")
    with pytest.raises(OutputRefused, match="not an earlier tool data output"):
        claim_output(out, "tool data")  # the same command's output of another kind
    mark_output(out, "tool data")
    assert claim_output(out, "tool data") is True
    with pytest.raises(OutputRefused, match=rf"output {out} already exists \(pass --force\)"):
        claim_output(out, "tool data", replace=False, hint="pass --force")
    with pytest.raises(OutputRefused, match="it is a folder, and this output is a file"):
        claim_output(out, "tool data", folder=False, is_own=lambda path: True)


def test_a_marked_output_holding_a_users_file_anywhere_inside_is_not_replaced(tmp_path):
    out = tmp_path / "export"
    (out / "vae").mkdir(parents=True)
    (out / "model_index.json").write_text("{}")
    (out / "vae" / "weights.safetensors").write_text("w")
    mark_output(out, "tool export", files=written_files(out))
    assert claim_output(out, "tool export") is True  # only what it wrote: replaceable
    (out / "vae" / "notes.txt").write_text("mine")
    (out / "README.md").write_text("my model card")
    with pytest.raises(OutputRefused, match=r"README\.md, vae/notes\.txt"):
        claim_output(out, "tool export")


@pytest.mark.parametrize(
    "output, relation",
    [("data", "is one of this command's inputs"), (".", "contains the input"), ("data/sub/x", "lies inside the input")],
)
def test_an_output_that_overlaps_an_input_is_refused_even_through_a_link(tmp_path, output, relation):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(OutputRefused, match=relation):
        claim_output(tmp_path / output, "tool data", [tmp_path / "link"])


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_published_files_get_the_umasks_permissions_whatever_their_writer_chose(tmp_path, umask):
    """safetensors writes 0600 and tempfile.mkdtemp 0700: a group sharing a dataset could not read it."""
    previous = os.umask(umask)
    try:
        with staged(tmp_path / "dataset") as temp:
            temp.mkdir()
            save_file({"x": torch.zeros(2)}, temp / "shard.safetensors")
            os.mkdir(temp / "sub", 0o700)
            (temp / "sub" / "meta.json").write_text("{}")
            os.chmod(temp / "sub" / "meta.json", 0o600)
        with staged(tmp_path / "null.safetensors") as temp:
            save_file({"x": torch.zeros(2)}, temp)
    finally:
        os.umask(previous)
    dataset = tmp_path / "dataset"
    for path, full in ((dataset, 0o777), (dataset / "sub", 0o777), (tmp_path / "null.safetensors", 0o666)):
        assert stat.S_IMODE(path.stat().st_mode) == full & ~umask, path
    for path in (dataset / "shard.safetensors", dataset / "sub" / "meta.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_torch_saves_short_write_on_a_full_disk_is_named_a_full_disk(tmp_path):
    """torch.save's zip writer reports a full disk as "unexpected pos N vs M", with no errno."""
    from full_disk import FullDisk

    with open(tmp_path / "x.pt", "wb") as file, pytest.raises(RuntimeError) as error:
        torch.save(torch.zeros(10_000), FullDisk(file, room=500))
    assert "unexpected pos" in str(error.value)
    with pytest.raises(NoSpaceError, match=rf"^no space left on {tmp_path}/out: needs about 40.00 KB"):
        with reporting_full_disk(tmp_path / "out", 40_000):
            raise error.value
