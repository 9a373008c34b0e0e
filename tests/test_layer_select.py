"""A partial self-derived draft (``draft_layers``): the spec, the choice by block influence, loading a subset of
layers, exactness and sizes through ``api.load``, and the CLI's one-line errors.

The model used here has one *identity* layer (its attention output and MLP down projections are zero, so the
residual stream leaves it unchanged): its block influence is exactly 0, a choice by influence must skip it first,
and a model without it must compute exactly what the whole model computes -- which checks that a skipped layer is
really skipped (the residual passes through) and that the kept layers keep their own weights.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from specexec import api
from specexec.cli import app
from specexec.config import ChainConfig, TreeConfig
from specexec.errors import ConfigError
from specexec.loading import layer_select
from specexec.loading.checkpoint import load_model, read_config
from specexec.loading.layer_select import LayerSpec, parse
from specexec.model import sizes
from tests.conftest import make_tiny
from tests.test_self_draft import _weight_bytes, assert_tree_and_chain_equal_ar, spy_check_engine

CPU = torch.device("cpu")
PROMPT = [5, 9, 17, 33, 4]
LAYERS = 6
IDENTITY = 3  # the layer whose output projections are zero


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """A 6-layer qwen2-shaped tiny model whose layer 3 is the identity."""
    from safetensors.torch import load_file, save_file

    path = make_tiny(tmp_path_factory.mktemp("six") / "m", "qwen2", seed=7, layers=LAYERS)
    f = path / "model.safetensors"
    sd = load_file(f)
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        sd[f"model.layers.{IDENTITY}.{name}"].zero_()
    save_file(sd, f, metadata={"format": "pt"})
    return path


def _logits(model, tokens=PROMPT) -> torch.Tensor:
    T = len(tokens)
    pos = torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return model.forward(torch.tensor(tokens), pos, pos, mask, model.new_cache(T))


# ---------------------------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    "spec, want",
    [
        (None, LayerSpec()),
        ("all", LayerSpec()),
        (" ALL ", LayerSpec()),
        ("0.5", LayerSpec(count=40)),
        ("50%", LayerSpec(count=40)),
        ("0.25", LayerSpec(count=20)),
        ("1.0", LayerSpec()),
        ("0.001", LayerSpec(count=layer_select.MIN_KEPT)),
        ("40", LayerSpec(count=40)),
        ("80", LayerSpec()),
        ("0-3,7", LayerSpec(indices=(0, 1, 2, 3, 7))),
        ("7,0-3", LayerSpec(indices=(0, 1, 2, 3, 7))),
        ("5,", LayerSpec(indices=(5,))),
        ("0-79", LayerSpec()),
    ],
)
def test_parse(spec, want):
    assert parse(spec, 80) == want


@pytest.mark.parametrize(
    "spec, why",
    [
        ("lots", "not a number"),
        ("0", "must be in 1..80"),
        ("81", "must be in 1..80"),
        ("1.5", "in (0, 1]"),
        ("0%", "in (0, 1]"),
        ("0-80", "outside the target's layers 0-79"),
        ("5-3", "outside"),
        ("a-b", "not an index or a range"),
    ],
)
def test_parse_refuses(spec, why):
    with pytest.raises(ConfigError, match="draft_layers") as e:
        parse(spec, 80)
    assert why in str(e.value)


def test_kept_counts_before_anything_runs():
    assert parse("0.5", 28).kept(28) == 14
    assert parse("0-3,9", 28).kept(28) == 5
    assert parse(None, 28).kept(28) == 28


def test_by_influence_keeps_the_most_influential_in_order():
    assert layer_select.by_influence([0.9, 0.1, 0.5, 0.05, 0.5, 0.3], 3) == [0, 2, 4]  # tie 2/4: both kept
    assert layer_select.by_influence([0.9, 0.1, 0.5, 0.05, 0.5, 0.3], 2) == [0, 2]  # tie: the earlier one


# ---------------------------------------------------------------------------------------------- influence, loading


def test_an_identity_layer_has_no_influence_and_is_skipped_first(six):
    model = load_model(six, CPU, torch.float32)
    bi = layer_select.block_influence(model, list(range(3, 40)))
    assert len(bi) == LAYERS
    assert bi[IDENTITY] == pytest.approx(0.0, abs=1e-6)
    assert all(b > 1e-3 for i, b in enumerate(bi) if i != IDENTITY)
    kept = layer_select.choose(model, LAYERS - 1, lambda text: list(range(3, 40)))
    assert kept == [i for i in range(LAYERS) if i != IDENTITY]


def test_skipping_a_layer_passes_the_residual_through(six):
    full = load_model(six, CPU, torch.float32)
    without_identity = load_model(six, CPU, torch.float32, keep_layers=[0, 1, 2, 4, 5])
    without_other = load_model(six, CPU, torch.float32, keep_layers=[0, 1, 3, 4, 5])
    assert without_identity.cfg.num_layers == 5 and without_identity.new_cache(8).k.shape[0] == 5
    torch.testing.assert_close(_logits(without_identity), _logits(full), rtol=0, atol=1e-5)
    assert (_logits(without_other) - _logits(full)).abs().max() > 1e-2  # a real layer does matter


def test_keep_layers_must_be_ascending_and_in_range(six):
    for bad in ([], [2, 1], [0, 0], [6], [-1]):
        with pytest.raises(ValueError, match="keep_layers"):
            load_model(six, CPU, torch.float32, keep_layers=bad)


def test_low_bit_partial_weight_bytes_are_exact(six):
    model = load_model(six, CPU, torch.float32, fmt="int8", keep_layers=[0, 2, 5])
    cfg = read_config(six)
    assert _weight_bytes(model) == sizes.model_weight_bytes(
        cfg.__class__(**{**cfg.__dict__, "num_layers": 3}), "int8", 4
    )


# ---------------------------------------------------------------------------------------------- api.load


def _engine(path, layers, fmt="int8"):
    return api.load(
        str(path), "self", device="cpu", dtype="fp32", draft_dtype=fmt, context=256, tree=TreeConfig(budget=8),
        draft_layers=layers,
    )  # fmt: skip


@pytest.mark.parametrize("layers, kept", [("0.5", 3), ("5", [0, 1, 2, 4, 5]), ("0-1,5", [0, 1, 5])])
def test_partial_self_draft_greedy_equals_ar(six, layers, kept):
    engine = _engine(six, layers)
    d = engine.draft_model
    assert d is not None
    n = kept if isinstance(kept, int) else len(kept)
    assert d.model.cfg.num_layers == n and len(d.model.layers.layers) == n
    assert d.cache.k.shape[0] == n  # the draft's KV cache holds the kept layers only
    if not isinstance(kept, int):  # the kept layers are the target's own (up to int8)
        for j, i in enumerate(kept):
            dense = engine.target.layers.layers[i]["w2"]
            deq = d.model.layers.layers[j]["w2"].dequantize(torch.float32)
            assert (deq - dense).abs().max() <= 0.05 * dense.abs().max() + 1e-6
    assert_tree_and_chain_equal_ar(engine, 30)


def test_a_fraction_skips_the_identity_layer_and_keeps_the_target_exactly(six):
    """5 of 6 by influence drops the identity layer: the int8 draft is then as good as the whole int8 target."""
    part = _engine(six, "5")
    assert part.draft_model is not None and part.draft_model.model.cfg.num_layers == 5
    whole = _engine(six, None)
    for e in (part, whole):
        e.generate(PROMPT, 30, method="specexec", tree=TreeConfig(budget=8, early_stop=False))
    a = part.generate(PROMPT, 30, method="chain", chain=ChainConfig(gamma=4)).stats
    b = whole.generate(PROMPT, 30, method="chain", chain=ChainConfig(gamma=4)).stats
    assert a.steps == b.steps


def test_load_charges_the_partial_draft(six, monkeypatch):
    seen = spy_check_engine(monkeypatch)
    _engine(six, "0-1,5")
    part = replace(read_config(six), num_layers=3)
    assert seen["draft_cfg"] == part  # its KV cache and buffers are sized for 3 layers
    assert seen["draft_weights"] == sizes.model_weight_bytes(part, "int8", 4) + sizes.stored_weights(six).largest * 4


def test_load_refuses_layers_without_a_self_draft_or_out_of_range(six, tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(ConfigError, match="only a self-derived draft"):
        api.load(str(target), str(draft), device="cpu", dtype="fp32", context=64, draft_layers="1")
    with pytest.raises(ConfigError, match="outside the target's layers 0-5"):
        _engine(six, "0-6")


# ---------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft-layers", "0.5"], "error: --draft-layers 0.5: only a self-derived draft (--draft self) skips layers"),
        (["--draft", "self", "--draft-layers", "half"], "error: --draft-layers half: not a number; expected all"),
        (["--draft", "self", "--draft-layers", "2.5"], "error: --draft-layers 2.5: a fraction must be in (0, 1];"),
    ],
)
def test_cli_bad_draft_layers_is_one_line_before_loading(monkeypatch, extra, message):
    def forbidden(*args, **kwargs):
        raise AssertionError("a model was resolved or loaded before the options were validated")

    import specexec.loading.hub

    monkeypatch.setattr(api, "load", forbidden)
    monkeypatch.setattr(specexec.loading.hub, "resolve", forbidden)
    for command in ("generate", "chat", "serve", "bench"):
        cmd = [command, "--target", "/nonexistent", "--device", "cpu", "-q", *extra]
        if command == "generate":
            cmd += ["-p", "hello"]
        result = CliRunner().invoke(app, cmd)
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in result.output, (command, lines)
        assert lines[0].startswith(message), (command, lines[0])


def test_cli_generate_with_a_partial_self_draft(six, tiny_models):
    from tests.test_chat import make_chat_pair

    target, _ = make_chat_pair(tiny_models["llama"].parent.parent / "partial-cli")
    result = CliRunner().invoke(
        app,
        ["generate", "--target", str(target), "--draft", "self", "--draft-layers", "1", "--device", "cpu", "-q",
         "-p", "t10 t11", "-n", "8", "--budget", "4", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["stats"]["method"] == "specexec", out
    bad = CliRunner().invoke(
        app,
        ["generate", "--target", str(target), "--draft", "self", "--draft-layers", "0-7", "--device", "cpu", "-q",
         "-p", "t10 t11", "-n", "8"],
    )  # fmt: skip
    assert bad.exit_code == 2, bad.output
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "outside the target's layers 0-1" in lines[0], lines
