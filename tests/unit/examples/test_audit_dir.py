"""An audit directory that cannot hold shards fails the run at start, naming the field.

Before, a symlinked or unusable ``econfig.arena_result_dump_dir`` let the run start and
then dropped every audit record with only a warning each.
"""

from __future__ import annotations

import os
import stat

import pytest

from examples.swe.arena_audit import AuditShardWriter


def test_a_symlinked_audit_dir_fails_at_start(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    for directory in (tmp_path / "link", tmp_path / "link" / "below"):
        with pytest.raises(ValueError) as info:
            AuditShardWriter(str(directory), 1000)
        message = str(info.value)
        assert message.startswith(f"econfig.arena_result_dump_dir {str(directory)!r}:")
        assert "symbolic link" in message and str(real) in message  # the path to use instead
    assert list(real.iterdir()) == []


def test_an_audit_dir_that_cannot_exist_fails_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"econfig\.arena_result_dump_dir .*not a usable"):
        AuditShardWriter(str(blocker / "audit"), 1000)


def test_a_usable_audit_dir_is_created_private_and_left_clean(tmp_path):
    directory = tmp_path / "new" / "audit"
    AuditShardWriter(str(directory), 1000)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert list(directory.iterdir()) == []  # the write probe is gone
    AuditShardWriter("", 1000)  # disabled: nothing checked, nothing created
