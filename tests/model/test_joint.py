"""The rendezvous of several lanes' passes (:mod:`specexec.model.joint`), with a stand-in model that returns each
row's token and position: what each lane gets back is its own rows' results in the order it asked for, every
joint pass holds at most ``chunk`` rows (the steps whole, a long prompt's rows filling the rest), each row's slots
land in its own lane's region, and an error in a joint pass reaches every lane in it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from specexec.model.joint import JointPasses, KVRegion
from specexec.model.kv_cache import KVCache


class Stand:
    """Row r's output: (token, position, the first slot it may see); records each pass's rows and slots."""

    def __init__(self, invariant: bool = True, fail: bool = False) -> None:
        self.invariant, self.fail = invariant, fail
        self.passes: list[tuple[int, list[int]]] = []

    def row_invariant(self) -> bool:
        return self.invariant

    def forward(self, tokens, positions, slots, mask, cache, logits_rows=None, fused_norm=False, hidden=None):
        self.passes.append((int(tokens.shape[0]), slots.tolist()))
        if self.fail:
            raise RuntimeError("the pass failed")
        first = mask.float().argmax(1)
        out = torch.stack((tokens.float(), positions.float(), first.float()), 1)
        return out if logits_rows is None else out[logits_rows]


def _lanes(model: Stand, joint: JointPasses, jobs: list[tuple[int, int, Any]]) -> list[Any]:
    """Lane i passes ``rows`` rows at region base ``i * 100`` with ``logits_rows``; returns each lane's result."""
    pool = KVCache(1, 1, 100 * len(jobs), 2, torch.float32, torch.device("cpu"))
    out: list[Any] = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        rows, first_pos, want = jobs[i]
        region = KVRegion(pool, 100 * i, 100, joint)
        pos = torch.arange(first_pos, first_pos + rows)
        mask = torch.arange(first_pos + rows)[None, :] <= pos[:, None]
        toks = torch.arange(rows) + 1000 * i
        with joint.lane():
            barrier.wait(30)
            try:
                out[i] = joint.forward(model, region, toks, pos, pos, mask, want, False, None)
            except RuntimeError as e:
                out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_each_lane_gets_its_own_rows_and_a_joint_pass_holds_at_most_chunk_rows():
    model = Stand()
    joint = JointPasses(chunk=6)
    want_c = torch.tensor([9, 0, 4])  # any order, as the caller asks
    out = _lanes(model, joint, [(2, 5, None), (3, 0, slice(-1, None)), (10, 20, want_c)])
    assert out[0].tolist() == [[0, 5, 0], [1, 6, 0]]
    assert out[1].tolist() == [[1002, 2, 100]]
    assert out[2].tolist() == [[2009, 29, 200], [2000, 20, 200], [2004, 24, 200]]
    assert all(rows <= 6 for rows, _ in model.passes)
    # the two steps ran whole in the first pass with one prompt row; the prompt's other rows followed
    assert model.passes[0] == (6, [5, 6, 100, 101, 102, 220])
    assert sum(rows for rows, _ in model.passes) == 15 and joint.packed >= 3


def test_a_model_that_is_not_row_invariant_runs_each_lane_alone():
    model = Stand(invariant=False)
    joint = JointPasses(chunk=64)
    out = _lanes(model, joint, [(2, 0, None), (3, 0, None)])
    assert [o.shape[0] for o in out] == [2, 3]
    assert sorted(rows for rows, _ in model.passes) == [2, 3] and joint.packed == 0


def test_an_error_in_a_joint_pass_reaches_every_lane_in_it():
    out = _lanes(Stand(fail=True), JointPasses(chunk=64), [(2, 0, None), (1, 0, None)])
    assert all(isinstance(o, RuntimeError) for o in out)


def test_a_region_past_its_pool_is_refused():
    pool = KVCache(1, 1, 10, 2, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError):
        KVRegion(pool, 5, 6, JointPasses(4))
    with pytest.raises(ValueError):
        JointPasses(0)
