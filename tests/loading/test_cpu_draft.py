"""CPU economics: the measured compute dtype, the int8 draft, the reduced draft vocabulary.

Exactness is relative to the target in the dtype it runs in: greedy speculative output equals that target's AR
output (bf16 included), and a cheaper draft (int8 weights, a vocabulary subset) changes only what is proposed,
never the output -- greedy token for token, sampling by a chi-square against the target's exact distribution.
"""

from __future__ import annotations

import json

import pytest
import torch

from specexec import api
from specexec.config import ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine
from specexec.errors import SpecexecError
from specexec.formats.dense import cpu_transposed, set_cpu_transposed
from specexec.formats.int8 import Int8Linear, _int8_kernel
from specexec.formats.subset import SubsetHead
from specexec.loading import cpu_probe
from specexec.loading.checkpoint import (
    draft_vocab_ids,
    load_model,
    load_tokenizer,
    read_config,
    resolve_draft,
    resolve_dtype,
)
from specexec.model.transformer import ModelConfig
from tests.conftest import FAMILIES, assert_methods_equal_ar

CPU = torch.device("cpu")
PROMPTS = ([5, 9, 17, 33, 4], [3, 60, 61, 62, 63, 12, 40])


# -- int8 weights --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["dynamic", "int8pack", "dequant"])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_int8_linear_matches_its_dequantized_weight(kernel, rows):
    if kernel == "dynamic" and _int8_kernel() != "dynamic":
        pytest.skip("no fbgemm dynamic int8 linear in this torch build")
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    q = Int8Linear(w, kernel=kernel)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (200,)
    assert (q.dequantize() - w).abs().max() <= q.scale.max() / 2 + 1e-6  # round to nearest, per-channel scale
    x = torch.randn(rows, 96)
    ref = x @ q.dequantize().T
    got = q.linear(x)
    assert got.shape == (rows, 200)
    # weight-only kernels compute with the dequantized weight; the dynamic one also quantizes x (to 7 bits)
    tol = 0.05 * ref.abs().max() if kernel == "dynamic" else 1e-3
    assert (got - ref).abs().max() <= tol
    ids = torch.tensor([3, 150, 7])
    assert torch.equal(q.rows(ids), q.dequantize()[ids])
    assert torch.equal(q.subset(ids).dequantize(), q.dequantize()[ids])


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_model_is_close_to_fp32(tiny_models, family):
    """The int8 draft computes nearly the fp32 logits (ties and tied embeddings included)."""
    path = tiny_models[family]
    ref, q = load_model(path, CPU, torch.float32), load_model(path, CPU, torch.float32, int8=True)
    if read_config(path).tie_word_embeddings:
        assert q.globals.embed is q.globals.lm_head  # one int8 copy serves both
    ids = torch.arange(3, 23)
    pos = torch.arange(20)
    mask = pos[None, :] <= pos[:, None]
    a = ref.forward(ids, pos, pos, mask, ref.new_cache(20))
    b = q.forward(ids, pos, pos, mask, q.new_cache(20))
    # the default (dynamic) kernel also quantizes activations, so errors compound over layers: loose bounds
    assert (a - b).abs().max() < 0.25 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.7


# -- reduced vocabulary --------------------------------------------------------------------------------------------
def test_subset_head_scores_only_its_ids_and_grows_with_what_it_sees():
    torch.manual_seed(0)
    w = torch.randn(50, 8)
    head = SubsetHead(w, torch.tensor([0, 1, 2, 10, 49]), 50)
    x = torch.randn(3, 8)
    out = head.linear(x)
    inside = torch.tensor([0, 1, 2, 10, 49])
    assert out.shape == (3, 50)
    torch.testing.assert_close(out[:, inside], x @ w[inside].T)
    assert torch.isinf(out).sum() == 3 * 45
    head.observe(torch.tensor([10, 20, 20, 30]))
    assert head.size == 7
    out = head.linear(x)
    torch.testing.assert_close(out[:, [20, 30]], x @ w[[20, 30]].T)
    assert torch.isinf(out).sum() == 3 * 43
    int8 = SubsetHead(Int8Linear(w, kernel="dequant"), inside, 50)
    torch.testing.assert_close(int8.linear(x)[:, inside], x @ Int8Linear(w).dequantize()[inside].T)


def test_draft_vocab_ids_keep_specials_and_eos(tiny_pair):
    tok = load_tokenizer(tiny_pair[1])
    ids = draft_vocab_ids(tok, 96, 10)
    assert set(range(10)) <= set(ids.tolist())
    assert 2 in ids.tolist() and len(ids) == 10  # eos 2, <s> 1 and <pad> 0 are among the first 10 here
    ids = draft_vocab_ids(tok, 96, 2)
    assert {0, 1, 2} <= set(ids.tolist())  # special ids always join
    with pytest.raises(SpecexecError):
        draft_vocab_ids(tok, 96, 0)


def test_the_draft_sees_the_prompt_tokens(tiny_pair):
    target, draft = tiny_pair
    e = api.load(str(target), str(draft), device="cpu", dtype="fp32", draft_vocab=8, progress=False, context=128)
    head = e.draft.globals.lm_head
    assert isinstance(head, SubsetHead) and head.size == 8
    e.generate([70, 71, 72, 5], 4, method="specexec", tree=TreeConfig.fixed(16))  # a fixed tree always drafts
    assert {70, 71, 72} <= set(head.extra_ids.tolist())


# -- greedy: a cheaper draft never changes the output -----------------------------------------------------------------
DRAFTS = {
    "int8": dict(draft_dtype="int8"),
    "vocab24": dict(draft_vocab=24),
    "int8+vocab24": dict(draft_dtype="int8", draft_vocab=24),
}


@pytest.fixture(scope="module")
def cheap_engines(noisy_pairs):
    out = {}
    for fam in ("llama", "qwen2", "llama_tied"):
        t, d = noisy_pairs[fam]
        for name, kw in DRAFTS.items():
            out[fam, name] = api.load(str(t), str(d), device="cpu", dtype="fp32", context=256, progress=False, **kw)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_tied"])
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_cheaper_draft_greedy_equals_ar(cheap_engines, family, draft):
    e = cheap_engines[family, draft]
    methods = (
        dict(method="specexec", tree=TreeConfig.fixed(16)),
        dict(method="specexec", tree=TreeConfig.fixed(64)),
        dict(method="chain", chain=ChainConfig(gamma=4)),
    )
    assert_methods_equal_ar(e, PROMPTS, methods)
    # the cheap draft still proposes something useful (a smoke check that it is wired in, not a speed claim)
    e.reset()
    st = e.generate(PROMPTS[0], 24, method="specexec", tree=TreeConfig.fixed(16)).stats
    assert st.tokens_per_step > 1.0


# -- sampling: a cheaper draft keeps the target's distribution -------------------------------------------------------
@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    from tests.conftest import make_noisy_copy, make_tiny
    from tests.decoding import test_sampling as ts

    root = tmp_path_factory.mktemp("cheap_sampling")
    target = make_tiny(root / "target", "llama", vocab=ts.V, seed=3, std=0.3, layers=2, hidden=32)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    t_model = load_model(target, CPU, torch.float32)
    # int8 weights and a 10-of-16 vocabulary (ids 0..9; the prompt's 5,6,7 are in it, later tokens join)
    d_model = load_model(draft, CPU, torch.float32, int8=True, head_ids=torch.arange(10))
    engine = Engine(t_model, load_tokenizer(target), d_model, context=256)
    return ts, ts.Table(t_model, ts.PROMPT), engine


def test_cheaper_draft_chain_sampling_is_exact(sampling_setup):
    """Chain sampling with the int8 + reduced-vocabulary draft (q is 0 outside the subset) through the engine."""
    ts, table, engine = sampling_setup
    samp = SamplingConfig(temperature=1.0, top_p=0.9)
    P = ts.truncate_at_eos(ts.joint(table, samp))
    out = [
        tuple(
            engine.generate(
                ts.PROMPT,
                ts.NEW,
                method="chain",
                chain=ChainConfig(gamma=3),
                sampling_cfg=SamplingConfig(temperature=1.0, top_p=0.9, seed=s),
            ).tokens
        )
        for s in range(2000)
    ]
    stat, dof, pval, impossible = ts.chi_square(out, P)
    assert impossible == 0 and pval > ts.ALPHA, (stat, dof, pval)


def test_cheaper_draft_specexec_sampling_is_ar_per_seed(sampling_setup):
    ts, _, engine = sampling_setup
    for s in range(150):
        cfg = SamplingConfig(temperature=1.0, top_k=4, seed=s)
        ref = engine.generate(ts.PROMPT, 8, method="ar", sampling_cfg=cfg).tokens
        got = engine.generate(
            ts.PROMPT, 8, method="specexec", sampling_cfg=cfg, tree=TreeConfig.fixed((4, 16)[s % 2])
        ).tokens
        assert got == ref, s


# -- bf16: exact relative to the bf16 target ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_engines(noisy_pairs):
    return {
        f: api.load(
            str(noisy_pairs[f][0]), str(noisy_pairs[f][1]), device="cpu", dtype="bf16", context=256, progress=False
        )
        for f in ("llama", "qwen2", "llama3")
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3"])
def test_bf16_greedy_speculation_equals_bf16_ar(bf16_engines, family):
    e = bf16_engines[family]
    assert e.target.dtype == torch.bfloat16 and e.draft.dtype == torch.bfloat16
    for p in PROMPTS:
        e.reset()
        ref = e.generate(p, 24, method="ar").tokens
        for kw in (
            dict(method="specexec", tree=TreeConfig.fixed(16)),
            dict(method="specexec", tree=TreeConfig.fixed(48)),
            dict(method="chain", chain=ChainConfig(gamma=4)),
        ):
            e.reset()
            assert e.generate(p, 24, **kw).tokens == ref, (kw, p)


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_orientation_rule_keeps_results(bf16_engines, transposed):
    """Either bf16 orientation (the probe picks per machine) gives the same greedy output for spec and AR."""
    e = bf16_engines["llama"]
    was = cpu_transposed(torch.zeros(9, 4, dtype=torch.bfloat16))
    fp32 = cpu_transposed(torch.zeros(9, 4))  # what this machine's probe measured for fp32
    set_cpu_transposed(torch.bfloat16, transposed)
    try:
        assert cpu_transposed(torch.zeros(9, 4, dtype=torch.bfloat16)) == transposed
        assert cpu_transposed(torch.zeros(9, 4)) == fp32  # fp32 keeps its measured rule
        e.reset()
        ref = e.generate(PROMPTS[1], 16, method="ar").tokens
        e.reset()
        assert e.generate(PROMPTS[1], 16, method="specexec", tree=TreeConfig.fixed(16)).tokens == ref
    finally:
        set_cpu_transposed(torch.bfloat16, was)


@pytest.fixture(scope="module")
def bf16_sampling_setup(tmp_path_factory):
    from tests.conftest import make_noisy_copy, make_tiny
    from tests.decoding import test_sampling as ts

    root = tmp_path_factory.mktemp("bf16_sampling")
    target = make_tiny(root / "target", "llama", vocab=ts.V, seed=3, std=0.3, layers=2, hidden=32)
    draft = make_noisy_copy(target, root / "draft", 0.1)
    t_model, d_model = load_model(target, CPU, torch.bfloat16), load_model(draft, CPU, torch.bfloat16)
    return ts, ts.Table(t_model, ts.PROMPT), Engine(t_model, load_tokenizer(target), d_model, context=256)


@pytest.mark.parametrize("method", ["chain", "specexec"])
def test_bf16_sampling_follows_the_bf16_target(bf16_sampling_setup, method):
    """Sampling in bf16 follows the bf16 target's distribution (chi-square against its exact joint).

    Unlike fp32, a seeded bf16 run of SpecExec is not token-for-token the seeded AR run: a tree pass and a
    one-row pass round differently in bf16 (logit differences ~1e-2, not ~1e-6), which moves CDF boundaries
    enough to flip ~2% of draws (measured: 14 of 100 eight-token runs differed on a tiny model). Each draw is
    still a draw from the bf16 target's conditional as computed in that pass, hence this distribution test.
    """
    ts, table, engine = bf16_sampling_setup
    # no top-p / top-k here: which token sits at a truncation edge is itself subject to that rounding
    P = ts.truncate_at_eos(ts.joint(table, SamplingConfig(temperature=0.8)))
    kw = (
        dict(method="chain", chain=ChainConfig(gamma=3))
        if method == "chain"
        else dict(method="specexec", tree=TreeConfig.fixed(8))
    )
    out = [
        tuple(engine.generate(ts.PROMPT, ts.NEW, sampling_cfg=SamplingConfig(temperature=0.8, seed=s), **kw).tokens)
        for s in range(2000)
    ]
    stat, dof, pval, impossible = ts.chi_square(out, P)
    assert impossible == 0 and pval > ts.ALPHA, (stat, dof, pval)


# -- dtype resolution and the probe --------------------------------------------------------------------------------
def test_dtype_resolution(tiny_models):
    cfg = read_config(tiny_models["llama"])
    assert resolve_dtype("auto", CPU, cfg) == torch.float32  # too small to probe: fp32
    assert resolve_dtype("bf16", CPU, cfg) == torch.bfloat16  # --dtype overrides
    assert resolve_draft("int8", CPU, cfg) == (torch.float32, True)
    assert resolve_draft("fp32", CPU, cfg) == (torch.float32, False)
    with pytest.raises(SpecexecError, match="draft-only"):
        resolve_dtype("int8", CPU, cfg)
    with pytest.raises(SpecexecError, match="unknown dtype"):
        resolve_dtype("int4", CPU, cfg)


def test_probe_rule():
    ms = lambda f1, f32, b1, b32, bt: {
        "fp32": {"1": f1, "32": f32},
        "bf16": {"1": b1, "32": b32},  # noqa: E731
        "bf16_transposed": {"32": bt},
    }
    assert cpu_probe.decide(ms(16, 63, 16, 29, 40)) == ("bf16", False)  # AMX-like: bf16 wins at 32 rows
    assert cpu_probe.decide(ms(16, 63, 16, 60, 30)) == ("bf16", True)  # ... via w @ x.T
    assert cpu_probe.decide(ms(16, 60, 18, 300, 340)) == ("fp32", False)  # AVX2-like: emulated bf16
    assert cpu_probe.decide(ms(16, 63, 40, 29, 40))[0] == "fp32"  # one-row passes (AR, chains) would suffer


def _mid_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1536, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64
    )


@pytest.fixture(autouse=True)
def _keep_orientation():
    """The probes set the process-wide orientation tables; tests leave them as they found them."""
    from specexec.formats.dense import cpu_orientation, set_cpu_orientation

    was = {dt: cpu_orientation(dt) for dt in (torch.float32, torch.bfloat16)}
    yield
    for dt, rows in was.items():
        set_cpu_orientation(dt, rows)


def test_orientation_decision_by_row_count():
    """Each row count uses the orientation measured at the nearest measured count at or below it."""
    ms = {
        "linear": {"2": 10.0, "4": 10.0, "8": 10.0, "16": 10.0},
        "transposed": {"2": 5.0, "4": 9.5, "8": 8.0, "16": 12.0},
    }
    rows = cpu_probe.decide_orientation(ms, max_rows=20)
    assert rows == [2, 3, 8, 9, 10, 11, 12, 13, 14, 15]  # 4 rows: 0.95x is not a clear win (ORIENT_GAIN 0.9)
    r = cpu_probe.OrientResult("k", "fp32", ms, rows)
    assert r.summary() == "fp32 w @ x.T at rows 2-3, 8-15 (else F.linear)"


def test_orientation_is_measured_once_and_applied(tmp_path, monkeypatch):
    from specexec.formats.dense import cpu_orientation

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    calls = []

    def fake(shapes, dtype, **kw):  # transposed wins at 2..7 rows only
        calls.append(dtype)
        lin = {str(r): 10.0 for r in cpu_probe.ORIENT_ROWS}
        return {"linear": lin, "transposed": {k: (5.0 if int(k) < 8 else 20.0) for k in lin}}

    monkeypatch.setattr(cpu_probe, "measure_orientation", fake)
    cfg = _mid_cfg()
    small = ModelConfig(**{**cfg.__dict__, "hidden_size": 64, "intermediate_size": 128})
    assert cpu_probe.orientation(small, torch.float32) is None and not calls  # too small: untouched
    res = cpu_probe.orientation(cfg, torch.float32)
    assert res is not None and res.transposed_rows == list(range(2, 8)) and calls == [torch.float32]
    assert cpu_orientation(torch.float32) == list(range(2, 8))
    assert cpu_probe.orientation(cfg, torch.float32) == res and len(calls) == 1  # cached
    assert resolve_dtype("fp32", CPU, cfg) == torch.float32 and len(calls) == 1  # explicit dtypes apply it too
    cpu_probe.orientation(cfg, torch.bfloat16)
    assert calls == [torch.float32, torch.bfloat16]
    ms = {k: {"1": 10.0, "32": 10.0} for k in ("fp32", "bf16")}
    monkeypatch.setattr(cpu_probe, "measure", lambda shapes, **kw: {**ms, "bf16_transposed": {"32": 10.0}})
    lines = cpu_probe.doctor_lines({"mid": cfg}, run=True)
    assert "cpu matmuls for mid: fp32 w @ x.T at rows 2-7 (else F.linear)" in lines


def test_probe_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    calls = []
    real = cpu_probe.measure
    monkeypatch.setattr(cpu_probe, "measure", lambda shapes, **kw: calls.append(shapes) or real(shapes, repeats=1))
    cfg = _mid_cfg()
    assert cpu_probe.doctor_lines({"mid": cfg})[0].endswith(
        "not probed yet (the first --dtype auto load on CPU does it)"
    )
    first = cpu_probe.probe(cfg)
    assert first is not None and len(calls) == 1
    data = json.loads((tmp_path / cpu_probe.CACHE_FILE).read_text())
    ((key, rec),) = data.items()
    assert cpu_probe.cpu_name() in key and torch.__version__ in key and str(cpu_probe.layer_shapes(cfg)) in key
    assert set(rec["ms"]["fp32"]) == {"1", "32"} and rec["dtype"] in ("fp32", "bf16")
    second = cpu_probe.probe(cfg)  # from the cache: no measurement
    assert len(calls) == 1 and second == first
    assert resolve_dtype("auto", CPU, cfg) == (torch.bfloat16 if first.dtype == "bf16" else torch.float32)
    assert len(calls) == 1
    lines = cpu_probe.doctor_lines()
    assert len(lines) == 1 and first.dtype in lines[0]
    assert first.dtype in cpu_probe.doctor_lines({"mid": cfg})[0]
    other = ModelConfig(**{**_mid_cfg().__dict__, "intermediate_size": 2048})
    cpu_probe.probe(other)  # other shapes: measured again
    assert len(calls) == 2


def test_probe_survives_a_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    (tmp_path / cpu_probe.CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(cpu_probe, "REPEATS", 1)
    assert cpu_probe.probe(_mid_cfg(), repeats=1) is not None
    assert json.loads((tmp_path / cpu_probe.CACHE_FILE).read_text())


# ---------------------------------------------------------------------------------------------- a busy first run

# the draft-format probe beside a compiler (one-row ms per layer: 4-bit 43 against dense fp32 7) and on the quiet
# machine (0.45 against 1.94), as a first run recorded them; int8 never clearly faster
BUSY_MS = {"dense": {"1": 7.0, "8": 9.0}, "int8": {"1": 8.0, "8": 12.0}, "q4": {"1": 43.0, "8": 50.0}}
QUIET_MS = {"dense": {"1": 1.94, "8": 3.0}, "int8": {"1": 1.8, "8": 3.5}, "q4": {"1": 0.45, "8": 2.5}}


def _machine(monkeypatch, tmp_path, busy: dict[str, bool]) -> list[bool]:
    """A cache home and a CPU whose load is ``busy["now"]``: the load source and the format probe's figures
    follow it. Returns the list of loads each measurement ran under."""
    from specexec import quiet

    monkeypatch.setenv("SPECEXEC_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "choose_dtype", lambda cfg: torch.float32)
    monkeypatch.setattr(cpu_probe, "draft_formats", lambda: ("int8", "q4"))
    monkeypatch.setattr(quiet, "sample", quiet.simulated(lambda: busy["now"]))
    runs: list[bool] = []

    def fake(shapes, dtype, formats, rows=cpu_probe.INT8_ROWS, repeats=cpu_probe.REPEATS, before=None, target=True):
        runs.append(busy["now"])
        return BUSY_MS if busy["now"] else QUIET_MS

    monkeypatch.setattr(cpu_probe, "measure_formats", fake)
    return runs


def _draft_entry() -> cpu_probe.FormatProbe:
    (entry,) = [e for e in cpu_probe.entries() if isinstance(e, cpu_probe.FormatProbe)]
    return entry


def _big_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=1000, hidden_size=1024, intermediate_size=4096, num_layers=2, num_heads=8, num_kv_heads=8,
        head_dim=128,
    )  # fmt: skip


def test_a_busy_first_run_does_not_leave_later_runs_slower(tmp_path, monkeypatch):
    cfg = _big_cfg()
    busy = {"now": False}
    _machine(monkeypatch, tmp_path / "reference", busy)
    quiet_first = cpu_probe.choose_draft(cfg)  # what a first run on the quiet machine picks
    assert quiet_first == (torch.float32, "q4") and not _draft_entry().provisional

    busy["now"] = True
    runs = _machine(monkeypatch, tmp_path / "home", busy)
    assert cpu_probe.choose_draft(cfg) == (torch.float32, "dense")  # fooled, as a first run beside a compiler was ...
    entry = _draft_entry()
    assert entry.provisional and entry.load["busy"] and entry.measured_at > 0  # ... but only provisionally
    assert "provisional" in cpu_probe.entry_line(entry) and "busy" in cpu_probe.entry_line(entry)

    assert cpu_probe.choose_draft(cfg) == (torch.float32, "dense") and runs == [True, True]  # still busy: kept
    assert _draft_entry() == entry

    busy["now"] = False  # a later start on a quiet machine measures again, and its choice replaces the busy one
    assert cpu_probe.choose_draft(cfg) == quiet_first and runs == [True, True, False]
    final = _draft_entry()
    assert not final.provisional and final.fmt == "q4" and not final.load["busy"]
    busy["now"] = True  # a quiet measurement is final: not measured again, busy or not
    assert cpu_probe.choose_draft(cfg) == quiet_first and runs == [True, True, False]


def test_entries_from_before_load_was_recorded_are_measured_again(tmp_path, monkeypatch):
    runs = _machine(monkeypatch, tmp_path, {"now": False})
    cpu_probe.choose_draft(_big_cfg())
    data = json.loads((tmp_path / cpu_probe.CACHE_FILE).read_text())
    old = {
        k: {f: v for f, v in e.items() if f not in ("provisional", "load", "measured_at", "stale")}
        for k, e in data.items()
    }
    (tmp_path / cpu_probe.CACHE_FILE).write_text(json.dumps(old))
    assert "before load was recorded" in cpu_probe.entry_line(_draft_entry())
    cpu_probe.choose_draft(_big_cfg())
    assert runs == [False, False] and _draft_entry().measured_at > 0


def test_a_run_time_pass_that_contradicts_the_probe_marks_it_stale(tmp_path, monkeypatch):
    from specexec import quiet
    from specexec.formats.q4 import Q4Linear
    from specexec.model.transformer import ResidentLayers

    cfg = _big_cfg()
    busy = {"now": False}
    runs = _machine(monkeypatch, tmp_path, busy)
    cpu_probe.choose_draft(cfg)
    entry = _draft_entry()
    # a whole one-row pass: both layers' linears and the head, priced per weight as the layer's
    layers = 2 + 1000 * 1024 / sum(o * i for o, i in cpu_probe.layer_shapes(cfg))
    assert entry.pass_s["q4"] == pytest.approx(0.45e-3 * layers, rel=1e-3)
    expected = entry.pass_s["q4"]
    assert not cpu_probe.contradicts(entry, expected * 1.4) and not cpu_probe.contradicts(entry, expected / 1.4)
    assert cpu_probe.contradicts(entry, expected * 1.6) and cpu_probe.contradicts(entry, expected / 1.6)

    class Draft:  # what check_pass reads of a loaded model: its config, dtype and layer weights
        def __init__(self, w2: object, dtype: torch.dtype = torch.float32) -> None:
            self.cfg, self.dtype, self.layers = cfg, dtype, ResidentLayers([{"w2": w2}])

    q4_draft = Draft(object.__new__(Q4Linear))
    assert cpu_probe.weight_format(q4_draft) == "q4"
    assert cpu_probe.check_pass(q4_draft, "draft", expected * 1.2) == []  # agrees
    with quiet.watch(quiet.simulated(True)) as w:
        pass
    assert cpu_probe.check_pass(q4_draft, "draft", expected * 3, w.load) == []  # a busy run time says nothing
    assert cpu_probe.check_pass(q4_draft, "target", expected * 3) == []  # not the target's probe
    assert len(cpu_probe.check_pass(q4_draft, "draft", expected * 3)) == 1
    assert "ran in" in _draft_entry().stale and "stale" in cpu_probe.entry_line(_draft_entry())

    busy["now"] = True  # the next start measures again, even busy (the stale figures were contradicted) ...
    assert cpu_probe.choose_draft(cfg) == (torch.float32, "dense") and runs == [False, True]
    assert _draft_entry().provisional and not _draft_entry().stale  # ... and keeps that provisional
    busy["now"] = False
    assert cpu_probe.choose_draft(cfg) == (torch.float32, "q4") and runs == [False, True, False]


def test_the_busy_rules():
    from specexec import quiet

    def load(waited_ns: int, loadavg: float | None, cpu: float = 1.0, cores: int = 4) -> quiet.Load:
        a = quiet.Sample(0.0, 0.0, {1: (0, 0)}, 0.0)
        b = quiet.Sample(1.0, cpu, {1: (10**9, waited_ns), 2: (10**9, waited_ns)}, loadavg)
        return quiet.load_between(a, b, cores)

    assert not load(0, 1.0).busy  # our own core only
    assert not load(int(0.3e9), 1.0).busy  # waited 23% of what we asked for: within the margin
    assert load(int(0.4e9), 1.0).busy and "waited" in load(int(0.4e9), 1.0).reasons()[0]  # 29%
    assert not load(0, 2.0).busy and load(0, 2.1).busy  # other work on 1 of 4 cores, then more
    assert not load(0, 3.0, cpu=2.0).busy  # our own two busy cores are not other work
    assert not quiet.load_between(quiet.Sample(0.0, 0.0), quiet.Sample(1.0, 0.5), 2).busy  # nothing known
    with quiet.watch() as w:  # the real sources read without error (whatever this machine's load)
        sum(range(1000))
    assert w.load.wall_s > 0 and w.load.cores >= 1
    assert quiet.load_between(quiet.sample(), quiet.sample(), quiet.cores()).cores == quiet.cores()
