"""Files written whole (jupyter_gpulease/files.py): a temporary file of its own, then one rename."""

import os
import stat
import threading
from pathlib import Path

import pytest

from jupyter_gpulease import files
from jupyter_gpulease.files import write_atomically


def test_two_writers_in_one_folder_never_share_a_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "idle-gaps.json"
    real_replace = os.replace
    temps = []

    def replace(src, dst):
        temps.append(src)
        if len(temps) == 1:  # the first writer is about to rename: a second one writes the same file meanwhile
            write_atomically(target, "second")
            assert Path(src).read_text() == "first"  # and leaves the first one's temporary file alone
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    write_atomically(target, "first")
    assert len(set(temps)) == 2 and {os.path.dirname(t) for t in temps} == {str(tmp_path)}
    assert target.read_text() == "first" and os.listdir(tmp_path) == ["idle-gaps.json"]


def test_many_writers_at_once_each_leave_the_whole_of_what_they_wrote(tmp_path):
    target = tmp_path / "state.json"
    contents = [str(i) * 10_000 for i in range(8)]
    errors = []

    def write(text):
        try:
            for _ in range(20):
                write_atomically(target, text)
        except Exception as e:  # any error is the test's failure
            errors.append(e)

    threads = [threading.Thread(target=write, args=(c,)) for c in contents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and target.read_text() in contents and os.listdir(tmp_path) == ["state.json"]


def test_the_mode_the_folder_and_bytes(tmp_path):
    target = tmp_path / "new" / "folder" / "outbox.json"
    write_atomically(target, b"{}", mode=0o600, fsync=True)
    assert target.read_bytes() == b"{}" and stat.S_IMODE(target.stat().st_mode) == 0o600
    write_atomically(str(target), "é")
    assert target.read_text(encoding="utf-8") == "é" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "map"
    write_atomically(target, "old")
    with pytest.raises(TypeError):
        write_atomically(target, 42)  # not text nor bytes
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["map"]
