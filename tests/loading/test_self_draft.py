"""The self-derived draft (``draft="self"``: the target's own checkpoint in int8/nf4) and low-bit drafts' memory.

Exactness: a low-bit draft changes only what is proposed, so greedy output equals the target's AR output token for
token and seeded sampling is reproducible. Sizes: the bytes the loader allocates for an int8/nf4 model equal
:func:`specexec.model.sizes.model_weight_bytes`, and the offload plan keeps more target layers resident beside a low-bit
draft than beside a bf16 one (plan arithmetic on Llama-2/3-70B-shaped configs; no GPU needed).
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from offload.plan import OffloadConfig, PlanModel, Resources, make_plan
from specexec import api
from specexec.cli import app
from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.errors import ConfigError
from specexec.formats.int8 import Int8Linear
from specexec.formats.nf4 import NF4Linear
from specexec.loading import memory
from specexec.loading.checkpoint import draft_format, load_model, read_config
from specexec.model import sizes
from specexec.model.transformer import ModelConfig

CPU = torch.device("cpu")
PROMPT = [5, 9, 17, 33, 4]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(path, fmt: str | None = None, budget: int = 8):
    return api.load(
        str(path), "self", device="cpu", dtype="fp32", draft_dtype=fmt, context=256, tree=TreeConfig.fixed(budget)
    )


def _weight_bytes(model) -> int:
    """Bytes of every distinct weight the model holds (a tied embedding/lm_head counted once)."""
    seen: set[int] = set()
    total = 0

    def add(w) -> None:
        nonlocal total
        if id(w) in seen:
            return
        seen.add(id(w))
        if isinstance(w, torch.Tensor):
            total += w.numel() * w.element_size()
        elif isinstance(w, Int8Linear):
            total += w.nbytes()
        elif isinstance(w, NF4Linear):
            total += w.packed.numel() * w.packed.element_size() + w.absmax.numel() * w.absmax.element_size()
        else:
            raise TypeError(type(w))

    g = model.globals
    for w in (g.embed, g.norm, g.lm_head):
        add(w)
    for layer in model.layers.layers:
        for w in layer.values():
            add(w)
    return total


# ---------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("fmt, cls", [(None, Int8Linear), ("int8", Int8Linear), ("nf4", NF4Linear)])
def test_self_draft_is_the_target_in_low_bit(tiny_models, fmt, cls):
    engine = _engine(tiny_models["qwen2"], fmt)
    assert engine.draft is not None and engine.draft is not engine.target
    assert engine.draft.cfg == engine.target.cfg  # the same architecture, from the same checkpoint
    layer = engine.draft.layers.layers[0]
    assert all(isinstance(layer[k], cls) for k in ("wqkv", "wo", "w13", "w2"))
    assert isinstance(engine.draft.globals.lm_head, cls)
    assert engine.draft.dtype == torch.float32
    # the weights are the target's, up to the quantization error
    dense = engine.target.layers.layers[0]["w13"]
    deq = layer["w13"].dequantize(torch.float32) if cls is Int8Linear else layer["w13"].dequantize()
    assert (deq - dense).abs().max() <= 0.2 * dense.abs().max()


def test_draft_format_by_device_and_name(tiny_models):
    cfg = read_config(tiny_models["llama"])
    assert draft_format(None, "fp32", CPU, cfg, self_draft=True) == (torch.float32, "int8")
    assert draft_format("auto", "fp32", CPU, cfg, self_draft=True) == (torch.float32, "int8")
    assert draft_format("nf4", "fp32", CPU, cfg, self_draft=True) == (torch.float32, "nf4")
    assert draft_format("int8", "fp32", CPU, cfg) == (torch.float32, "int8")
    assert draft_format(None, "fp32", CPU, cfg) == (torch.float32, "dense")
    for dense in ("fp32", "bf16", "fp16"):
        with pytest.raises(ConfigError, match="low bit"):
            draft_format(dense, "fp32", CPU, cfg, self_draft=True)


def test_self_draft_refuses_a_dense_dtype(tiny_models):
    with pytest.raises(ConfigError, match="must be auto, int8 or nf4, not bf16"):
        _engine(tiny_models["llama"], "bf16")


# ---------------------------------------------------------------------------------------------- exactness


def assert_tree_and_chain_equal_ar(engine, n: int):
    """Greedy SpecExec (budget 8, no early stop) and a chain of 4 both give the target's AR tokens (at least 10:
    EOS may end a run early); returns the tree run's result."""
    want = engine.generate(PROMPT, n, method="ar").tokens
    assert len(want) >= 10
    tree = engine.generate(PROMPT, n, method="specexec", tree=TreeConfig.fixed(8, early_stop=False))
    chain = engine.generate(PROMPT, n, method="chain", chain=ChainConfig(gamma=4))
    assert tree.tokens == want and chain.tokens == want
    return tree


def spy_check_engine(monkeypatch) -> dict:
    """Record what api.load passes to memory.check_engine (the draft's config, itemsize and weight bytes)."""
    seen: dict = {}
    real = memory.check_engine

    def spy(*args, **kw):
        seen.update(draft_cfg=args[1], draft_itemsize=args[5], draft_weights=kw["draft_weights"])
        return real(*args, **kw)

    monkeypatch.setattr(memory, "check_engine", spy)
    return seen


@pytest.mark.parametrize("family", ["qwen2", "llama_tied", "llama3"])
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_self_draft_greedy_equals_ar(tiny_models, family, fmt):
    engine = _engine(tiny_models[family], fmt)
    tree = assert_tree_and_chain_equal_ar(engine, 40)
    # the draft is the target up to quantization: it is right far more often than a random model would be
    assert tree.stats.tokens_per_step > 1.5


@pytest.mark.parametrize("method", ["specexec", "chain"])
def test_self_draft_sampling_reproducible_with_a_seed(tiny_models, method):
    engine = _engine(tiny_models["qwen2"])
    samp = SamplingConfig(temperature=1.0, seed=1234)
    a = engine.generate(PROMPT, 30, method=method, sampling_cfg=samp).tokens
    b = engine.generate(PROMPT, 30, method=method, sampling_cfg=samp).tokens
    other = engine.generate(PROMPT, 30, method=method, sampling_cfg=SamplingConfig(temperature=1.0, seed=99)).tokens
    assert a == b and len(a) >= 5  # EOS may end a sample early
    assert a != other  # the seed matters (30 tokens from a ~96-way distribution: equal by chance is negligible)


# ---------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("family", ["qwen2", "llama", "llama_tied"])
@pytest.mark.parametrize("fmt", ["dense", "int8", "nf4"])
def test_low_bit_weight_bytes_are_exact(tiny_models, family, fmt):
    path = tiny_models[family]
    cfg = read_config(path)
    model = load_model(path, CPU, torch.float32, int8=fmt == "int8", nf4=fmt == "nf4")
    assert _weight_bytes(model) == sizes.model_weight_bytes(cfg, fmt, 4)
    stored = sizes.stored_weights(path)
    if fmt != "dense":
        assert stored.resident_bytes(4, cfg, fmt) == sizes.model_weight_bytes(cfg, fmt, 4) + stored.largest * 4


def test_load_checks_the_low_bit_bytes_and_the_compute_dtype_kv(tiny_models, monkeypatch):
    """api.load charges the draft's int8 bytes (not fp32 ones) and sizes its KV cache at the compute dtype."""
    seen = spy_check_engine(monkeypatch)
    path = tiny_models["qwen2"]
    cfg = read_config(path)
    engine = _engine(path)
    assert seen["draft_itemsize"] == 4
    assert seen["draft_weights"] == sizes.model_weight_bytes(cfg, "int8", 4) + sizes.stored_weights(path).largest * 4
    assert seen["draft_weights"] < 0.5 * sizes.param_count(cfg) * 4
    est = sizes.engine_memory(cfg, cfg, 256, 4, 4, TreeConfig.fixed(8))
    assert engine.draft_model is not None
    assert engine.draft_model.cache.nbytes() <= est.kv  # the draft's fp32 KV cache is inside the estimate


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
    )


LLAMA2_70B = _llama(32000, 8192, 28672, 80, 64, 8)
LLAMA2_7B = _llama(32000, 4096, 11008, 32, 32, 32)
LLAMA3_70B = _llama(128256, 8192, 28672, 80, 64, 8)
LLAMA3_8B = _llama(128256, 4096, 14336, 32, 32, 8)
PAIRS = {"7B draft, Llama-2-70B": (LLAMA2_70B, LLAMA2_7B), "8B draft, Llama-3-70B": (LLAMA3_70B, LLAMA3_8B)}


def resident_layers(
    target: ModelConfig, draft: ModelConfig, fmt: str, cap_gb: float, context: int = 4096, invariant: bool = True
) -> int:
    """70B NF4 layers the plan keeps on a ``cap_gb`` GPU beside ``draft`` in ``fmt`` (bf16 compute), as api.load
    would plan it (-1: the ring does not fit). ``invariant``: reserve the shape-invariant passes' memory (the
    load-time check's is dropped where it does not fit beside a bare ring, which moves the count by its size)."""
    tree = TreeConfig.fixed(256)
    res = sizes.plan_reservations(
        target, draft, context, 2, 2, tree, draft_weights=sizes.model_weight_bytes(draft, fmt, 2)
    )
    model = PlanModel(
        target,
        torch.bfloat16,
        draft_bytes=res.draft_bytes,
        kv_bytes=res.kv_bytes,
        max_tokens=res.max_tokens,
        invariant=invariant,
    )
    resources = Resources(device="cuda", vram_free=10**12, ram_total=10**12, ram_available=10**12, disk_free=10**13)
    try:
        plan = make_plan(resources, model, OffloadConfig(mode="ram", target_dtype="nf4", gpu_memory_gb=cap_gb))
    except memory.OutOfMemory:
        return -1
    return len(plan.resident)


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("cap", [24, 16, 12])
def test_low_bit_draft_keeps_more_target_layers_resident(pair, cap):
    target, draft = PAIRS[pair]
    k = {fmt: resident_layers(target, draft, fmt, cap) for fmt in ("dense", "int8", "nf4")}
    assert k["nf4"] >= k["int8"] >= k["dense"], k  # -1: the ring does not fit beside that draft
    if k["int8"] >= 0:
        assert k["nf4"] > k["int8"] > k["dense"], k
    # the layers gained are the draft bytes saved, in 70B NF4 layers (the plan's floor division may add one), with
    # the same reservations on both sides
    k = {fmt: resident_layers(target, draft, fmt, cap, invariant=False) for fmt in ("dense", "int8", "nf4")}
    lb = make_plan(
        Resources(device="cuda", vram_free=10**12, ram_total=10**12, ram_available=10**12),
        PlanModel(target, torch.bfloat16),
        OffloadConfig(mode="ram", target_dtype="nf4"),
    ).layer_bytes
    for lo, hi in (("dense", "nf4"), ("int8", "nf4"), ("dense", "int8")):
        if k[lo] >= 0:
            saved = sizes.model_weight_bytes(draft, lo, 2) - sizes.model_weight_bytes(draft, hi, 2)
            assert abs((k[hi] - k[lo]) - saved // lb) <= 1, (lo, hi, k)


def test_draft_format_decides_whether_a_70b_streams_at_all():
    """At 16 GB a bf16 7B draft leaves no room for the ring of 70B NF4 layers; an NF4 7B draft leaves room for some
    resident layers, ~4 fewer beside the shape-invariant passes' reservation (the load-time check's ~2 GB)."""
    target, draft = PAIRS["7B draft, Llama-2-70B"]
    assert resident_layers(target, draft, "dense", 16) == -1
    fast, exact = (resident_layers(target, draft, "nf4", 16, invariant=inv) for inv in (False, True))
    assert fast >= 8 and 4 <= exact < fast


def test_model_weight_bytes_of_a_7b_draft():
    """Llama-2-7B: 6.74 B parameters; bf16 13.5 GB; int8 ~6.9 GB; NF4 ~4.0 GB (the untied embedding stays bf16)."""
    bf16 = sizes.model_weight_bytes(LLAMA2_7B, "dense", 2)
    int8 = sizes.model_weight_bytes(LLAMA2_7B, "int8", 2)
    nf4 = sizes.model_weight_bytes(LLAMA2_7B, "nf4", 2)
    assert bf16 == sizes.param_count(LLAMA2_7B) * 2 and 13.4e9 < bf16 < 13.6e9
    assert 6.8e9 < int8 < 6.95e9
    emb = 32000 * 4096 * 2
    linears = sizes.param_count(LLAMA2_7B) - 2 * 32000 * 4096
    assert abs(nf4 - (emb + (linears + 32000 * 4096) * sizes.NF4_BYTES_PER_PARAM)) < 1e6


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_self_draft_with_a_dense_dtype_is_one_line(monkeypatch):
    """An unsupported combination is refused in one line, before anything is resolved or loaded."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was resolved or loaded before the options were validated")

    import specexec.loading.hub

    monkeypatch.setattr(api, "load", forbidden)
    monkeypatch.setattr(specexec.loading.hub, "resolve", forbidden)
    for command in ("generate", "chat"):
        cmd = [command, "--target", "/nonexistent", "--device", "cpu", "-q", "--draft", "self", "--draft-dtype", "bf16"]
        if command == "generate":
            cmd += ["-p", "hello"]
        result = CliRunner().invoke(app, cmd)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in result.output, lines
        assert lines[0] == (
            "error: --draft self is the target's own weights in low bit: --draft-dtype must be auto, int8 or nf4, "
            "not bf16"
        ), lines[0]


def test_cli_generate_with_self_draft(tiny_models):
    """``--draft self`` works end to end through the CLI (the target is not resolved twice, nothing else loads)."""
    from tests.test_chat import make_chat_pair

    target, _ = make_chat_pair(tiny_models["llama"].parent.parent / "self-cli")
    result = CliRunner().invoke(
        app,
        ["generate", "--target", str(target), "--draft", "self", "--device", "cpu", "-q", "-p", "t10 t11", "-n", "8",
         "--budget", "4", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    import json

    out = json.loads(result.stdout)
    assert out["stats"]["method"] == "specexec", out


# ---------------------------------------------------------------------------------------------- GPU


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_cuda_self_draft_greedy_equals_ar(tiny_models, fmt):
    engine = api.load(
        str(tiny_models["qwen2"]), "self", device="cuda", draft_dtype=fmt, context=256, tree=TreeConfig.fixed(8)
    )
    kind = NF4Linear if fmt == "nf4" else Int8Linear
    assert isinstance(engine.draft.layers.layers[0]["w13"], kind)
    assert engine.draft.layers.layers[0]["w13"].packed.is_cuda if fmt == "nf4" else True
    want = engine.generate(PROMPT, 32, method="ar").tokens
    assert engine.generate(PROMPT, 32, method="specexec").tokens == want
    assert engine.generate(PROMPT, 32, method="chain", chain=ChainConfig(gamma=4)).tokens == want


@cuda
@pytest.mark.cuda
def test_cuda_int8_linear_bnb_matches_dequantized():
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    q = Int8Linear(w).to(torch.device("cuda"))
    q.kernel = "bnb"
    x = torch.randn(9, 128, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ q.dequantize().T
    assert (q.linear(x).float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_int8_linear_bnb_kernel_on_cpu():
    """The bitsandbytes int8 kernel (the CUDA default) computes the int8 weight's product on a CPU too."""
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    q = Int8Linear(w, kernel="bnb")
    x = torch.randn(9, 96)
    ref = x @ q.dequantize().T
    assert (q.linear(x) - ref).abs().max() <= 0.05 * ref.abs().max()
    assert Int8Linear(w).to(CPU).kernel == Int8Linear(w).kernel  # moving within a device keeps the kernel
