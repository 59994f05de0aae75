"""The environment checks of a config: here, that its root can be written."""

from __future__ import annotations

import os

import pytest

from relax.config import ConfigError
from relax.config.preflight import check_root_writable


def test_a_root_under_a_file_is_refused_naming_both(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    root = f"file://{tmp_path}/notes.txt/relax"
    with pytest.raises(ConfigError, match=f"root {root} cannot be made: {tmp_path}/notes.txt is a file, not a "
                                          f"folder; pick a root you can write"):
        check_root_writable(root)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any folder")
def test_a_read_only_folder_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=f"root {tmp_path}/ro/relax is not writable \\(nor its nearest existing "
                                          f"folder {tmp_path}/ro\\): permission denied"):
        check_root_writable(f"{tmp_path}/ro/relax")


def test_a_root_to_be_made_in_a_writable_folder_passes(tmp_path):
    check_root_writable(f"{tmp_path}/a/b/c")
    check_root_writable("memory://anything")  # an object store answers for itself when written
    assert not (tmp_path / "a").exists()  # nothing was written to find out
