"""A worker record another user planted is refused before anything is sent to its address.

Tests run as root; the other user is simulated with ``os.chown`` to uid 65534. At each
planted address a plain TCP listener records every byte it receives (and answers like
a healthy worker, so a client that trusts it would carry on and send more).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    SchedulingSpec,
)
from areal.api.scheduler_api import RPC_TOKEN_ENV, Job
from areal.infra.scheduler.exceptions import RPCAuthenticationError, WorkerConfigurationError
from areal.infra.scheduler.rpc_workers import RPCWorkerScheduler, WorkerHandle, WorkerRole
from areal.utils import name_resolve, names

OTHER_UID = 65534
TOKEN = "discovery-test-token-2c71e0"


class Eavesdropper:
    """A listening socket that records every connection and byte, answering 200 healthy."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.received = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.settimeout(1.0)
            with conn:
                try:
                    while data := conn.recv(65536):
                        self.received += data
                        if b"\r\n\r\n" in data:
                            body = b'{"status": "healthy", "ports": [1], "engine_name": "x"}'
                            conn.sendall(
                                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                b"content-length: %d\r\n\r\n%s" % (len(body), body)
                            )
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class RecordOnlyScheduler(RPCWorkerScheduler):
    """Discovery without processes: workers are whatever the name-resolve records say."""

    def _start_role(self, role, specs, colocate_with):
        handles = [WorkerHandle(f"{role}/{i}", role, i) for i in range(len(specs))]
        self._register_role(WorkerRole(role, "process", [h.id for h in handles], specs[0]), handles)
        return [h.id for h in handles]

    def _check_started(self, h):
        pass

    def _stop_started(self, r, handles):
        pass

    def _emergency_stop(self):
        pass


@pytest.fixture
def record_root(tmp_path: Path) -> Path:
    return tmp_path / "name_resolve"


@pytest.fixture
def make_scheduler(tmp_path, record_root, monkeypatch) -> Iterator:
    monkeypatch.setenv(RPC_TOKEN_ENV, TOKEN)
    made: list[RecordOnlyScheduler] = []

    def make() -> RecordOnlyScheduler:
        config = BaseExperimentConfig(
            experiment_name="exp",
            trial_name="trial",
            cluster=ClusterSpecConfig(
                fileroot=str(tmp_path / "files"),
                name_resolve=NameResolveConfig(nfs_record_root=str(record_root)),
            ),
        )
        made.append(RecordOnlyScheduler(config, startup_timeout=3.0))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.delete_workers()
    name_resolve.reconfigure("memory")


@pytest.fixture
def eavesdropper() -> Iterator[Eavesdropper]:
    listener = Eavesdropper()
    yield listener
    listener.close()


def worker_dir(record_root: Path, index: int = 0) -> Path:
    return record_root / names.worker("exp", "trial", "actor", index)


def plant(directory: Path, address: str, owner: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    entry = directory / "ENTRY"
    entry.write_text(address)
    entry.chmod(0o600)
    if owner is not None:
        os.chown(directory, owner, owner)
        os.chown(entry, owner, owner)
    return entry


def assert_nothing_reached(listener: Eavesdropper) -> None:
    assert listener.connections == 0 and bytes(listener.received) == b""


@pytest.mark.parametrize("planted_in", ["foreign_dir", "foreign_entry", "world_writable_dir"])
def test_a_planted_record_is_refused_and_its_address_never_contacted(
    make_scheduler, record_root, eavesdropper, planted_in
):
    scheduler = make_scheduler()
    scheduler.create_workers(Job("actor", 1, [SchedulingSpec()]))
    directory = worker_dir(record_root)
    if planted_in == "foreign_dir":
        plant(directory, eavesdropper.address, owner=OTHER_UID)
        unsafe = directory
    elif planted_in == "foreign_entry":
        entry = plant(directory, eavesdropper.address)
        os.chown(entry, OTHER_UID, OTHER_UID)
        unsafe = entry
    else:
        plant(directory, eavesdropper.address)
        directory.parent.chmod(0o777)
        unsafe = directory.parent
    with pytest.raises(WorkerConfigurationError) as info:
        scheduler.get_workers("actor")
    message = str(info.value)
    assert "actor/0" in message and str(unsafe) in message
    assert "nfs_record_root" in message and "chmod 700" in message
    assert_nothing_reached(eavesdropper)


def test_a_record_root_another_user_created_first_is_refused_at_start(
    make_scheduler, record_root, eavesdropper
):
    # the other user prepared the whole tree, record included, before the run started
    planted = worker_dir(record_root)
    plant(planted, eavesdropper.address)
    path = planted
    while path != record_root.parent:
        os.chown(path, OTHER_UID, OTHER_UID)
        path.chmod(0o755)
        path = path.parent
    with pytest.raises(WorkerConfigurationError, match=f"{record_root}.*uid {OTHER_UID}"):
        make_scheduler()
    assert_nothing_reached(eavesdropper)


def test_a_process_that_cannot_sign_its_answer_is_not_taken_for_a_worker(
    make_scheduler, record_root, eavesdropper
):
    # a record in a private directory whose address is no longer our worker's (a stale
    # record, a port someone else took): it gets one signed /health, never the token
    scheduler = make_scheduler()
    scheduler.create_workers(Job("actor", 1, [SchedulingSpec(port_count=2)]))
    name_resolve.add(names.worker("exp", "trial", "actor", 0), eavesdropper.address)
    with pytest.raises(RPCAuthenticationError, match="did not prove it holds"):
        scheduler.get_workers("actor")
    received = bytes(eavesdropper.received)
    assert TOKEN.encode() not in received
    assert received.count(b"\r\n\r\n") == 1 and received.startswith(b"GET /health ")
    assert b"x-areal-token" not in received.lower()
