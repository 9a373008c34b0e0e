"""A CPU target in int8 weights: exactness relative to the int8 target, the probe's choice, the errors.

The target's linears run torch's weight-only ``int8pack`` kernel on bf16 activations; its passes are
shape-invariant (checked per machine), so every method's greedy output is the int8 target's plain greedy decoding
token for token.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from offload.plan import OffloadConfig
from specexec import api
from specexec.cli import app
from specexec.config import ChainConfig, TreeConfig
from specexec.errors import ConfigError
from specexec.formats.int8 import Int8Linear
from specexec.loading import cpu_probe, invariance
from specexec.loading.checkpoint import load_model
from specexec.model.transformer import ModelConfig
from tests.conftest import FAMILIES, assert_methods_equal_ar
from tests.model.test_invariance import _ar_logits, _tree_pass

CPU = torch.device("cpu")
PROMPTS = ([5, 9, 17, 33, 4], [3, 60, 61, 62, 63, 12, 40])
INT8 = OffloadConfig(target_dtype="int8")
LOW_BIT_METHODS = (  # every method a low-bit CPU target's greedy AR is checked against
    dict(method="specexec", tree=TreeConfig.fixed(16)),
    dict(method="specexec", tree=TreeConfig.fixed(48)),
    dict(method="chain", chain=ChainConfig(gamma=4)),
    dict(method="ngram"),
    dict(),  # the default: the measured policy
)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_int8_target_gives_a_position_the_same_logits_in_every_pass(tiny_models, family):
    model = load_model(tiny_models[family], CPU, torch.bfloat16, fmt="int8", int8_kernel="int8pack")
    assert isinstance(model.globals.lm_head, Int8Linear) and model.globals.lm_head.kernel == "int8pack"
    choice = invariance.apply(model)
    assert choice is not None and model.tiling is not None and "int8 weights" in choice.key, choice
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (40,), generator=gen)
    ar = _ar_logits(model, ids)
    pos = torch.arange(len(ids))
    assert torch.equal(model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(48)), ar)
    for n0, rows in ((30, 10), (25, 37), (20, 64)):
        logits, path = _tree_pass(model, ids, n0, rows, gen)
        assert torch.equal(logits[path], ar[n0 : n0 + len(path)]), (n0, rows)


def test_int8_target_logits_are_close_to_the_dense_ones(tiny_models):
    path = tiny_models["qwen2"]
    dense = load_model(path, CPU, torch.float32)
    q = load_model(path, CPU, torch.bfloat16, fmt="int8", int8_kernel="int8pack")
    ids = torch.arange(3, 23)
    pos = torch.arange(20)
    mask = pos[None, :] <= pos[:, None]
    a = dense.forward(ids, pos, pos, mask, dense.new_cache(20))
    b = q.forward(ids, pos, pos, mask, q.new_cache(20))
    assert not torch.equal(a, b)  # it is another model: the quantized one
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@pytest.fixture(scope="module")
def int8_engines(noisy_pairs):
    return {
        f: api.load(str(noisy_pairs[f][0]), str(noisy_pairs[f][1]), device="cpu", offload=INT8, context=256,
                    progress=False)
        for f in ("llama", "qwen2", "llama_tied", "gemma2")
    }  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_tied", "gemma2"])
def test_int8_target_greedy_speculation_equals_its_ar(int8_engines, family):
    e = int8_engines[family]
    assert e.target_weights == "int8" and e.target.dtype == torch.bfloat16
    assert isinstance(e.target.layers.layer(0)["w13"], Int8Linear)
    assert_methods_equal_ar(e, PROMPTS, LOW_BIT_METHODS)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(dtype="fp32", offload=INT8), "dtype"),
        (dict(offload=OffloadConfig(mode="ram", target_dtype="int8")), "target_dtype"),
    ],
)
def test_int8_target_refuses_what_it_cannot_be(tiny_pair, kw, field):
    with pytest.raises(ConfigError, match=field):
        api.load(str(tiny_pair[0]), device="cpu", progress=False, context=64, **kw)


def test_cli_int8_target_with_fp32_is_one_error_line(tiny_pair):
    r = CliRunner().invoke(
        app,
        ["generate", "--target", str(tiny_pair[0]), "--device", "cpu", "-q", "-p", "t1", "--target-dtype", "int8",
         "--dtype", "fp32"],
    )  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "bf16" in lines[0], r.output


def test_cli_int8_target_generates(tiny_pair):
    r = CliRunner().invoke(
        app,
        ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu", "-q", "-p",
         "t10 t11", "-n", "6", "--target-dtype", "int8"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()


# -- the probe's choice ------------------------------------------------------------------------------------------
def _cfg(hidden: int = 1024) -> ModelConfig:
    return ModelConfig(
        vocab_size=1000, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=2, num_heads=8, num_kv_heads=8,
        head_dim=hidden // 8,
    )  # fmt: skip


@pytest.mark.parametrize(
    "low_ms, want",
    [
        ({"int8": {"1": 1.0, "8": 4.0}}, "int8"),  # a quarter of the bytes: clearly faster at both sizes
        ({"int8": {"1": 1.0, "8": 12.0}}, "dense"),  # a CPU whose dense multi-row products are much cheaper
        ({"int8": {"1": 3.5, "8": 4.0}}, "dense"),  # one row not clearly faster
        ({"int8": {"1": 1.0, "8": 4.0}, "q4": {"1": 0.7, "8": 3.0}}, "q4"),  # the cheapest clear gain
        ({"int8": {"1": 1.0, "8": 4.0}, "q4": {"1": 0.5, "8": 7.0}}, "int8"),  # 4-bit dear at a few rows
        ({"q4": {"1": 0.7, "8": 3.0}}, "q4"),  # no int8 kernel in this torch build
    ],
)
def test_auto_target_format_follows_the_measured_costs(tmp_path, monkeypatch, low_ms, want):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "choose_dtype", lambda cfg: torch.float32)
    calls = []

    def fake(shapes, dtype, rows=cpu_probe.INT8_ROWS, repeats=cpu_probe.REPEATS, before=None):
        calls.append(dtype)
        return {"dense": {"1": 4.0, "8": 8.0}, **low_ms}

    monkeypatch.setattr(cpu_probe, "measure_target", fake)
    fmt, dt = cpu_probe.choose_target(_cfg())
    assert fmt == want and dt == {"int8": torch.bfloat16}.get(want, torch.float32)
    assert cpu_probe.choose_target(_cfg()) == (fmt, dt) and len(calls) == 1  # cached: measured once
    assert any("target formats" in k for k in cpu_probe._read_cache())


def test_the_target_probe_times_every_low_bit_format_that_runs_here():
    from specexec.formats import q4

    shapes = [(64, 256), (256, 64)]
    ms = cpu_probe.measure_target(shapes, torch.float32, rows=(1, 3), repeats=1)
    want = {"dense"} | ({"int8"} if hasattr(torch, "_weight_int8pack_mm") else set())
    want |= {"q4"} if q4.available() is None else set()
    assert set(ms) == want and set(cpu_probe.target_formats()) == want - {"dense"}
    assert all(set(v) == {"1", "3"} and all(x > 0 for x in v.values()) for v in ms.values())


def test_tiny_models_are_not_probed_and_stay_dense(tiny_models):
    from specexec.loading.checkpoint import read_config

    assert cpu_probe.choose_target(read_config(tiny_models["llama"])) == ("dense", torch.float32)


@pytest.mark.parametrize(
    "low_ms, want",
    [
        ({"int8": {"1": 1.0, "8": 4.0}, "q4": {"1": 0.7, "8": 3.0}}, "q4"),
        ({"int8": {"1": 1.0, "8": 4.0}, "q4": {"1": 0.7, "8": 9.0}}, "int8"),  # 4-bit dearer than dense at 8 rows
        ({"int8": {"1": 3.5, "8": 4.0}, "q4": {"1": 3.9, "8": 3.0}}, "dense"),  # no clear gain at one row
    ],
)
def test_auto_draft_format_follows_the_measured_costs(tmp_path, monkeypatch, low_ms, want):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "choose_dtype", lambda cfg: torch.float32)
    monkeypatch.setattr(cpu_probe, "draft_formats", lambda: ("int8", "q4"))
    calls = []

    def fake(shapes, dtype, formats, rows=cpu_probe.INT8_ROWS, repeats=cpu_probe.REPEATS, before=None, target=True):
        calls.append(target)
        return {"dense": {"1": 4.0, "8": 8.0}, **low_ms}

    monkeypatch.setattr(cpu_probe, "measure_formats", fake)
    assert cpu_probe.choose_draft(_cfg()) == (torch.float32, want)
    assert cpu_probe.choose_draft(_cfg()) == (torch.float32, want) and calls == [False]  # cached: measured once


def test_layers_are_timed_from_memory_only_for_models_that_outgrow_the_cache(monkeypatch):
    monkeypatch.setattr(cpu_probe, "llc_bytes", lambda: 1 << 20)
    assert cpu_probe.cold(1 << 20) is None
    flush = cpu_probe.cold(8 << 20)
    assert flush is not None
    flush()  # reads a buffer twice the cache's size
    assert cpu_probe.llc_bytes() > 0
