"""Group-wise 2/3/4-bit draft weights (``q2``/``q3``/``q4``, :mod:`specexec.formats.groupquant`).

Packing is bit-exact and as small as :mod:`specexec.model.sizes` says; dequantization is within half a step of the
weight; a model in these formats holds exactly the bytes the memory checks count; a self-derived or separate draft
in them leaves greedy output equal to the target's own (exactness does not depend on the draft); the CLI refuses a
bad ``--draft-dtype`` with one line. Tiny random models only.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from specexec import api
from specexec.cli import app
from specexec.config import TreeConfig
from specexec.decoding.engine import Engine
from specexec.formats.groupquant import GroupQuantLinear, dequantize_resident, pack_codes, unpack_codes
from specexec.formats.subset import SubsetHead
from specexec.loading.checkpoint import draft_format, load_model, load_tokenizer, read_config
from specexec.model import sizes
from tests.test_self_draft import _weight_bytes, assert_tree_and_chain_equal_ar

CPU = torch.device("cpu")
PROMPT = [5, 9, 17, 33, 4]
FORMATS = ("q4", "q3", "q2")


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_unpack_round_trip_is_bit_exact(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (7, 192), generator=gen, dtype=torch.uint8)
    codes[0] = (1 << bits) - 1  # all ones: the high bits of every packed word
    codes[1] = 0
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 192 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    # the layout is the documented one: code i of a word at bit bits * i, little-endian bytes
    word = sum(int(codes[2, i]) << (bits * i) for i in range(8))
    assert packed[2, :bits].tolist() == [(word >> (8 * j)) & 0xFF for j in range(bits)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 64), (9, 200), (3, 5)])
def test_dequantized_weight_within_half_a_step(fmt, shape):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[0])[:, None]  # rows of different ranges
    w[0, :] = 0.37  # a constant row: a zero-width range
    q = GroupQuantLinear.quantize(w, fmt)
    deq = q.dequantize()
    assert deq.shape == w.shape and deq.dtype == torch.float32
    groups = -(-shape[1] // sizes.GROUP_SIZE)
    assert q.scale.shape == q.offset.shape == (shape[0], groups)
    assert q.scale.dtype == q.offset.dtype == torch.float16
    step = q.scale.float().repeat_interleave(sizes.GROUP_SIZE, dim=1)[:, : shape[1]]
    err = (deq - w).abs()
    assert (err <= step / 2 + 1e-6 * w.abs() + 1e-9).all(), (err - step / 2).max()
    assert int(q.codes().max()) <= (1 << sizes.GROUP_BITS[fmt]) - 1
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    x = torch.randn(4, shape[1], generator=gen)
    torch.testing.assert_close(q.linear(x), x @ deq.T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_bytes_match_sizes(fmt):
    for out, inp in ((128, 64), (96, 200), (5, 3)):
        q = GroupQuantLinear.quantize(torch.randn(out, inp), fmt)
        assert q.nbytes() == sizes.group_linear_bytes(out, inp, fmt)
    bits = sizes.GROUP_BITS[fmt]
    assert sizes.group_linear_bytes(4096, 4096, fmt) == 4096 * 4096 * (bits / 8 + 4 / 64)


@pytest.mark.parametrize("family", ["qwen2", "llama", "llama_tied"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_weight_bytes_are_exact(tiny_models, family, fmt):
    path = tiny_models[family]
    cfg = read_config(path)
    model = load_model(path, CPU, torch.float32, fmt=fmt)
    assert isinstance(model.layers.layers[0]["w13"], GroupQuantLinear)
    assert isinstance(model.globals.lm_head, GroupQuantLinear) and isinstance(model.globals.embed, torch.Tensor)
    assert _weight_bytes(model) == sizes.model_weight_bytes(cfg, fmt, 4)
    stored = sizes.stored_weights(path)
    assert stored.resident_bytes(4, cfg, fmt) == sizes.model_weight_bytes(cfg, fmt, 4) + stored.largest * 4


def test_fewer_bits_fewer_bytes_and_formats_resolve(tiny_models):
    cfg = read_config(tiny_models["llama"])
    b = {f: sizes.model_weight_bytes(cfg, f, 4) for f in ("dense", "int8", "nf4", *FORMATS)}
    assert b["q2"] < b["q3"] < b["q4"] < b["int8"] < b["dense"]
    assert b["q4"] >= b["nf4"]  # equal bytes a parameter (0.5625); q4 pads partial groups of a row
    for fmt in FORMATS:
        assert draft_format(fmt, "fp32", CPU, cfg, self_draft=True) == (torch.float32, fmt)
        assert draft_format(fmt, "fp32", CPU, cfg) == (torch.float32, fmt)


def test_dequantize_resident_keeps_the_outputs(tiny_models):
    """The bench's shortcut (dequantize once) computes exactly what the per-pass dequantization computes."""
    path = tiny_models["qwen2"]
    low = load_model(path, CPU, torch.float32, fmt="q3")
    dense = load_model(path, CPU, torch.float32, fmt="q3")
    assert dequantize_resident(dense) == 4 * dense.cfg.num_layers + 1
    assert isinstance(dense.globals.lm_head, torch.Tensor)
    t = len(PROMPT)
    tokens, pos = torch.tensor(PROMPT), torch.arange(t)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    a, b = (m.forward(tokens, pos, pos, mask, m.new_cache(t)) for m in (low, dense))
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_low_bit_self_draft_greedy_equals_ar(tiny_models, family, fmt):
    engine = api.load(str(tiny_models[family]), "self", device="cpu", dtype="fp32", draft_dtype=fmt, context=256)
    assert isinstance(engine.draft.layers.layers[0]["wqkv"], GroupQuantLinear) and engine.draft_weights == fmt
    assert_tree_and_chain_equal_ar(engine, 32)


def test_separate_draft_in_q4_with_a_reduced_head(tiny_pair):
    target, draft = tiny_pair
    engine = api.load(str(target), str(draft), device="cpu", dtype="fp32", draft_dtype="q4", context=256)
    assert isinstance(engine.draft.layers.layers[0]["w2"], GroupQuantLinear) and engine.draft_weights == "q4"
    dense = api.load(str(target), str(draft), device="cpu", dtype="fp32", draft_dtype="fp32", context=256)
    assert dense.draft_weights == "float32"
    want = engine.generate(PROMPT, 24, method="ar").tokens
    assert engine.generate(PROMPT, 24, method="specexec", tree=TreeConfig(budget=8)).tokens == want
    sub = load_model(draft, CPU, torch.float32, fmt="q2", head_ids=torch.arange(10))
    assert isinstance(sub.globals.lm_head, SubsetHead) and isinstance(sub.globals.lm_head.sub, GroupQuantLinear)


@pytest.mark.parametrize("value", ["q5", "q1", "int4"])
def test_cli_refuses_a_bad_draft_dtype_in_one_line(value):
    r = CliRunner().invoke(app, ["generate", "--target", "/nonexistent/model", "-p", "hi", "--draft-dtype", value])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert "--draft-dtype must be one of" in lines[0] and "q4, q3, q2" in lines[0], lines[0]


def test_cli_accepts_q2_for_a_self_draft(tiny_models):
    r = CliRunner().invoke(
        app,
        ["generate", "--target", str(tiny_models["llama"]), "--draft", "self", "--draft-dtype", "q2", "--device",
         "cpu", "--dtype", "fp32", "-p", "hi", "-n", "8", "-q"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("fmt", FORMATS)
def test_refined_quantization_lowers_the_error_in_the_same_bytes(fmt):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen) * 0.02
    w[:, ::37] *= 8  # a few outlier columns: min/max ranges are then wasteful at few bits
    rtn, ref = GroupQuantLinear.quantize(w, fmt), GroupQuantLinear.quantize(w, fmt, refine=True)
    err = [((q.dequantize() - w) ** 2).sum(-1) for q in (rtn, ref)]
    assert (err[1] <= err[0] * (1 + 1e-5)).all()  # per row never worse (each group keeps the better choice)
    assert err[1].sum() < 0.95 * err[0].sum()
    assert ref.nbytes() == rtn.nbytes()


def test_refined_self_draft_is_exact(tiny_models):
    path = tiny_models["llama3"]
    target = load_model(path, CPU, torch.float32)
    draft = load_model(path, CPU, torch.float32, fmt="q2", refine=True)
    engine = Engine(target, load_tokenizer(path), draft, context=256)
    want = engine.generate(PROMPT, 32, method="ar").tokens
    assert engine.generate(PROMPT, 32, method="specexec", tree=TreeConfig(budget=8, early_stop=False)).tokens == want
