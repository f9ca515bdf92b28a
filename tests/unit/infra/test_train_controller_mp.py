"""TrainController over model-parallel ranks: data goes to DP heads, groups share it.

Four real RPC workers from the local scheduler host :class:`RecordingMPEngine` as
d2 x t2 on gloo (TP groups {0, 1} and {2, 3}, Megatron's tp-dp order). Each rank records
what its data methods received, so the test can compare the ranks of a TP group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    SchedulingSpec,
)
from areal.api.engine_api import PPOActorEngine
from areal.api.io_struct import FinetuneSpec
from areal.api.scheduler_api import RPC_TOKEN_ENV, Worker
from areal.infra.controller.train_controller import TrainController, balanced_partition
from areal.infra.rpc.remote_engine import RemoteEngine
from areal.infra.scheduler.local import LocalScheduler
from areal.utils import name_resolve
from areal.utils.data import concat_padded_tensors
from tests.unit.infra.fake_scheduler import SyncEngineCalls
from tests.unit.infra.mp_engines import LOGP_OFFSET, N_MINIBATCHES, MPLayoutConfig

REPO_ROOT = Path(__file__).resolve().parents[3]
ENGINE = "tests.unit.infra.mp_engines.RecordingMPEngine"
TP, WORLD = 2, 4


def make_batch(n_groups: int) -> list[dict[str, torch.Tensor]]:
    """Groups of 1-3 rows and widths 4..., with ids ``100 g + position`` (groups differ)."""
    batch = []
    for g in range(n_groups):
        n, width = 1 + g % 3, 4 + 3 * g
        ids = (100 * g + torch.arange(width)).repeat(n, 1)
        lengths = torch.tensor([width - r for r in range(n)])  # right padding below
        mask = torch.arange(width)[None] < lengths[:, None]
        batch.append(
            {
                "input_ids": ids * mask,
                "attention_mask": mask,
                "loss_mask": mask.long(),
                "rewards": torch.arange(n, dtype=torch.float32),
            }
        )
    return batch


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp-controller")
    mp = pytest.MonkeyPatch()
    mp.delenv(RPC_TOKEN_ENV, raising=False)
    mp.chdir(REPO_ROOT)  # workers import tests.* through the controller's cwd
    config = BaseExperimentConfig(
        experiment_name="mp",
        trial_name="d2t2",
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "name_resolve")),
        ),
    )
    scheduler = LocalScheduler(config, gpu_devices=[], stop_grace=5.0)
    record_dir = root / "records"
    ctl = TrainController(ENGINE, MPLayoutConfig(TP, str(record_dir)), scheduler)
    try:
        ctl.initialize(WORLD, SchedulingSpec(cpu=1, mem=1), FinetuneSpec(1, 8, 8))
        yield ctl, record_dir
    finally:
        ctl.destroy()
        scheduler.delete_workers()
        name_resolve.reconfigure("memory")
        mp.undo()


def records(record_dir: Path, method: str, call: int) -> list[dict]:
    """What each of the four ranks received in call ``call`` of ``method``."""
    return [torch.load(record_dir / f"{method}-{call}-rank{r}.pt") for r in range(WORLD)]


def assert_same_data(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def expected_shares(batch: list[dict]) -> list[list[int]]:
    return balanced_partition([int(t["attention_mask"].sum()) for t in batch], WORLD // TP)


def test_layout_names_one_head_per_data_parallel_rank(controller):
    ctl, _ = controller
    assert ctl.dp_size == 2
    assert [w.id for w in ctl.dp_heads] == ["actor/0", "actor/2"]  # lowest rank of each TP group


def test_compute_logp_sends_each_tp_group_its_heads_share(controller):
    ctl, record_dir = controller
    batch = make_batch(5)
    out = ctl.compute_logp(batch)
    # results come back per group, in batch order, trimmed to each group's width
    assert len(out) == len(batch)
    for group, logp in zip(batch, out, strict=True):
        assert logp is not None
        assert torch.equal(logp, group["input_ids"].float() + LOGP_OFFSET)
    got = records(record_dir, "compute_logp", 0)
    shares = expected_shares(batch)
    assert all(shares) and sorted(i for s in shares for i in s) == list(range(5))
    for head, dp_rank in ((0, 0), (2, 1)):
        # the head got its DP rank's groups; its TP partner got exactly the same tensors
        expected = concat_padded_tensors([batch[i] for i in shares[dp_rank]])
        assert_same_data(got[head]["data"], expected)
        assert_same_data(got[head + 1]["data"], got[head]["data"])
        assert got[head]["dp_rank"] == got[head + 1]["dp_rank"] == dp_rank


def test_compute_advantages_shares_group_sizes_with_the_tp_group(controller):
    ctl, record_dir = controller
    batch = make_batch(4)
    out = ctl.compute_advantages(batch)
    for group, result in zip(batch, out, strict=True):
        assert torch.equal(result["advantages"], 2.0 * group["input_ids"].float())
        assert torch.equal(result["n_tokens"], group["attention_mask"].sum(1))
    got = records(record_dir, "compute_advantages", 0)
    shares = expected_shares(batch)
    for head, dp_rank in ((0, 0), (2, 1)):
        sizes = [batch[i]["attention_mask"].shape[0] for i in shares[dp_rank]]
        # the kwarg travels through the head's broadcast too (non-heads were sent none)
        assert got[head]["kwargs"] == got[head + 1]["kwargs"] == {"group_sizes": sizes}
        assert_same_data(got[head + 1]["data"], got[head]["data"])


def test_ppo_update_and_stats_come_from_dp_rank_zero(controller):
    ctl, record_dir = controller
    batch = make_batch(4)
    stats = ctl.ppo_update(batch)
    total = sum(int(t["attention_mask"].sum()) for t in batch)
    assert [s["step"] for s in stats] == [float(k) for k in range(N_MINIBATCHES)]
    assert all(s["dp_rank"] == 0 and s["global_tokens"] == total for s in stats)
    got = records(record_dir, "ppo_update", 0)
    assert_same_data(got[1]["data"], got[0]["data"])
    assert_same_data(got[3]["data"], got[2]["data"])
    assert ctl.export_stats() == {"rank": 0.0, "dp_rank": 0.0}
    ctl.set_version(7)
    assert ctl.get_version() == 7


def test_fewer_groups_than_dp_ranks_is_a_clear_error_and_keeps_ranks_in_step(controller):
    ctl, record_dir = controller
    calls_before = len(list(record_dir.glob("compute_logp-*-rank0.pt")))
    with pytest.raises(
        ValueError, match=r"1 rollout group.*2 data-parallel.*train_dataset\.batch_size"
    ):
        ctl.compute_logp(make_batch(1))
    # refused before any RPC: no rank recorded a call, and the next call still works
    assert len(list(record_dir.glob("compute_logp-*-rank0.pt"))) == calls_before
    batch = make_batch(2)
    out = ctl.compute_logp(batch)
    assert [tuple(t.shape) for t in out] == [tuple(g["input_ids"].shape) for g in batch]
    got = records(record_dir, "compute_logp", calls_before)
    assert got[0]["data"]["input_ids"].shape[0] + got[2]["data"]["input_ids"].shape[0] == 3


def test_balanced_partition_leaves_no_rank_empty():
    # zero-token groups tie on load; the tie goes to the part with fewer groups
    assert balanced_partition([0, 0, 0], 2) == [[0, 2], [1]]
    assert balanced_partition([5, 0], 2) == [[0], [1]]
    # otherwise the lightest part takes the next-longest group
    assert balanced_partition([9, 5, 4, 3], 2) == [[0, 3], [1, 2]]


class ScriptedLayouts(SyncEngineCalls):
    """A scheduler stand-in whose workers answer ``data_parallel_layout`` from a script."""

    def __init__(self, answers: list[dict | None]):
        self.answers = answers

    def create_workers(self, job) -> list[str]:
        return [f"actor/{i}" for i in range(job.replicas)]

    def get_workers(self, role: str) -> list[Worker]:
        return [Worker(f"{role}/{i}", "127.0.0.1", ["1", "2"]) for i in range(len(self.answers))]

    async def set_worker_env(self, worker_id: str, env: dict) -> None:
        pass

    async def create_engine(self, worker_id: str, *args, **kwargs) -> str:
        return worker_id

    def call_engine(self, worker_id: str, method: str, *args, **kwargs):
        if method == "data_parallel_layout":
            return self.answers[int(worker_id.split("/")[1])]
        return None


def head(dp_rank: int, dp_size: int, is_head: bool = True) -> dict:
    return {"dp_rank": dp_rank, "dp_size": dp_size, "is_head": is_head}


@pytest.mark.parametrize(
    "answers",
    [
        [head(0, 2), None, head(0, 2), None],  # two heads claim DP rank 0
        [head(0, 2), None, None, None],  # DP size 2 but one head
        [head(0, 1, is_head=False)],  # answered (so gets no broadcast) but is not a head
    ],
)
def test_an_inconsistent_layout_is_refused_at_initialize(answers):
    ctl = TrainController(ENGINE, None, ScriptedLayouts(answers))
    with pytest.raises(RuntimeError, match="inconsistent data-parallel layout"):
        ctl.initialize(len(answers), SchedulingSpec(), FinetuneSpec(1, 8, 8))


def test_a_failing_rank_fails_the_call_without_waiting_for_the_others():
    """One rank fails; its peers would wait in a collective forever: raise at once."""
    import threading
    import time

    release = threading.Event()

    class Scheduler(SyncEngineCalls):
        def call_engine(self, worker_id, method, *args, **kwargs):
            if worker_id == "actor/0":
                raise RuntimeError("rank 0 failed in send_weights")
            release.wait(60)  # a peer stuck in the collective rank 0 never joins

    scheduler = Scheduler()
    controller = TrainController("engine", None, scheduler)
    controller.workers = [Worker(f"actor/{i}", "127.0.0.1", ["1"], []) for i in range(2)]
    controller.ranks = [RemoteEngine(scheduler, w.id, PPOActorEngine) for w in controller.workers]
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        controller.send_weights(None)
    assert time.monotonic() - begin < 5
    release.set()
