"""Static-shape (padded) draft passes give the same trees and outputs as eager passes; CUDA graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from specexec.config import ChainConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.loading.checkpoint import load_model, load_tokenizer
from specexec.propose import DraftModel, TreeDraft


def _trees_match(path, device, static_rows=16):
    model = load_model(path, device, torch.float32)
    seq = [5, 6, 7, 8, 9]
    # one growth for both (grow "auto" would pick "captured" levels for the graphed draft on a GPU, "ahead" ones
    # without static passes): the passes differ only in padding
    cfg = TreeConfig.fixed(40, max_beams=16, max_branch=8, max_depth=6, grow="dynamic")
    eager = DraftModel(model, 256, static=False)
    padded = DraftModel(model, 256, static=True, static_rows=static_rows)
    t1, _, beams1, _ = TreeDraft(eager, cfg).grow(seq, cfg)
    t2, _, beams2, _ = TreeDraft(padded, cfg).grow(seq, cfg)
    assert beams1 == beams2
    assert torch.equal(t1.n_tokens, t2.n_tokens) and torch.equal(t1.n_parents, t2.n_parents)
    torch.testing.assert_close(t1.n_logp, t2.n_logp, atol=1e-4, rtol=1e-4)
    # the padding rows never touched real slots: the caches agree on every real slot written
    used = int(t1.draft_slot[: t1.size].max()) + 1
    torch.testing.assert_close(eager.cache.k[:, :, :used], padded.cache.k[:, :, :used], atol=1e-5, rtol=1e-5)


def test_padded_static_passes_match_eager(noisy_pairs):
    _trees_match(noisy_pairs["llama"][1], torch.device("cpu"))


def static_engine(pair: tuple, context: int) -> Engine:
    """A (target, draft) pair on the CPU, the draft on padded static passes of up to 8 rows (eager on a CPU; wider
    levels fall back to plain passes)."""
    target, draft = pair
    cpu = torch.device("cpu")
    return Engine(
        load_model(target, cpu, torch.float32),
        load_tokenizer(target),
        load_model(draft, cpu, torch.float32),
        context=context,
        static_draft=True,
        static_rows=8,
    )


def test_engine_with_static_draft_equals_ar(noisy_pairs):
    e = static_engine(noisy_pairs["qwen2"], 256)  # beams > 8 fall back to eager
    assert e.draft_model.static is not None and e.draft_model.static.max_rows == 8
    ref = e.generate([5, 6, 7], 40, method="ar").tokens
    for tree in (TreeConfig.fixed(16, max_beams=8), TreeConfig.fixed(64, max_beams=32)):
        e.reset()
        assert e.generate([5, 6, 7], 40, method="specexec", tree=tree).tokens == ref
    e.reset()
    assert e.generate([5, 6, 7], 40, method="chain", chain=ChainConfig(gamma=3)).tokens == ref


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_passes_match_eager(noisy_pairs):
    _trees_match(noisy_pairs["llama"][1], torch.device("cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_engine_specexec_equals_ar(noisy_pairs, family):
    """On the GPU (graphed draft passes, fp32) speculative methods still reproduce AR exactly."""
    target, draft = noisy_pairs[family]
    cuda = torch.device("cuda")
    e = Engine(
        load_model(target, cuda, torch.float32),
        load_tokenizer(target),
        load_model(draft, cuda, torch.float32),
        context=256,
    )
    assert e.draft_model.static is not None and e.draft_model.static.use_graphs
    ref = e.generate([5, 6, 7], 40, method="ar").tokens
    for tree in (TreeConfig.fixed(16), TreeConfig.fixed(200, max_beams=64), TreeConfig(budget=64, auto=True)):
        e.reset()
        assert e.generate([5, 6, 7], 40, method="specexec", tree=tree).tokens == ref
    e.reset()
    assert e.generate([5, 6, 7], 40, method="chain", chain=ChainConfig(gamma=4)).tokens == ref
