"""The invariant Triton tree-attention kernel (:mod:`specexec.model.tree_attn`): on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, tiny shapes: the interpreter runs every program in Python), on a GPU compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specexec.model import tree_attn
from specexec.model.tree_attn import tree_attention, tree_keys

pytest.importorskip("triton")

H, KVH, D = 4, 2, 16


# Triton must be imported with TRITON_INTERPRET=1 to interpret a kernel (its library functions are decorated
# then), so the interpreted cases run in a child pytest (test_interpreted_in_a_child) unless this one has it set.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_interpreted_in_a_child (TRITON_INTERPRET=1)")


def test_interpreted_in_a_child() -> None:
    if INTERPRET:
        pytest.skip("this process interprets the kernel itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-m", "not cuda", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout, run.stdout[-3000:]
    # the interpreted cases ran there: none was skipped for want of the interpreter
    assert "run by test_interpreted_in_a_child" not in run.stdout, run.stdout[-3000:]


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: list[int],
              cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """One row's attention (q (H, D)) over the slots ``seen``, in float64 -> (H*D,)."""
    G = q.shape[0] // keys.shape[0]
    k = keys[:, seen].double().repeat_interleave(G, 0)  # (H, n, D)
    v = values[:, seen].double().repeat_interleave(G, 0)
    s = torch.einsum("hd,hnd->hn", q.double(), k) / D**0.5
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    return torch.einsum("hn,hnd->hd", s.softmax(-1), v).reshape(-1)


def layouts(p: int, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A probe row at position ``p`` with its keys, in three passes: (name, q, keys, values, mask, positions, at,
    seen): a one-token step, a prefill chunk of the rows before it, tree rows whose ancestors sit at scattered
    slots among other tree rows (a committed prefix below them)."""
    gen = torch.Generator().manual_seed(seed)
    kpos = torch.randn(KVH, p + 1, D, generator=gen)
    vpos = torch.randn(KVH, p + 1, D, generator=gen)
    probe = torch.randn(H, D, generator=gen)
    out = []
    # one-token step and a prefill chunk of 9 rows: slots = positions
    for name, rows in (("step", 1), ("prefill", 9)):
        L = p + 1
        rows = min(rows, L)
        pos = torch.arange(L - rows, L)
        mask = torch.arange(L)[None, :] <= pos[:, None]
        q = torch.randn(rows, H, D, generator=gen)
        q[-1] = probe
        out.append((name, q, kpos.clone(), vpos.clone(), mask, pos, rows - 1, list(range(L))))
    # a tree: committed prefix 0..c-1, the probe's ancestors at positions c..p in scattered increasing slots
    c = min(p, 40)
    depth = p - c  # ancestors past the prefix, the probe itself after them
    extra = 12
    L = c + depth + 1 + extra
    tree = torch.randperm(depth + 1 + extra, generator=gen)[: depth + 1].sort().values + c
    seen = list(range(c)) + tree.tolist()
    keys = torch.randn(KVH, L, D, generator=gen)
    values = torch.randn(KVH, L, D, generator=gen)
    keys[:, seen], values[:, seen] = kpos, vpos
    others = [s for s in range(c, L) if s not in seen][:5]  # other tree rows: children of the prefix's last
    trows = sorted(others + [seen[-1]])
    mask = torch.zeros(len(trows), L, dtype=torch.bool)
    pos = torch.zeros(len(trows), dtype=torch.long)
    for i, s in enumerate(trows):
        if s == seen[-1]:
            mask[i, seen] = True
            pos[i] = p
        else:
            mask[i, :c] = True
            mask[i, s] = True
            pos[i] = c
    q = torch.randn(len(trows), H, D, generator=gen)
    at = trows.index(seen[-1])
    q[at] = probe
    out.append(("tree", q, keys, values, mask, pos, at, seen))
    return [(n, q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), m.to(device), ps.to(device), a, s)
            for n, q, k, v, m, ps, a, s in out]  # fmt: skip


def _run(q, keys, values, mask, pos, cap=None, window=None):
    return tree_attention(q, keys, values, tree_keys(mask, pos, q.shape[0], window), cap=cap)


@pytest.mark.parametrize("p", [5, 64, 149])
@interpreted
def test_bit_identical_across_layouts_and_close_to_reference(p: int) -> None:
    got = []
    for name, q, keys, values, mask, pos, at, seen in layouts(p):
        out = _run(q, keys, values, mask, pos)
        got.append(out[at])
        ref = reference(q[at], keys, values, seen)
        torch.testing.assert_close(out[at].double(), ref, atol=2e-6, rtol=1e-5, msg=name)
        for i in range(q.shape[0]):  # every other row too
            torch.testing.assert_close(out[i].double(), reference(q[i], keys, values, mask[i].nonzero()[:, 0].tolist()),
                                       atol=2e-6, rtol=1e-5)  # fmt: skip
    assert all(torch.equal(g, got[0]) for g in got[1:])


@interpreted
def test_whole_prefill_matches_steps() -> None:
    """A causal prefill of 70 positions (two blocks): every row equals that row's one-token step."""
    gen = torch.Generator().manual_seed(3)
    L = 70
    keys, values = torch.randn(KVH, L, D, generator=gen), torch.randn(KVH, L, D, generator=gen)
    q = torch.randn(L, H, D, generator=gen)
    pos = torch.arange(L)
    mask = pos[None, :] <= pos[:, None]
    whole = _run(q, keys, values, mask, pos)
    for r in (0, 1, 63, 64, 69):
        one = _run(q[r : r + 1], keys, values, mask[r : r + 1], pos[r : r + 1])
        assert torch.equal(one[0], whole[r])


@interpreted
def test_gqa_heads_read_their_kv_head() -> None:
    gen = torch.Generator().manual_seed(4)
    L = 20
    keys, values = torch.randn(KVH, L, D, generator=gen), torch.randn(KVH, L, D, generator=gen)
    q = torch.randn(1, H, D, generator=gen)
    pos = torch.tensor([L - 1])
    mask = torch.ones(1, L, dtype=torch.bool)
    out = _run(q, keys, values, mask, pos).view(H, D)
    swapped = _run(q[:, [2, 3, 0, 1]], keys.flip(0), values.flip(0), mask, pos).view(H, D)
    assert torch.equal(out, swapped[[2, 3, 0, 1]])
    torch.testing.assert_close(out.reshape(-1).double(), reference(q[0], keys, values, list(range(L))),
                               atol=2e-6, rtol=1e-5)  # fmt: skip


@interpreted
def test_cap_window_and_bf16() -> None:
    """Soft-capped scores, a sliding window that cuts a block, a bf16 cache: close to the reference, and a row
    equal in a step and in the prefill chunk."""
    p, w = 100, 45
    got = []
    for name, q, keys, values, mask, pos, at, seen in layouts(p, dtype=torch.bfloat16, seed=5)[:2]:
        out = _run(q, keys, values, mask, pos, cap=3.0, window=w)
        got.append(out[at])
        ref = reference(q[at].float(), keys.float(), values.float(), seen[-w:], cap=3.0)
        torch.testing.assert_close(out[at].double(), ref, atol=2e-2, rtol=2e-2, msg=name)
    assert torch.equal(got[0], got[1])


def test_tree_keys_layout() -> None:
    pos = torch.tensor([2, 3])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)
    k = tree_keys(mask, pos, 3)  # a padding row: slot 0
    assert k.idx.tolist() == [0, 1, 2, 0, 1, 2, 4, 0]
    assert k.start.tolist() == [0, 3, 7, 8] and k.first.tolist() == [0, 0, 0]
    w = tree_keys(mask, pos, 2, window=2)
    assert w.idx.tolist() == [1, 2, 2, 4] and w.first.tolist() == [1, 2]


def test_not_ready_off_cuda() -> None:
    assert not tree_attn.ready(torch.device("cpu"))


@pytest.mark.cuda
def test_cuda_invariant_and_close_to_sdpa() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert tree_attn.ready(torch.device("cuda")), tree_attn._error
    for p in (5, 64, 149, 700):
        got = []
        for name, q, keys, values, mask, pos, at, seen in layouts(p, "cuda", torch.bfloat16):
            out = _run(q, keys, values, mask, pos)
            got.append(out[at])
            k = keys[:, seen].repeat_interleave(H // KVH, 0)[None]
            v = values[:, seen].repeat_interleave(H // KVH, 0)[None]
            ref = torch.nn.functional.scaled_dot_product_attention(q[at][None, :, None].float(), k.float(), v.float())
            torch.testing.assert_close(out[at].float(), ref.reshape(-1), atol=2e-2, rtol=2e-2, msg=name)
        assert all(torch.equal(g, got[0]) for g in got[1:])
