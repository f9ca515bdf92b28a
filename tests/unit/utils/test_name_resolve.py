"""Name resolution backends."""

from __future__ import annotations

import threading
import time

import pytest

from areal.api.cli_args import NameResolveConfig
from areal.utils import name_resolve


@pytest.fixture(params=["nfs", "memory"])
def repo(request, tmp_path):
    if request.param == "nfs":
        yield name_resolve.reconfigure(NameResolveConfig(nfs_record_root=str(tmp_path / "nr")))
    else:
        yield name_resolve.reconfigure("memory")
    name_resolve.reconfigure("memory")


def test_add_get_subtree_delete(repo):
    name_resolve.add("u/exp/trial/workers/actor/0", "10.0.0.1:9000")
    name_resolve.add("u/exp/trial/workers/actor/1", "10.0.0.2:9000")
    assert name_resolve.get("u/exp/trial/workers/actor/0") == "10.0.0.1:9000"
    assert name_resolve.get_subtree("u/exp/trial/workers/actor") == [
        "10.0.0.1:9000",
        "10.0.0.2:9000",
    ]
    with pytest.raises(name_resolve.NameEntryExistsError):
        name_resolve.add("u/exp/trial/workers/actor/0", "x")
    name_resolve.add("u/exp/trial/workers/actor/0", "10.0.0.9:1", replace=True)
    assert name_resolve.get("u/exp/trial/workers/actor/0") == "10.0.0.9:1"
    name_resolve.delete("u/exp/trial/workers/actor/1")
    with pytest.raises(name_resolve.NameEntryNotFoundError):
        name_resolve.get("u/exp/trial/workers/actor/1")
    name_resolve.clear_subtree("u/exp/trial")
    assert name_resolve.get_subtree("u/exp") == []


def test_reset_deletes_only_delete_on_exit_entries(repo):
    name_resolve.add("k/temp", "1")
    name_resolve.add("k/keep", "2", delete_on_exit=False)
    name_resolve.reset()
    assert name_resolve.get_subtree("k") == ["2"]


def test_wait(repo):
    threading.Timer(0.1, lambda: name_resolve.add("late/key", "v")).start()
    start = time.monotonic()
    assert name_resolve.wait("late/key", timeout=5) == "v"
    assert time.monotonic() - start < 5
    with pytest.raises(TimeoutError, match="never/key"):
        name_resolve.wait("never/key", timeout=0.2)


def test_rejects_bad_keys_and_backends(repo):
    with pytest.raises(ValueError, match="invalid"):
        name_resolve.add("a/../b", "x")
    with pytest.raises(ValueError, match="not supported by this port"):
        name_resolve.reconfigure(NameResolveConfig(type="etcd3"))
