"""The drafter merge over two gloo ranks: weights averaged by steps, one draft vocabulary for every worker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import read_checks, run_checks, spawn_ranks
from tests.helpers.engine import TINY

STEPS = {"rank 1 trained most": (1, 3), "rank 0 trained most": (3, 1), "a tie": (2, 2)}  # (rank 0's, rank 1's)


def _merge_case(case: str, rank: int) -> None:
    from tlt_rt.models.drafter import Drafter
    from tlt_rt.models.llama import CausalLM
    from tlt_rt.train.cluster.drafter_role import DrafterRole
    from tlt_rt.train.config import TLTConfig

    torch.manual_seed(0)  # the same target and starting drafter on both ranks
    target = CausalLM(TINY).eval()
    serving = Drafter(TINY, target).eval()
    serving.set_draft_vocab(torch.tensor([0, 1, 2, 11]))
    role = DrafterRole(serving, None, target, TLTConfig(), rank, torch.device("cpu"))
    mine = {0: torch.tensor([0, 3, 4, 11]), 1: torch.tensor([0, 5, 6, 11])}[rank]  # each trainer's own vocabulary
    role.replica.set_draft_vocab(mine)
    with torch.no_grad():
        role.replica.fc.weight.fill_(float(rank + 1))
    s0, s1 = STEPS[case]
    role.merge((s0, s1)[rank], s0 + s1, world_size=2)
    want = [[0, 3, 4, 11], [0, 5, 6, 11]][0 if s0 >= s1 else 1]  # the busiest replica's (rank 0 on a tie)
    assert serving.d2t.tolist() == want, (case, serving.d2t.tolist())
    assert role.replica.d2t.tolist() == want
    # the serving head is the target's rows of that vocabulary, on every rank
    torch.testing.assert_close(serving.head_weight(), target.lm_head.weight.detach()[torch.tensor(want)])
    expected = (1.0 * s0 + 2.0 * s1) / (s0 + s1)  # fc weights 1 and 2, weighted by the ranks' steps
    torch.testing.assert_close(serving.fc.weight.float(), torch.full_like(serving.fc.weight.float(), expected))
    both = [torch.empty_like(serving.d2t) for _ in range(2)]
    dist.all_gather(both, serving.d2t)
    assert torch.equal(both[0], both[1])


def _agree_case(case: str, rank: int) -> None:
    from tlt_rt.models.drafter import Drafter
    from tlt_rt.models.llama import CausalLM
    from tlt_rt.train.cluster.comm import check_same_drafter

    torch.manual_seed(0)
    target = CausalLM(TINY).eval()
    drafter = Drafter(TINY, target).eval()
    drafter.set_draft_vocab(torch.tensor([0, 1, 2, 11]))
    if rank == 1 and case == "another vocabulary":
        drafter.set_draft_vocab(torch.tensor([0, 2, 1, 11]))  # the same ids in another order: another head
    if rank == 1 and case == "another weight":
        with torch.no_grad():
            drafter.fc.weight[0, 0] += 1e-3
    if case == "equal":
        check_same_drafter(drafter, None)
    else:
        with pytest.raises(RuntimeError, match="differs between tensor-parallel ranks"):
            check_same_drafter(drafter, None)


def _ranks(rank: int, world: int, out_dir: str) -> None:
    run_checks(rank, {"merge": _merge_case}, tuple(STEPS), out_dir)
    run_checks(rank, {"agree": _agree_case}, ("equal", "another vocabulary", "another weight"), f"{out_dir}/agree")


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("merge")
    (out / "agree").mkdir()
    spawn_ranks(_ranks, world=2, args=(str(out),))
    return out


def test_every_rank_drafts_with_the_busiest_replicas_vocabulary_after_a_merge(ranks_out):
    """Each trainer rebuilds its draft vocabulary from its own answers; TP peers collect none. After the merge
    every worker's serving drafter holds the vocabulary of the replica that trained most (rank 0 on a tie)."""
    for rank, results in enumerate(read_checks(ranks_out, 2)):
        assert set(results) == {f"merge[{case}]" for case in STEPS}
        for name, status in results.items():
            assert status == "ok", f"rank {rank} {name}:\n{status}"


def test_tensor_parallel_ranks_refuse_to_go_on_with_different_drafters(ranks_out):
    """`check_same_drafter` (run by the sharded workers after every drafter merge) raises on every rank when any
    rank's draft vocabulary or weights differ, instead of letting the engines leave lockstep."""
    for rank, results in enumerate(read_checks(ranks_out / "agree", 2)):
        assert set(results) == {"agree[equal]", "agree[another vocabulary]", "agree[another weight]"}
        for name, status in results.items():
            assert status == "ok", f"rank {rank} {name}:\n{status}"
