"""A CPU target in 4-bit weights (our C kernel): the format, exactness relative to the 4-bit target, the errors.

Each output element of the kernel is one thread's fixed sequence of operations, so a row's result does not depend
on the pass it is in; every method's greedy output is then the 4-bit target's plain greedy decoding.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from offload.plan import OffloadConfig
from specexec import api
from specexec.cli import app
from specexec.errors import ConfigError
from specexec.formats import native, q4
from specexec.loading import invariance
from specexec.loading.checkpoint import load_model, read_config
from specexec.model.sizes import model_weight_bytes
from tests.conftest import FAMILIES, assert_methods_equal_ar
from tests.loading.test_int8_target import LOW_BIT_METHODS
from tests.model.test_invariance import _ar_logits, _tree_pass

CPU = torch.device("cpu")
PROMPTS = ([5, 9, 17, 33, 4], [3, 60, 61, 62, 63, 12, 40])
Q4 = OffloadConfig(target_dtype="q4")

pytestmark = pytest.mark.skipif(q4.available() is not None, reason=str(q4.available()))


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("k", [96, 64, 128, 256, 896])  # super-blocks of 1, 2, 4, 8 and 4 sub-blocks
def test_blocks_hold_the_weight_to_within_half_a_step(k):
    w = _weight(k=k)
    q = q4.Q4Linear(w)
    ns = q4.sub_blocks(k)
    assert ns == {96: 1, 64: 2, 128: 4, 256: 8, 896: 4}[k]
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (96, k // (32 * ns) * (4 + 18 * ns))
    assert q.nbytes() == 96 * q4.row_bytes(k)
    deq = q.dequantize()
    sub = w.reshape(96, -1, ns, 32)
    lo, step = sub.amin(-1), (sub.amax(-1) - sub.amin(-1)) / 15
    # the step grows by at most one unit of the super-block's scale and its minimum's rounding, spread over 15
    slack = step.amax(-1, keepdim=True) / 255 + lo.abs().amax(-1, keepdim=True) / 127 / 15
    bound = (step + slack) * 0.5 * 1.01 + 1e-7
    assert ((deq - w).abs().reshape(96, -1, ns, 32) <= bound[..., None]).all()
    ids = torch.tensor([5, 0, 95])
    assert torch.equal(q.rows(ids), deq[ids])
    assert torch.equal(q.subset(ids).dequantize(), deq[ids])
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    full = q.linear(x)
    assert (full - x @ deq.T).norm() / (x @ deq.T).norm() < 0.02
    assert torch.equal(q.linear(x[4:5]), full[4:5]) and torch.equal(q.linear(x[1:7]), full[1:7])


def test_flat_and_zero_blocks_keep_their_values():
    w = torch.zeros(4, 256)
    w[1] = 0.25
    w[2, :32] = -1e-6
    assert torch.equal(q4.Q4Linear(w).dequantize()[[0, 3]], w[[0, 3]])
    assert torch.allclose(q4.Q4Linear(w).dequantize(), w, atol=1e-6, rtol=1e-3)


def test_the_product_is_the_dequantized_one_up_to_8_bit_activations():
    w, x = _weight(), torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    q = q4.Q4Linear(w)
    ref = x @ q.dequantize().T
    got = q.linear(x)
    assert got.shape == (7, 96) and got.dtype == torch.float32
    assert (got - ref).norm() / ref.norm() < 0.02
    assert q.linear(x.bfloat16()).dtype == torch.bfloat16


def test_a_row_gets_the_same_bits_in_any_pass_and_on_any_thread_count():
    w, x = _weight(200, 512), torch.randn(70, 512, generator=torch.Generator().manual_seed(2))
    q = q4.Q4Linear(w)
    full = q.linear(x)
    for start, n in ((0, 1), (3, 1), (5, 2), (9, 3), (10, 5), (0, 37), (33, 37)):
        assert torch.equal(q.linear(x[start : start + n]), full[start : start + n]), (start, n)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if old > 1 else 2)
        assert torch.equal(q.linear(x), full)
    finally:
        torch.set_num_threads(old)


def _reference(q: q4.Q4Linear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's definition in torch: x's rows quantized to int8 per super-block, each super-block's exact
    integer sums (sub-scales times the dot products; sub-minimums times the activation sums), then per output
    acc += (d * xd) * isum, macc += (dmin * xd) * imin over the super-blocks in order, in fp32, result acc + macc."""
    (n, k), ns = q.shape, q.ns
    nsb = k // (32 * ns)
    b = q.packed.reshape(n, nsb, 4 + 18 * ns)
    dm = b[..., :4].contiguous().view(torch.float16).float()  # (n, nsb, 2)
    sc = b[..., 4 : 4 + ns].long()
    mn = b[..., 4 + ns : 4 + 2 * ns].contiguous().view(torch.int8).long()
    nib = b[..., 4 + 2 * ns :]
    if ns == 1:
        qv = torch.cat((nib & 15, nib >> 4), -1).reshape(n, nsb, 1, 32)
    else:
        pairs = nib.reshape(n, nsb, ns // 2, 1, 32)
        qv = torch.cat((pairs & 15, pairs >> 4), -2).reshape(n, nsb, ns, 32)
    xr = x.float().reshape(-1, nsb, ns, 32)
    dx = xr.abs().amax((-1, -2)) / 127  # (rows, nsb)
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    qa = torch.round(xr * inv[..., None, None]).long()  # (rows, nsb, ns, 32)
    dots = torch.einsum("osji,rsji->rosj", qv.long(), qa)  # exact: int64
    isum = (dots * sc[None]).sum(-1)  # (rows, n, nsb)
    imin = (qa.sum(-1)[:, None] * mn[None]).sum(-1)
    acc = torch.zeros(x.shape[0], n)
    macc = torch.zeros(x.shape[0], n)
    for s in range(nsb):
        xd = dx[:, s, None]
        acc = acc + (dm[None, :, s, 0] * xd) * isum[..., s].float()
        macc = macc + (dm[None, :, s, 1] * xd) * imin[..., s].float()
    return acc + macc


@pytest.mark.parametrize("k", [96, 64, 128, 256, 896])  # every kind of super-block and so every kernel path
def test_the_kernel_computes_its_integer_definition_bit_for_bit(k):
    """Whatever path a row count takes (one row, a group of rows, the vector or scalar code), every output is the
    same function of exact integers: the reference in torch gets the same bits."""
    q = q4.Q4Linear(_weight(40, k, seed=k))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(k)) * 3
    x[4] = 0  # a zero row: scale 0
    want = _reference(q, x)
    for a, b in ((0, 19), (0, 1), (7, 8), (3, 5), (11, 19), (0, 3), (0, 4), (1, 6), (2, 8), (0, 7), (2, 13)):
        assert torch.equal(q.linear(x[a:b]), want[a:b]), (k, a, b)


def test_gathered_weights_share_one_huge_page_aligned_block_and_compute_the_same():
    ws = [q4.Q4Linear(_weight(n, 1024, seed=i)) for i, n in enumerate((2000, 1500, 3000))]
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5))
    before = [w.linear(x) for w in ws]
    q4.gather(ws + ws[:1])  # a weight named twice moves once
    ptrs = [w.packed.data_ptr() for w in ws]
    assert ptrs[0] % q4.HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert len({w.packed.untyped_storage().data_ptr() for w in ws}) == 1
    assert all(torch.equal(w.linear(x), b) for w, b in zip(ws, before))


def test_a_loaded_q4_model_keeps_its_weights_in_one_block(tiny_models):
    model = load_model(tiny_models["qwen2"], CPU, torch.float32, fmt="q4")
    storages = {w.packed.untyped_storage().data_ptr() for w in _weights(model) if isinstance(w, q4.Q4Linear)}
    assert len(storages) == 1


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.Q4Linear(torch.zeros(4, 48))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_q4_target_gives_a_position_the_same_logits_in_every_pass(tiny_models, family):
    model = load_model(tiny_models[family], CPU, torch.float32, fmt="q4")
    assert isinstance(model.globals.lm_head, q4.Q4Linear)
    choice = invariance.apply(model)
    assert choice is not None and model.tiling is not None and "q4 weights" in choice.key, choice
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (40,), generator=gen)
    ar = _ar_logits(model, ids)
    pos = torch.arange(len(ids))
    assert torch.equal(model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(48)), ar)
    for n0, rows in ((30, 10), (25, 37), (20, 64)):
        logits, path = _tree_pass(model, ids, n0, rows, gen)
        assert torch.equal(logits[path], ar[n0 : n0 + len(path)]), (n0, rows)


def test_q4_logits_are_close_to_the_dense_ones_and_the_size_is_planned_exactly(tiny_models):
    path = tiny_models["qwen2"]
    dense = load_model(path, CPU, torch.float32)
    q = load_model(path, CPU, torch.float32, fmt="q4")
    ids = torch.arange(3, 23)
    pos = torch.arange(20)
    mask = pos[None, :] <= pos[:, None]
    a = dense.forward(ids, pos, pos, mask, dense.new_cache(20))
    b = q.forward(ids, pos, pos, mask, q.new_cache(20))
    assert not torch.equal(a, b)  # it is another model: the quantized one
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9, (a - b).norm() / a.norm()
    held = sum(w.nbytes() if isinstance(w, q4.Q4Linear) else w.numel() * 4 for w in _weights(q))
    assert held == model_weight_bytes(read_config(path), "q4", 4)


def _weights(model):
    g = model.globals
    seen = {id(g.lm_head): g.lm_head, id(g.embed): g.embed, id(g.norm): g.norm}
    for i in range(model.cfg.num_layers):
        for w in model.layers.layer(i).values():
            seen[id(w)] = w
    return seen.values()


@pytest.fixture(scope="module")
def q4_engines(noisy_pairs):
    return {
        f: api.load(str(noisy_pairs[f][0]), str(noisy_pairs[f][1]), device="cpu", offload=Q4, context=256,
                    progress=False)
        for f in ("llama", "qwen2", "llama_tied", "gemma2")
    }  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_tied", "gemma2"])
def test_q4_target_greedy_speculation_equals_its_ar(q4_engines, family):
    e = q4_engines[family]
    assert e.target_weights == "q4" and e.target.dtype == torch.float32
    assert isinstance(e.target.layers.layer(0)["w13"], q4.Q4Linear)
    assert_methods_equal_ar(e, PROMPTS, LOW_BIT_METHODS)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(dtype="bf16", offload=Q4), "dtype"),
        (dict(offload=OffloadConfig(mode="ram", target_dtype="q4")), "target_dtype"),
    ],
)
def test_q4_target_refuses_what_it_cannot_be(tiny_pair, kw, field):
    with pytest.raises(ConfigError, match=field):
        api.load(str(tiny_pair[0]), device="cpu", progress=False, context=64, **kw)


def test_without_a_compiler_q4_is_one_clear_error(tiny_pair, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_why_not", None)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert "no C compiler" in str(q4.available())
    r = CliRunner().invoke(
        app,
        ["generate", "--target", str(tiny_pair[0]), "--device", "cpu", "-q", "-p", "t1", "--target-dtype", "q4"],
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "no C compiler" in lines[0], r.output


def test_cli_q4_target_generates(tiny_pair):
    r = CliRunner().invoke(
        app,
        ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu", "-q", "-p",
         "t10 t11", "-n", "6", "--target-dtype", "q4"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()


def _q4_k_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF Q4_K rows (n, k / 256 * 144) uint8: any bytes for the packed 6-bit scales and the nibbles, and
    positive fp16 d and dmin of a real model's size."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // 256, q4.Q4_K_BYTES), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 256, 2, generator=g) * 1e-3 + 1e-5).half()
    b[..., :4] = scale.view(torch.uint8)
    return b.reshape(n, -1)


@pytest.mark.parametrize("k", [256, 1536])
def test_q4_k_blocks_repack_losslessly_into_the_kernels_format(k):
    """The file's Q4_K values are the kernel's: every value unpacked from the repacked rows equals the ``gguf``
    package's dequantization of the file's blocks bit for bit, and the product is the kernel's integer definition."""
    from gguf import GGMLQuantizationType, quants

    blocks = _q4_k_blocks(24, k, seed=k)
    want = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q4_K)).reshape(24, k)
    w = q4.Q4Linear.from_blocks(q4.from_q4_k(blocks, k), (24, k))
    assert torch.equal(w.dequantize(), want)
    assert w.nbytes() == 24 * q4.row_bytes(k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    assert torch.equal(w.linear(x), _reference(w, x))
    assert torch.equal(w.linear(x[2:3]), w.linear(x)[2:3])


def test_q4_k_rows_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        q4.from_q4_k(torch.zeros(2, 144, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="do not hold"):
        q4.Q4Linear.from_blocks(torch.zeros(2, 10, dtype=torch.uint8), (2, 256))
