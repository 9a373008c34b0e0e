"""Shape-invariant target passes: a position's logits are bit-identical in a one-token step, a prefill, and at any
row of a tree of any size (the property that makes greedy speculation reproduce plain decoding token for token)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specexec.formats.dense import Tiling, tiled_linear
from specexec.loading import invariance
from specexec.loading.checkpoint import load_model
from specexec.model import attention, transformer
from tests.conftest import FAMILIES

CPU = torch.device("cpu")


def _ar_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(len(ids) + 8)
    out = []
    for i in range(len(ids)):
        p = torch.tensor([i], device=model.device)
        one = torch.ones(1, i + 1, dtype=torch.bool, device=model.device)
        out.append(model.forward(ids[i : i + 1].to(model.device), p, p, one, cache))
    return torch.cat(out)


def _tree_pass(model, ids: torch.Tensor, n0: int, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Prefill ids[:n0], then one pass of ``rows`` tree rows in which ids[n0:] form a path (at random rows, among
    random siblings and distractor branches). Returns (the pass's logits, the path's row indices)."""
    cache = model.new_cache(n0 + rows + 8)
    dev = model.device
    pre = torch.arange(n0, device=dev)
    model.forward(ids[:n0].to(dev), pre, pre, pre[None, :] <= pre[:, None], cache)
    k = len(ids) - n0
    path = sorted(torch.randperm(rows - 1, generator=gen)[: k - 1].add(1).tolist())
    path = [0, *path]
    tokens = torch.randint(3, model.cfg.vocab_size, (rows,), generator=gen)
    parent = [-1] * rows
    on_path = {r: j for j, r in enumerate(path)}
    for r in range(1, rows):
        if r in on_path:
            parent[r] = path[on_path[r] - 1]
        else:
            parent[r] = int(torch.randint(0, r, (1,), generator=gen))
    for j, r in enumerate(path):
        tokens[r] = ids[n0 + j]
    anc = torch.zeros(rows, rows, dtype=torch.bool)
    depth = torch.zeros(rows, dtype=torch.long)
    for r in range(rows):
        anc[r, r] = True
        if parent[r] >= 0:
            anc[r] |= anc[parent[r]]
            depth[r] = depth[parent[r]] + 1
    mask = torch.cat([torch.ones(rows, n0, dtype=torch.bool), anc], dim=1)
    slots = n0 + torch.arange(rows)
    logits = model.forward(tokens.to(dev), (n0 + depth).to(dev), slots.to(dev), mask.to(dev), cache)
    return logits, path


@pytest.fixture(params=["native", "blocked"])
def cpu_attention(request, monkeypatch):
    """The invariant passes' attention on a CPU: the C kernel where it builds (``native``), or the torch
    ``blocked`` one every other device runs and a CPU keeps without a C compiler."""
    if request.param == "blocked":
        monkeypatch.setattr(transformer, "native_ready", lambda device, dtype: False)
    elif not attention.native_ready(CPU, torch.float32):
        pytest.skip("the CPU kernels do not build here")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_position_has_the_same_logits_in_every_pass(tiny_models, family, dtype, cpu_attention):
    model = load_model(tiny_models[family], CPU, dtype)
    choice = invariance.apply(model)
    assert choice is not None and model.tiling is not None, choice
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (40,), generator=gen)
    ar = _ar_logits(model, ids)
    cache = model.new_cache(48)
    pos = torch.arange(len(ids))
    prefill = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], cache)
    assert torch.equal(prefill, ar)
    last = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(48), logits_rows=slice(-1, None))
    assert torch.equal(last[0], ar[-1])
    for n0, rows in ((30, 10), (25, 37), (33, 7), (20, 64)):
        logits, path = _tree_pass(model, ids, n0, rows, gen)
        assert torch.equal(logits[path], ar[n0 : n0 + len(path)]), (n0, rows)


def test_a_pass_larger_than_the_checked_size_runs_as_consecutive_passes(tiny_models):
    model = load_model(tiny_models["qwen2"], CPU, torch.float32)
    invariance.apply(model)
    assert model.tiling is not None
    ids = torch.randint(3, model.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    ar = _ar_logits(model, ids)
    model.tiling = Tiling(**{**model.tiling.__dict__, "max_rows": max(model.tiling.rows, 8)})
    pos = torch.arange(len(ids))
    out = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(64))
    assert torch.equal(out, ar)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_attention_in_row_chunks_gives_the_same_bits(tiny_models, monkeypatch, family):
    """A big pass's attention runs in chunks of row tiles (bounded memory); a row's logits do not depend on it (also
    in sliding layers, whose rows gather their whole window)."""
    monkeypatch.setattr(transformer, "native_ready", lambda device, dtype: False)
    model = load_model(tiny_models[family], CPU, torch.float32)
    invariance.apply(model)
    ids = torch.randint(3, model.cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(len(ids))
    whole = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(96))
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 1)  # one row tile a chunk
    chunked = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(96))
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window, cap, scale", [(None, None, None), (6, 2.0, 0.3)])
def test_native_attention_is_the_blocked_one_up_to_rounding(dtype, window, cap, scale):
    """The C kernel computes what the torch invariant attention does (causal rows and a tree's rows over a prefix,
    sliding windows, soft-capping, a given scale), up to the order of fp32 sums."""
    if not attention.native_ready(CPU, dtype):
        pytest.skip("the CPU kernels do not build here")
    gen = torch.Generator().manual_seed(4)
    H, KVH, hd, n0 = 6, 2, 24, 21
    keys, values = (torch.randn(KVH, 64, hd, generator=gen).to(dtype) for _ in range(2))
    parent = [-1, 0, 0, 1, 3, 2, 5, 1]  # tree rows at slots n0.., each under its parent
    depth = [0, 1, 1, 2, 3, 2, 3, 2]
    tree = torch.zeros(len(parent), len(parent), dtype=torch.bool)
    for r, p in enumerate(parent):
        tree[r, r] = True
        if p >= 0:
            tree[r] |= tree[p]
    causal = torch.arange(n0)[None, :] <= torch.arange(n0)[:, None]
    masks = {
        "prefill": (torch.cat((causal, torch.zeros(n0, 64 - n0, dtype=torch.bool)), 1), torch.arange(n0)),
        "tree": (torch.cat((torch.ones(8, n0, dtype=torch.bool), tree, torch.zeros(8, 64 - n0 - 8, dtype=torch.bool)),
                           1), n0 + torch.tensor(depth)),
    }  # fmt: skip
    for name, (mask, pos) in masks.items():
        T = mask.shape[0]
        q = torch.randn(T, H, hd, generator=gen).to(dtype)
        got = attention.native(q, keys, values, attention.row_keys(mask, pos, T, window), scale, cap)
        plan = attention.plan_keys(mask, pos, T, 8, 1, window)
        want = attention.blocked(q, keys, values, plan, scale, cap)
        assert got.dtype == dtype and got.shape == (T, H * hd)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), name
        for r in (0, T - 1, T // 2):  # a row alone gets the same bits
            alone = attention.native(q[r : r + 1], keys, values, attention.row_keys(mask[r : r + 1], pos[r : r + 1], 1,
                                     window), scale, cap)  # fmt: skip
            assert torch.equal(alone, got[r : r + 1]), (name, r)


class _ShapeDependent:
    """A weight whose kernel rounds differently for passes that are not a whole number of 4-row tiles (what a BLAS
    with a one-row and an edge kernel does)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def linear(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if x.shape[0] % 4:
            return (x.double() @ self.w.double().T).float()
        return F.linear(x, self.w)


def test_the_check_finds_the_tile_a_shape_dependent_kernel_needs():
    w = torch.randn(96, 64)
    x = torch.randn(12, 64)  # a whole number of 4-row tiles: the other kernel than one row gets
    weird = _ShapeDependent(w)
    untiled = Tiling(rows=1, max_rows=16)
    assert not torch.equal(tiled_linear(x, weird, untiled)[:1], tiled_linear(x[:1], weird, untiled))
    for rows, ok in ((1, False), (2, False), (4, True), (8, True)):
        t = Tiling(rows=rows, max_rows=16)
        assert invariance.linear_invariant([(96, 64)], torch.float32, CPU, t, weight=_ShapeDependent) is ok
        if ok:
            assert torch.equal(tiled_linear(x, weird, t)[5], tiled_linear(x[5:6], weird, t)[0])


def test_the_choice_is_cached_for_real_sized_models(tmp_path, monkeypatch):
    from specexec.model.transformer import ModelConfig

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=64)  # fmt: skip
    calls = []
    real = invariance.find
    monkeypatch.setattr(invariance, "find", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = invariance.choose(cfg, torch.float32, CPU)
    assert first.get() is not None and (tmp_path / invariance.CACHE_FILE).exists()
    assert invariance.choose(cfg, torch.float32, CPU) == first and len(calls) == 1


def test_no_invariant_way_leaves_the_fast_kernels_and_warns(tiny_models, caplog):
    model = load_model(tiny_models["llama"], CPU, torch.float32)
    none = invariance.Choice("k", None, note="kernels disagree")
    with caplog.at_level("WARNING"):
        assert invariance.apply(model, check=lambda *a, **k: none) is none
    assert model.tiling is None and "kernels disagree" in caplog.text
    invariance.apply(model)
    assert model.tiling is not None
    assert invariance.apply(model, on=False) is None and model.tiling is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_passes_are_invariant(tiny_models, dtype):
    dev = torch.device("cuda")
    model = load_model(tiny_models["llama3"], dev, dtype)
    choice = invariance.apply(model)
    assert model.tiling is not None, choice
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (40,), generator=gen).to(dev)
    ar = _ar_logits(model, ids)
    for n0, rows in ((30, 10), (20, 64)):
        logits, path = _tree_pass(model, ids.cpu(), n0, rows, gen)
        assert torch.equal(logits[path].cpu(), ar[n0 : n0 + len(path)].cpu())


def test_a_check_that_runs_out_of_gpu_memory_leaves_the_fast_kernels_uncached(tmp_path, monkeypatch):
    from specexec.model.transformer import ModelConfig

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=64)  # fmt: skip

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(invariance, "find", oom)
    choice = invariance.choose(cfg, torch.float16, CPU)
    assert choice.get() is None and "memory" in choice.note
    assert not (tmp_path / invariance.CACHE_FILE).exists()
