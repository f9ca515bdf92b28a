"""NFS name-resolve records are believed only when no other user could have written them.

Tests run as root; another user is simulated by ``os.chown`` to uid 65534 (nobody).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from areal.api.cli_args import NameResolveConfig
from areal.utils import name_resolve

OTHER_UID = 65534
KEY = "u/exp/trial/workers/actor/0"


@pytest.fixture
def root(tmp_path: Path):
    record_root = tmp_path / "nr"
    name_resolve.reconfigure(NameResolveConfig(nfs_record_root=str(record_root)))
    yield record_root
    name_resolve.reconfigure("memory")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def plant(directory: Path, value: str = "127.0.0.1:1", uid: int | None = None) -> Path:
    """An ENTRY written the way another process would, outside name_resolve."""
    directory.mkdir(parents=True, exist_ok=True)
    entry = directory / "ENTRY"
    entry.write_text(value)
    entry.chmod(0o600)
    if uid is not None:
        os.chown(entry, uid, uid)
    return entry


def test_directories_are_created_0700_and_entries_0600_and_only_writability_matters(root):
    os.umask(0o022)
    name_resolve.add(KEY, "10.0.0.1:9000")
    path = root
    for part in KEY.split("/"):
        assert mode(path) == 0o700, path
        path = path / part
    assert mode(path) == 0o700
    assert mode(path / "ENTRY") == 0o600
    assert name_resolve.get(KEY) == "10.0.0.1:9000"
    # a private tree written before (0755 directories, a 0644 entry) is still believed
    path = root
    for part in ["", *KEY.split("/")]:
        path = path / part if part else path
        path.chmod(0o755)
    (path / "ENTRY").chmod(0o644)
    assert name_resolve.get(KEY) == "10.0.0.1:9000"
    assert name_resolve.get_subtree("u/exp") == ["10.0.0.1:9000"]


@pytest.mark.parametrize("where", ["root", "middle", "leaf"])
def test_a_directory_owned_by_another_user_is_refused(root, where):
    plant(root / KEY)
    target = {"root": root, "middle": root / "u" / "exp", "leaf": root / KEY}[where]
    os.chown(target, OTHER_UID, OTHER_UID)
    with pytest.raises(name_resolve.UnsafeNameRecordError) as info:
        name_resolve.get(KEY)
    message = str(info.value)
    assert str(target) in message and f"uid {OTHER_UID}" in message
    assert "nfs_record_root" in message and f"chmod 700 {root}" in message
    with pytest.raises(name_resolve.UnsafeNameRecordError):
        name_resolve.get_subtree("u")


def test_an_entry_owned_by_another_user_is_refused(root):
    plant(root / KEY, uid=OTHER_UID)
    with pytest.raises(name_resolve.UnsafeNameRecordError, match=r"ENTRY.*owned by uid 65534"):
        name_resolve.get(KEY)
    with pytest.raises(name_resolve.UnsafeNameRecordError):
        name_resolve.get_subtree("u/exp/trial/workers")


@pytest.mark.parametrize(("bits", "word"), [(0o777, "world"), (0o770, "group")])
def test_a_group_or_world_writable_directory_is_refused(root, bits, word):
    plant(root / KEY)
    (root / "u" / "exp" / "trial").chmod(bits)
    with pytest.raises(name_resolve.UnsafeNameRecordError, match=f"{word}-writable"):
        name_resolve.get(KEY)


def test_a_writable_entry_is_refused(root):
    plant(root / KEY).chmod(0o666)
    with pytest.raises(name_resolve.UnsafeNameRecordError, match="writable"):
        name_resolve.get(KEY)


def test_a_symbolic_link_below_the_root_is_refused(root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    plant(elsewhere / "actor" / "0")
    (root / "u" / "exp" / "trial").mkdir(parents=True)
    (root / "u" / "exp" / "trial" / "workers").symlink_to(elsewhere)
    with pytest.raises(name_resolve.UnsafeNameRecordError, match="symbolic link"):
        name_resolve.get(KEY)
    plant(root / "v")
    (root / "v" / "ENTRY").unlink()
    (root / "v" / "ENTRY").symlink_to(elsewhere / "actor" / "0" / "ENTRY")
    with pytest.raises(name_resolve.UnsafeNameRecordError, match="symbolic link"):
        name_resolve.get("v")


def test_a_worker_does_not_register_into_a_foreign_directory(root):
    (root / "u").mkdir(parents=True)
    os.chown(root / "u", OTHER_UID, OTHER_UID)
    with pytest.raises(name_resolve.UnsafeNameRecordError):
        name_resolve.add(KEY, "10.0.0.1:9000")
    assert not (root / KEY).exists()


def test_a_shared_sticky_root_is_accepted_with_a_private_subtree(root):
    root.mkdir()
    os.chown(root, OTHER_UID, OTHER_UID)
    root.chmod(0o1777)  # like /tmp: others cannot rename or delete what is ours
    name_resolve.add(KEY, "10.0.0.1:9000")
    assert name_resolve.get(KEY) == "10.0.0.1:9000"
    root.chmod(0o777)  # without the sticky bit the owner of a world-writable root is a risk
    with pytest.raises(name_resolve.UnsafeNameRecordError):
        name_resolve.get(KEY)


def test_clear_and_claim_refuse_a_foreign_parent_and_never_follow_links(root, tmp_path):
    precious = tmp_path / "precious"
    (precious / "trial").mkdir(parents=True)
    (root / "u").mkdir(parents=True)
    (root / "u" / "exp").symlink_to(precious)
    with pytest.raises(name_resolve.UnsafeNameRecordError):
        name_resolve.clear_subtree("u/exp/trial")
    assert (precious / "trial").is_dir()
    (root / "u" / "exp").unlink()
    (root / "u").chmod(0o777)
    with pytest.raises(name_resolve.UnsafeNameRecordError):
        name_resolve.claim_subtree("u/exp/trial")
    (root / "u").chmod(0o700)
    name_resolve.claim_subtree("u/exp/trial")
    assert mode(root / "u" / "exp" / "trial") == 0o700
