"""The storage protocol: atomic, verified, safely pruned, and read as data only."""

import json
import os
import warnings

import pytest
import torch

from ddpkit import checkpoint
from ddpkit.checkpoint import CheckpointError, CheckpointWarning


def tiny_state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 4), value)}, "train": {"step": int(value)}}


def names(root) -> list[str]:
    return [p.name for p in checkpoint.list_checkpoints(root)]


def test_save_verify_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, tiny_state(step), keep_last=2)
    assert names(tmp_path) == ["step-00000004", "step-00000003"]
    assert checkpoint.verify(tmp_path / "step-00000004") is None
    assert checkpoint.load(checkpoint.latest_good(tmp_path))["train"]["step"] == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest"])
def test_a_damaged_newest_checkpoint_is_skipped(tmp_path, damage):
    checkpoint.save(tmp_path, 1, tiny_state(1))
    newest = checkpoint.save(tmp_path, 2, tiny_state(2))
    data = (newest / "state.pt").read_bytes()
    if damage == "truncate":
        (newest / "state.pt").write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        (newest / "state.pt").write_bytes(data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
    else:
        (newest / "manifest.json").unlink()
    with pytest.warns(CheckpointWarning, match="skipping checkpoint step-00000002"):
        chosen = checkpoint.latest_good(tmp_path)
    assert chosen.name == "step-00000001"
    with pytest.raises(CheckpointError, match="does not verify"):
        checkpoint.load(newest)


def test_a_crash_during_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, tiny_state(1))

    def dies_halfway(obj, path):
        with open(path, "wb") as handle:
            handle.write(b"the first hundred bytes of a checkpoint".ljust(100))
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(CheckpointError, match="disk full.*the newest good checkpoint is still step-00000001"):
        checkpoint.save(tmp_path, 2, tiny_state(2))
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torn write is not even a candidate
        assert checkpoint.latest_good(tmp_path).name == "step-00000001"
    checkpoint.save(tmp_path, 3, tiny_state(3))  # and the next save cleans up the leftovers
    assert not list(tmp_path.glob(".tmp-*"))


def test_the_manifest_is_hashed_while_writing_and_matches_the_file(tmp_path):
    path = checkpoint.save(tmp_path, 7, tiny_state(7))
    info = json.loads((path / "manifest.json").read_text())["files"]["state.pt"]
    assert info["bytes"] == (path / "state.pt").stat().st_size
    assert info["sha256"] == checkpoint.file_sha256(path / "state.pt")


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['DDPKIT_PWNED']}",))


def test_a_malicious_pickle_is_refused_without_running_it(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("DDPKIT_PWNED", str(marker))
    path = checkpoint.save(tmp_path / "ck", 5, {"model": Exploit()})  # a well-formed, verified file
    assert checkpoint.verify(path) is None
    with pytest.raises(CheckpointError, match="a checkpoint is data, not code"):
        checkpoint.load(path)
    assert not marker.exists()


def reseal(path, data: bytes | None = None, **manifest_changes):
    """Rewrite a checkpoint's state.pt and/or manifest, with a manifest that matches the new bytes."""
    if data is not None:
        (path / "state.pt").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"sha256": checkpoint.file_sha256(path / "state.pt"),
                                     "bytes": (path / "state.pt").stat().st_size}
    manifest.update(manifest_changes)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_random_bytes_with_a_valid_manifest_are_reported_as_unreadable_not_as_code(tmp_path):
    path = checkpoint.save(tmp_path, 3, tiny_state(3))
    reseal(path, os.urandom(4096))
    with pytest.raises(CheckpointError, match="is not a readable torch file") as info:
        checkpoint.load(path)
    assert "not code" not in str(info.value)


MALFORMED = {  # manifest text -> the reason verify gives
    "a JSON list": ("[1, 2, 3]", "not an object"),
    "an empty object": ("{}", "format"),
    "no files": ('{"format": 2, "writer": "full", "step": 4, "files": {}}', "lists no files"),
    "entry without bytes": ('{"format": 2, "writer": "full", "step": 4, "files": {"state.pt": {"sha256": "%s"}}}' % ("0" * 64),
                            "byte count"),
    "state.pt not listed": ('{"format": 2, "writer": "full", "step": 4, "files": {"x.bin": {"sha256": "%s", "bytes": 1}}}' % ("0" * 64),
                            "does not list state.pt"),
    "a path, not a name": ('{"format": 2, "writer": "full", "step": 4, "files": {"state.pt": {"sha256": "%s", "bytes": 1},'
                           ' "../x": {"sha256": "%s", "bytes": 1}}}' % ("0" * 64, "0" * 64), "not a plain name"),
    "another step": ('{"format": 2, "writer": "full", "step": 5, "files": {"state.pt": {"sha256": "%s", "bytes": 1}}}' % ("0" * 64),
                     "manifest says step 5"),
    "not JSON": ("{format", "unreadable manifest"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_is_skipped_as_broken_not_a_crash(tmp_path, case):
    checkpoint.save(tmp_path, 2, tiny_state(2))
    bad = checkpoint.save(tmp_path, 4, tiny_state(4))
    text, reason = MALFORMED[case]
    (bad / "manifest.json").write_text(text)
    assert reason in checkpoint.verify(bad)
    with pytest.warns(CheckpointWarning, match="skipping checkpoint step-00000004"):
        assert checkpoint.latest_good(tmp_path).name == "step-00000002"
    with pytest.raises(CheckpointError, match="does not verify"):
        checkpoint.load(bad)


def test_pruning_never_removes_the_step_just_written(tmp_path):
    """A folder that holds newer steps (an earlier, longer run): saving step 10 must keep step 10."""
    for step in (20, 30, 40):
        checkpoint.save(tmp_path, step, tiny_state(step), keep_last=3)
    path = checkpoint.save(tmp_path, 10, tiny_state(10), keep_last=3)
    assert path.exists() and checkpoint.load(path)["train"]["step"] == 10
    assert names(tmp_path) == ["step-00000040", "step-00000030", "step-00000010"]


def test_broken_folders_do_not_count_among_the_kept_ones(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, tiny_state(step), keep_last=5)
    (tmp_path / "step-00000003" / "manifest.json").unlink()  # torn
    (tmp_path / "step-00000002" / "state.pt").write_bytes(b"short")  # truncated
    with pytest.warns(CheckpointWarning, match="moved to"):
        checkpoint.save(tmp_path, 4, tiny_state(4), keep_last=2)
    assert names(tmp_path) == ["step-00000004", "step-00000001"]  # two good ones; the broken are set aside
    assert sorted(p.name for p in (tmp_path / "unreadable").iterdir()) == ["step-00000002", "step-00000003"]


def test_a_crash_between_the_two_renames_of_a_re_save_is_recovered(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 5, tiny_state(5))
    real_rename, calls = os.rename, []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second_rename)
    with pytest.raises(CheckpointError, match="power cut"):
        checkpoint.save(tmp_path, 5, tiny_state(5.5))
    monkeypatch.undo()
    assert names(tmp_path) == [] and list(tmp_path.glob(".old-step-00000005-*"))  # only the moved-aside copy is left
    assert checkpoint.latest_good(tmp_path).name == "step-00000005"  # recovered, not lost
    checkpoint.save(tmp_path, 6, tiny_state(6))  # and pruning keeps it
    assert names(tmp_path) == ["step-00000006", "step-00000005"]
    assert checkpoint.load(tmp_path / "step-00000005")["train"]["step"] == 5


def test_steps_beyond_eight_digits_are_listed_and_sorted(tmp_path):
    for step in (99_999_999, 100_000_000, 123_456_789_012):
        checkpoint.save(tmp_path, step, tiny_state(1), keep_last=5)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [123_456_789_012, 100_000_000, 99_999_999]
    assert checkpoint.latest_good(tmp_path).name == "step-123456789012"


def test_clear_deletes_checkpoints_and_leftovers_only(tmp_path):
    checkpoint.save(tmp_path, 1, tiny_state(1))
    (tmp_path / ".tmp-step-00000002-1").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert checkpoint.clear(tmp_path) == ["step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_pruning_verifies_content_before_keeping_a_checkpoint_in_place_of_an_older_one(tmp_path):
    """A bit flipped in the newest older checkpoint (same size): it must not push the good one out."""
    for step in (1, 2):
        checkpoint.save(tmp_path, step, tiny_state(step), keep_last=2)
    rotten = tmp_path / "step-00000002" / "state.pt"
    data = rotten.read_bytes()
    rotten.write_bytes(data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
    with pytest.warns(CheckpointWarning, match="step-00000002 does not verify.*sha256"):
        checkpoint.save(tmp_path, 3, tiny_state(3), keep_last=2)
    assert names(tmp_path) == ["step-00000003", "step-00000001"]
    assert checkpoint.load(tmp_path / "step-00000001")["train"]["step"] == 1
    assert (tmp_path / "unreadable" / "step-00000002" / "state.pt").read_bytes() != data  # kept, not deleted


def test_a_resume_that_finds_only_unreadable_checkpoints_refuses_and_changes_nothing(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, tiny_state(step))
    for path in checkpoint.list_checkpoints(tmp_path):  # as if a newer version had written them
        (path / "manifest.json").write_text(json.dumps({**json.loads((path / "manifest.json").read_text()), "format": 9}))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match=r"found 2 checkpoint\(s\) .* none of them verifies .*format 9.*nothing was changed"):
        checkpoint.resume_point(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_resume_from_an_older_checkpoint_sets_the_unreadable_newer_ones_aside(tmp_path):
    checkpoint.save(tmp_path, 1, tiny_state(1))
    newer = checkpoint.save(tmp_path, 2, tiny_state(2))
    (newer / "manifest.json").write_text('{"format": 9}')
    with pytest.warns(CheckpointWarning, match="moved to .*unreadable"):
        assert checkpoint.resume_point(tmp_path).name == "step-00000001"
    assert names(tmp_path) == ["step-00000001"] and (tmp_path / "unreadable" / "step-00000002").is_dir()
    checkpoint.save(tmp_path, 2, tiny_state(2.5))  # the resumed run saves step 2 again: the old one is still there
    assert json.loads((tmp_path / "unreadable" / "step-00000002" / "manifest.json").read_text()) == {"format": 9}
