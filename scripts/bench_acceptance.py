#!/usr/bin/env python
"""Acceptance of SpecExec trees vs chain speculative decoding vs AR on the real demo pair (CPU).

Prompts are taken at run time from offline text shipped with every Python: chunks of CPython's stdlib sources
(code) and of ``pydoc_data/topics.py`` (English prose), at fixed files and offsets, cut at line boundaries
(~100-200 tokens each). Everything is greedy unless stated.

**Replay mode (default).** Running the full engine for every configuration is far too slow on a CPU (one
1.5B target pass over a 1024-token tree takes tens of seconds), and for greedy decoding it is unnecessary:

1. For each prompt, the target's greedy continuation R of ``--new-tokens`` tokens is generated once with the
   real engine (specexec, budget 64; exact) and cached in ``--refs``.
2. For each configuration the decode loop is replayed with the DRAFT only: at every step the real
   ``Drafter.grow`` (specexec) or ``Drafter.chain`` (chain) builds the tree from the current prefix with the
   real draft KV cache, and the accepted path is found by the real ``verify.walk`` with the target's choice at a
   node of depth d set to R[produced + d] — on the accepted path that IS the target's greedy choice, so the
   path, the emitted tokens and the step count equal exactly what the full engine does. Then the draft cache
   is committed as in the engine. Draft time (growth + commit) is measured here.
   Chain (greedy) accepts, from position p, min(gamma, run(p)) tokens, where run(p) counts the consecutive
   positions j >= p at which the draft's argmax given prompt + R[:j] equals R[j] (after a match the chain's
   next draft token is conditioned on exactly the target's prefix). So chain acceptance for EVERY gamma comes
   from one teacher-forced draft pass over prompt + R; the real ``Drafter.chain`` replay runs for
   ``--chain-replay-gammas`` (default 4) on every prompt, checks those step counts, and measures the seconds
   per chain draft pass; other gammas' draft time = their passes (gamma per step) x that measured mean.
3. The target's verification time per configuration is measured separately: a few ``score_tree`` calls on a
   tree of that configuration over a realistic prefix (the first prompt).
4. tokens/s is COMPOSED: tokens / (measured draft time + steps x measured target time per step). Prefill is
   excluded, as in the engine's own ``tokens_per_s``.

Generating R is itself a full-engine run of specexec at budget 64: its step count is checked against the
replay of budget 64 on every prompt (when R was generated for the same ``--new-tokens``).
``--e2e`` runs the full engine on a few prompts (AR, chain gamma 4, specexec 16 and 64) and checks that its
tokens equal R (= AR's) and its tokens/step equals the replay's exactly; it also prints the engine's measured
tokens/s next to the composed one. Sampling (temperature 0.6, top-p 0.9) cannot be replayed (the target's draws
are random): it runs the real engine on fewer prompts and reports tokens/step next to greedy's.

Note: ``max_depth`` (default 32) caps a step at 33 tokens, and a run of N new tokens at N tokens/step (one step);
the last step of a run is cut at N, so tokens/step <= N.

    nice -n 10 python scripts/bench_acceptance.py --e2e          # full run: docs/bench_acceptance.{json,md,png}
    nice -n 10 python scripts/bench_acceptance.py --quick        # a few minutes, to check the pipeline
    python scripts/bench_acceptance.py --report-only             # re-render md/png from the JSON
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024)
GAMMAS = tuple(range(1, 9))
REF_BUDGET = 64  # tree budget used to generate the reference continuations (any budget gives the same tokens)

# (stdlib file, where the chunk starts as a fraction of its lines). Deterministic; missing files are skipped.
CODE_SOURCES = (
    ("textwrap.py", 0.30), ("json/decoder.py", 0.40), ("json/encoder.py", 0.55), ("heapq.py", 0.50),
    ("functools.py", 0.35), ("dataclasses.py", 0.60), ("argparse.py", 0.45), ("difflib.py", 0.20),
    ("shlex.py", 0.50), ("fractions.py", 0.40), ("csv.py", 0.35), ("string.py", 0.55),
    ("configparser.py", 0.65), ("statistics.py", 0.45), ("tokenize.py", 0.50), ("pprint.py", 0.40),
)
# (pydoc topic, start fraction): prose of the language reference.
PROSE_SOURCES = (
    ("naming", 0.05), ("execmodel", 0.30), ("exceptions", 0.10), ("import", 0.25), ("assignment", 0.05),
    ("function", 0.40), ("class", 0.20), ("try", 0.30), ("with", 0.15), ("customization", 0.10),
    ("calls", 0.50), ("types", 0.30), ("compound", 0.60), ("formatstrings", 0.05), ("specialnames", 0.40),
    ("typesseq", 0.10),
)


@dataclass
class Prompt:
    kind: str  # "code" | "prose"
    source: str  # stdlib file or pydoc topic
    lines: tuple[int, int]  # [first, last) line numbers (0-based) in the source
    text: str
    ids: list[int] = field(repr=False)


@dataclass
class Run:
    """One replayed (or real) generation of one configuration on one prompt."""

    steps: int = 0
    tokens: int = 0
    draft_s: float = 0.0
    draft_cpu_s: float = 0.0  # process CPU seconds (all threads) of the same work: robust to other load
    passes: int = 0  # draft forwards
    accepted: list[int] = field(default_factory=list)  # tokens emitted per step
    shapes: list[list[int]] = field(default_factory=list)  # tokens per draft pass, per step
    draft_modeled: bool = False  # chain gammas without a real replay: draft_s = passes x measured s/pass
    early_stops: int = 0  # specexec steps whose tree growth the early-stop rule ended
    acc_scale: float = 1.0  # EMA of emitted / predicted tokens per step (the early stop's correction)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- prompts ------------------------------------------------------------------------------------------------------
def _chunk(lines: list[str], start: int, tok: Any, min_tok: int, max_tok: int, prose: bool) -> tuple[int, int, str]:
    """Lines [s, e) from about ``start``: begin at a non-blank line (a paragraph start for prose), stop once the
    text has >= min_tok tokens (and never add a line that passes max_tok). Falls back to earlier starts."""
    def n_tok(text: str) -> int:
        return len(tok(text.rstrip())["input_ids"])

    def ok_start(i: int) -> bool:
        if not lines[i].strip():
            return False
        return not prose or i == 0 or (not lines[i - 1].strip() and not lines[i].startswith((" ", "*", "=")))

    def grow(s: int) -> tuple[int, int, str] | None:
        text, e = "", s
        while e < len(lines):
            nxt = text + lines[e]
            if text and n_tok(nxt) > max_tok:
                return None
            text, e = nxt, e + 1
            if n_tok(text) >= min_tok:
                return s, e, text.rstrip()
        return None

    cands = [i for i in range(len(lines)) if ok_start(i)]
    for s in [i for i in cands if i >= start] + [i for i in reversed(cands) if i < start]:
        got = grow(s)
        if got is not None:
            return got
    raise ValueError("no chunk of the requested size in this source")


def make_prompts(tok: Any, n_code: int, n_prose: int, min_tok: int, max_tok: int) -> list[Prompt]:
    """Deterministic prompts: ``n_code`` stdlib chunks, then ``n_prose`` pydoc-topic chunks."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[Prompt] = []
    for name, frac in CODE_SOURCES:
        if sum(p.kind == "code" for p in out) >= n_code:
            break
        f = stdlib / name
        if f.is_file():
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
            s, e, text = _chunk(lines, int(frac * len(lines)), tok, min_tok, max_tok, prose=False)
            out.append(Prompt("code", name, (s, e), text, tok(text)["input_ids"]))
    for name, frac in PROSE_SOURCES:
        if sum(p.kind == "prose" for p in out) >= n_prose:
            break
        if name in topics:
            lines = topics[name].splitlines(keepends=True)
            s, e, text = _chunk(lines, int(frac * len(lines)), tok, min_tok, max_tok, prose=True)
            out.append(Prompt("prose", f"pydoc_data/topics.py[{name!r}]", (s, e), text, tok(text)["input_ids"]))
    if sum(p.kind == "code" for p in out) < n_code or sum(p.kind == "prose" for p in out) < n_prose:
        raise SystemExit(f"only {len(out)} prompts available here; lower --prompts")
    return out


# -- reference continuations ----------------------------------------------------------------------------------------
def references(engine: Any, prompts: list[Prompt], n: int, path: Path, target_id: str
               ) -> tuple[list[list[int]], list[dict[str, Any]], float]:
    """The target's greedy continuation (n tokens, or up to EOS) of each prompt, cached on disk with the
    engine's step count (specexec at REF_BUDGET, max_new_tokens = n) for the free end-to-end check."""
    from specexec.config import TreeConfig

    cache: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    refs, meta, spent = [], [], 0.0
    for i, p in enumerate(prompts):
        key = hashlib.sha256(json.dumps([target_id, p.ids]).encode()).hexdigest()[:24]
        have = cache.get(key)
        if have is None or (len(have["tokens"]) < n and not _ends_eos(engine, have["tokens"])):
            t = time.perf_counter()
            engine.reset()
            r = engine.generate(p.ids, n, method="specexec", tree=TreeConfig(budget=REF_BUDGET))
            dt = time.perf_counter() - t
            spent += dt
            have = {"tokens": r.tokens, "max_new": n, "budget": REF_BUDGET, "steps": r.stats.steps,
                    "tokens_per_s": r.stats.tokens_per_s, "draft_s": r.stats.draft_s, "target_s": r.stats.target_s}
            cache[key] = have
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cache))
            log(f"reference {i + 1}/{len(prompts)} ({p.kind}, {len(p.ids)} prompt tokens): {r.stats.steps} steps, "
                f"{dt:.0f} s")
        refs.append(_cut(engine, have["tokens"], n))
        meta.append(have)
    return refs, meta, spent


def _ends_eos(engine: Any, toks: list[int]) -> bool:
    return bool(toks) and toks[-1] in engine.tokenizer.eos_ids


def _cut(engine: Any, toks: list[int], n: int) -> list[int]:
    """The first n tokens, or up to and including the first EOS (where the engine stops)."""
    out = []
    for t in toks[:n]:
        out.append(t)
        if t in engine.tokenizer.eos_ids:
            break
    return out


# -- replay -----------------------------------------------------------------------------------------------------------
def replay(drafter: Any, prompt_ids: list[int], ref: list[int], method: str, param: int,
           grow_cost: Any = None) -> tuple[Run, Any]:
    """Replay the engine's greedy loop for one config with the draft only (see the module docstring).

    ``grow_cost``: the tree's early stop, as the engine runs it: None = full growth (``--grow-cost off``);
    a ``(budget, draft_s, passes, acc_scale) -> GrowCost`` callable otherwise (see :func:`grow_costs`).
    Returns the run and the first step's (tree, sequence), an example for timing the target's verification.
    """
    import torch

    from specexec import sampling
    from specexec.config import SamplingConfig, TreeConfig
    from specexec.verify import walk

    greedy = SamplingConfig()
    cfg = TreeConfig(budget=param) if method == "specexec" else None
    run, first = Run(), None
    drafter.reset(keep=len(prompt_ids) - 1)
    seq = list(prompt_ids)
    produced = 0
    while produced < len(ref):
        n = len(seq) - 1
        t0, c0 = time.perf_counter(), time.process_time()
        if method == "specexec":
            cost = grow_cost(param, run.draft_s, run.passes, run.acc_scale) if grow_cost is not None else None
            tree, gs = drafter.grow(seq, cfg, lambda lg: sampling.logprobs(lg, greedy), cost)
            run.early_stops += gs.stopped_early
        else:
            tree, _, gs = drafter.chain(seq, param, lambda lg: (lg.argmax(-1), None))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        first = first or (tree, list(seq))
        # the target's greedy choice at a node of depth d is ref[produced + d] (on the accepted path, exactly)
        choice = torch.tensor([ref[produced + d] if produced + d < len(ref) else -1 for d in tree.n_depth.tolist()])
        path, emitted = walk(tree, choice)
        out = emitted[: len(ref) - produced]
        if method == "specexec" and len(out) == len(emitted):  # (as the engine: emitted / predicted, EMA)
            predicted = min(1.0 + float(tree.n_logp[1:].exp().sum()), cfg.max_depth + 1.0)
            run.acc_scale = min(max(0.8 * run.acc_scale + 0.2 * len(emitted) / predicted, 0.2), 5.0)
        t0, c0 = time.perf_counter(), time.process_time()
        drafter.commit(tree, path, n)
        seq.extend(out)
        drafter.length = min(drafter.length, len(seq) - 1)
        run.draft_s += dt + time.perf_counter() - t0
        run.draft_cpu_s += dc + time.process_time() - c0
        run.passes += gs.passes
        run.shapes.append(gs.beams)
        run.steps += 1
        run.accepted.append(len(out))
        produced += len(out)
    run.tokens = produced
    return run, first


def draft_agreement(drafter: Any, prompt_ids: list[int], ref: list[int]) -> list[bool]:
    """agree[j]: the draft's argmax after prompt + ref[:j] equals ref[j] (one teacher-forced pass)."""
    import torch

    n = len(prompt_ids) - 1
    drafter.reset(keep=n)
    toks = [prompt_ids[-1]] + ref[:-1]
    pos = torch.arange(n, n + len(toks))
    mask = torch.arange(n + len(toks))[None, :] <= pos[:, None]
    logits = drafter.model.forward(torch.tensor(toks), pos, pos, mask, drafter.cache)  # (len(ref), V)
    return [int(a) == b for a, b in zip(logits.argmax(-1).tolist(), ref)]


def chain_from_agreement(agree: list[bool], gamma: int) -> Run:
    """Greedy chain decoding's steps from the agreement vector: min(gamma, run of agreement) + 1 per step."""
    run, p, n = Run(), 0, len(agree)
    while p < n:
        a = 0
        while a < gamma and p + a < n and agree[p + a]:
            a += 1
        out = min(a + 1, n - p)
        run.steps += 1
        run.accepted.append(out)
        run.passes += gamma  # catch-up pass + gamma - 1 single-token passes, as Drafter.chain does
        p += out
    run.tokens = n
    return run


def chain_tree(root: int, gamma: int) -> Any:
    """A chain of gamma draft tokens below the root (for timing the target's verification of it)."""
    import torch

    from specexec.tree import Tree

    tree = Tree(root, gamma + 1, torch.device("cpu"))
    for i in range(gamma):
        tree.add(torch.tensor([i]), torch.tensor([root]), torch.zeros(1))
    return tree


def time_verify(target: Any, cache: Any, prompt_ids: list[int], trees: dict[str, Any]) -> dict[str, tuple]:
    """One timed ``score_tree`` per config's tree (this prompt's first step) after prefilling the prompt.

    Called after each prompt's replays, so verification is timed in the same stretch of (shared-machine) time
    as the drafting it is composed with. Returns key -> (tree tokens, prefix tokens, wall s, process CPU s).
    """
    import torch

    from specexec.verify import score_tree

    n = len(prompt_ids) - 1
    pos = torch.arange(n)
    target.forward(torch.tensor(prompt_ids[:n]), pos, pos, pos[None, :] <= pos[:, None], cache,
                   logits_rows=slice(-1, None))
    out = {}
    for k, tree in sorted(trees.items(), key=lambda kv: kv[1].size):
        t0, c0 = time.perf_counter(), time.process_time()
        score_tree(target, cache, tree, n, 4096)  # writes slots >= n only: the prefix stays valid
        out[k] = (tree.size, n, time.perf_counter() - t0, time.process_time() - c0)
    return out


def grow_costs(mode: str, engine: Any, budgets: list[int]) -> tuple[Any, str]:
    """The early stop's costs for the replays (``--grow-cost``): returns (callable or None, description).

    ``cpu``: as the engine does it here -- per-pass draft seconds measured as the run goes (no early stop before the
    run's first step), the target's verify seconds for budget+1 tokens timed once up front. A bench_e2e JSON:
    a GPU's measured costs (graphed draft pass + per-level bookkeeping; the NF4 70B-shaped target's verify time
    by budget), to grow the trees that GPU would grow.
    """
    if mode == "off":
        return None, "off: every tree grows up to max_depth levels"
    import torch

    from specexec.budget import interp
    from specexec.draft import GrowCost

    if mode == "cpu":
        dev = engine.target.device
        cache = engine.target.new_cache(max(budgets) + 2)
        target_s = {}
        for b in [1] + sorted(budgets):  # the first (1 token) warms up
            pos = torch.arange(b + 1, device=dev)
            toks = torch.randint(0, engine.target.cfg.vocab_size, (b + 1,), device=dev)
            t0 = time.perf_counter()
            engine.target.forward(toks, pos, pos, pos[None, :] <= pos[:, None], cache)
            target_s[b] = time.perf_counter() - t0
        del cache

        def cost(b: int, draft_s: float, passes: int, acc: float) -> Any:
            return GrowCost(pass_s=draft_s / passes, target_s=target_s[b], acc_scale=acc) if passes else None

        return cost, (f"cpu: per-pass draft time measured during each run; target verify s by budget "
                      f"{ {b: round(t, 3) for b, t in target_s.items()} }")
    e2e = json.loads(Path(mode).read_text())
    graphed = {int(k): v for k, v in e2e["draft_pass_s_graphed"].items()}
    pass_s = graphed[max(graphed)] + e2e["bookkeeping_s_per_level"]
    verify = {r["budget"]: r["verify_s"] for r in e2e["runs"] if r["format"] == "nf4"}

    def gpu_cost(b: int, draft_s: float, passes: int, acc: float) -> Any:
        return GrowCost(pass_s=pass_s, target_s=interp(verify, b), acc_scale=acc)

    return gpu_cost, (f"{e2e.get('device', 'GPU')} costs from {mode}: draft pass {pass_s * 1e3:.1f} ms (graphed, "
                      f"with bookkeeping), NF4 70B-shaped verify s by budget "
                      f"{ {b: round(t, 3) for b, t in sorted(verify.items())} }")


# -- aggregation ------------------------------------------------------------------------------------------------------
def aggregate(runs: list[Run], verify: dict[str, float]) -> dict[str, Any]:
    tokens = sum(r.tokens for r in runs)
    steps = sum(r.steps for r in runs)
    draft = sum(r.draft_s for r in runs)
    target = steps * verify["s"]
    cpu = sum(r.draft_cpu_s for r in runs) + steps * verify["cpu_s"]
    return {"prompts": len(runs), "tokens": tokens, "steps": steps, "tokens_per_step": tokens / steps,
            "draft_s": draft, "target_s": target, "tokens_per_s": tokens / (draft + target),
            "cpu_s_per_token": cpu / tokens,
            "draft_s_per_step": draft / steps, "target_s_per_step": verify["s"],
            "draft_passes_per_step": sum(r.passes for r in runs) / steps,
            "early_stop_share": sum(r.early_stops for r in runs) / steps,
            "draft_time_modeled": any(r.draft_modeled for r in runs)}


def shape_summary(runs: list[Run]) -> dict[str, Any]:
    """Mean draft passes per step, and per pass index the mean tokens (over the steps that reached it)."""
    shapes = [s for r in runs for s in r.shapes]
    per = [[s[i] for s in shapes if len(s) > i] for i in range(max(len(s) for s in shapes))]
    return {
        "passes": statistics.fmean(len(s) for s in shapes),
        "beams_per_pass": [round(statistics.fmean(p), 2) for p in per],
        "reach": [round(len(p) / len(shapes), 3) for p in per],
        "draft_tokens_per_step": statistics.fmean(sum(s) for s in shapes),
        "steps": len(shapes),
    }


# -- main ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--prompts", type=int, default=20, help="prompts in all, half code and half prose")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated (replayed) per prompt")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="specexec tree budgets")
    p.add_argument("--gammas", default=",".join(map(str, GAMMAS)), help="chain draft lengths")
    p.add_argument("--chain-replay-gammas", default="4",
                   help="gammas also replayed with the real Drafter.chain on every prompt (checked, timed)")
    p.add_argument("--budget-prompts", default="512:4,1024:4",
                   help="budget:prompts pairs: run those budgets on fewer prompts (the first, half code half prose)")
    p.add_argument("--min-prompt-tokens", type=int, default=100)
    p.add_argument("--max-prompt-tokens", type=int, default=200)
    p.add_argument("--grow-cost", default="cpu",
                   help="the trees' early stop: 'cpu' (measured here, as the engine does), 'off' (full growth to "
                        "max_depth), or a bench_e2e JSON (grow the trees that GPU would grow)")
    p.add_argument("--context", type=int, default=4096, help="engine context (sizes the draft cache, as the CLI's)")
    p.add_argument("--sampling-prompts", type=int, default=6, help="prompts for the sampled runs (0: skip)")
    p.add_argument("--sampling-tokens", type=int, default=24)
    p.add_argument("--sampling-budgets", default="16,64")
    p.add_argument("--sampling-gamma", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs")
    p.add_argument("--e2e", action="store_true", help="also run the full engine and check it against the replay")
    p.add_argument("--e2e-prompts", type=int, default=2, help="prompts for --e2e (half code, half prose)")
    p.add_argument("--quick", action="store_true",
                   help="4 prompts, 16 tokens, budgets 8,32,128, gammas 1..4; 2 sampled prompts x 12 tokens")
    p.add_argument("--refs", default="bench_out/acceptance_refs.json", help="cache of reference continuations")
    p.add_argument("--out", default="docs/bench_acceptance.json")
    p.add_argument("--md", default="docs/bench_acceptance.md")
    p.add_argument("--png", default="docs/bench_acceptance.png")
    p.add_argument("--report-only", action="store_true", help="re-render --md/--png from --out and exit")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.new_tokens, a.budgets, a.gammas = 4, 16, "8,32,128", "1,2,3,4"
        a.budget_prompts, a.sampling_prompts, a.sampling_tokens = "128:2", 2, 12
    ints = lambda v: [int(x) for x in str(v).split(",") if x]  # noqa: E731
    a.budgets, a.gammas, a.sampling_budgets = ints(a.budgets), ints(a.gammas), ints(a.sampling_budgets)
    a.chain_replay_gammas = ints(a.chain_replay_gammas)
    a.budget_prompts = {int(b): int(n) for b, n in (x.split(":") for x in str(a.budget_prompts).split(",") if x)}
    if a.sampling_gamma not in a.chain_replay_gammas and a.sampling_prompts:
        a.chain_replay_gammas.append(a.sampling_gamma)
    if a.e2e and 4 not in a.chain_replay_gammas:
        a.chain_replay_gammas.append(4)
    return a


def _trim_heap() -> None:
    """Give freed loader buffers back to the OS (glibc), so the RSS is the weights, not the load's peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        report = json.loads(Path(args.out).read_text())
        print(write_markdown(report, Path(args.md)))
        plot(report, Path(args.png))
        return 0
    import torch

    from specexec import api, hub
    from specexec.config import TreeConfig
    from specexec.draft import Drafter
    from specexec.loading import model_dir

    wall0 = time.perf_counter()
    engine = api.load(args.target, args.draft, device="cpu", dtype="fp32", context=args.context, progress=False)
    _trim_heap()
    tok = engine.tokenizer.tokenizer
    n_code = (args.prompts + 1) // 2
    prompts = make_prompts(tok, n_code, args.prompts - n_code, args.min_prompt_tokens, args.max_prompt_tokens)
    log(f"loaded in {time.perf_counter() - wall0:.0f} s; {len(prompts)} prompts "
        f"({', '.join(str(len(p.ids)) for p in prompts)} tokens)")
    target_id = str(model_dir(hub.resolve(args.target)))
    need = max(args.new_tokens, args.sampling_tokens if args.sampling_prompts else 0)
    refs, ref_meta, ref_s = references(engine, prompts, need, Path(args.refs), target_id)

    kinds = ("code", "prose")
    by_kind = {k: [i for i, p in enumerate(prompts) if p.kind == k] for k in kinds}

    def subset(n: int) -> list[int]:
        return by_kind["code"][: (n + 1) // 2] + by_kind["prose"][: n // 2]

    samp_set, e2e_set = subset(args.sampling_prompts), subset(args.e2e_prompts)
    budget_set = {b: set(subset(args.budget_prompts[b])) if b in args.budget_prompts else set(range(len(prompts)))
                  for b in args.budgets}
    e2e_cfgs = [("ar", 0), ("chain", 4), ("specexec", 16), ("specexec", 64)]
    e2e_extra: dict[str, dict[int, Run]] = {}  # e2e configs/prompts the main grid does not replay
    key = lambda m, v: m if m == "ar" else f"{m}:{v}"  # noqa: E731
    spec_keys = [key("specexec", b) for b in args.budgets]
    real_chain = [key("chain", g) for g in args.chain_replay_gammas]
    runs: dict[str, dict[int, Run]] = {k: {} for k in ["ar"] + [key("chain", g) for g in args.gammas] + spec_keys}
    checks: dict[str, list[str]] = {"chain_agreement_vs_replay": [], "ref_engine_vs_replay": []}
    real_chain_runs: dict[str, dict[int, Run]] = {k: {} for k in real_chain}
    greedy_short: dict[str, dict[int, Run]] = {}
    vt: dict[str, list[tuple]] = {}  # config -> per prompt (tree tokens, prefix tokens, wall s, CPU s)
    max_b = max(args.budgets + args.sampling_budgets + [REF_BUDGET])
    t_cache = engine.target.new_cache(max(len(p.ids) for p in prompts) + max_b + 4)
    # sized as the engine sizes its own drafter for the largest budget: context + room + budget + max_beams
    drafter = Drafter(engine.draft, args.context + (max_b + 2) + max_b + TreeConfig().max_beams)
    stop_cost, stop_desc = grow_costs(args.grow_cost, engine, args.budgets)
    log(f"early stop: {stop_desc}")
    t_replay = time.perf_counter()
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        ref = refs[i][: args.new_tokens]
        trees: dict[str, Any] = {"ar": chain_tree(p.ids[-1], 0)}
        trees.update({key("chain", g): chain_tree(p.ids[-1], g) for g in args.gammas})
        drafter.reset()
        drafter.prefill(p.ids)
        runs["ar"][i] = Run(steps=len(ref), tokens=len(ref), accepted=[1] * len(ref))
        agree = draft_agreement(drafter, p.ids, ref)
        for g in args.gammas:
            runs[key("chain", g)][i] = chain_from_agreement(agree, g)
        for k in real_chain:
            g = int(k.split(":")[1])
            real, first = replay(drafter, p.ids, ref, "chain", g)
            real_chain_runs[k][i] = real
            if (real.steps, real.accepted) != (chain_from_agreement(agree, g).steps,
                                               chain_from_agreement(agree, g).accepted):
                checks["chain_agreement_vs_replay"].append(f"prompt {i} {k}: replay {real.accepted} vs agreement "
                                                           f"{chain_from_agreement(agree, g).accepted}")
            if k in runs:
                runs[k][i] = real  # the real replay (measured draft time) replaces the agreement count
            trees[k] = first[0]
        for b in args.budgets:
            if i not in budget_set[b]:
                continue
            k = key("specexec", b)
            runs[k][i], first = replay(drafter, p.ids, ref, "specexec", b, stop_cost)
            trees[k] = first[0]
            m = ref_meta[i]
            # (the engine's trees match the replay's when both grow fully; measured costs differ run to run)
            if (stop_cost is None and b == m["budget"] and m["max_new"] == args.new_tokens
                    and m["steps"] != runs[k][i].steps):
                checks["ref_engine_vs_replay"].append(f"prompt {i} {k}: engine {m['steps']} steps, replay "
                                                      f"{runs[k][i].steps}")
        if i in e2e_set:
            for m_, v in e2e_cfgs[2:]:
                k = key(m_, v)
                if v not in args.budgets or i not in budget_set[v]:
                    e2e_extra.setdefault(k, {})[i], first = replay(drafter, p.ids, ref, m_, v, stop_cost)
                    trees[k] = first[0]
        if i in samp_set:  # greedy on the sampled runs' prompts and length, for the side-by-side table
            short = refs[i][: args.sampling_tokens]
            for m_, v in [("chain", args.sampling_gamma)] + [("specexec", b) for b in args.sampling_budgets]:
                greedy_short.setdefault(key(m_, v), {})[i] = replay(drafter, p.ids, short, m_, v, stop_cost)[0]
        for k, v in time_verify(engine.target, t_cache, p.ids, trees).items():
            vt.setdefault(k, []).append(v)
        tps = " ".join(f"{k.replace('specexec:', 's').replace('chain:', 'c')}={r[i].tokens / r[i].steps:.1f}"
                       for k, r in runs.items() if i in r and k != "ar")
        log(f"replay {i + 1}/{len(prompts)} {p.kind} {p.source} ({len(p.ids)} tok): "
            f"{time.perf_counter() - t0:.0f} s; tokens/step {tps}")
    replay_s = time.perf_counter() - t_replay

    # chain gammas without a real replay: draft time = passes x measured seconds per chain draft pass
    rc = [r for per in real_chain_runs.values() for r in per.values()]
    s_per_pass = sum(r.draft_s for r in rc) / sum(r.passes for r in rc)
    cpu_per_pass = sum(r.draft_cpu_s for r in rc) / sum(r.passes for r in rc)
    for g in args.gammas:
        k = key("chain", g)
        if k not in real_chain:
            for r in runs[k].values():
                r.draft_s, r.draft_cpu_s, r.draft_modeled = r.passes * s_per_pass, r.passes * cpu_per_pass, True
    verify = {k: {"tree_tokens": statistics.median(x[0] for x in v), "prefix_tokens": statistics.median(x[1] for x in v),
                  "s": statistics.median(x[2] for x in v), "cpu_s": statistics.median(x[3] for x in v),
                  "samples": len(v), "min_s": min(x[2] for x in v), "max_s": max(x[2] for x in v)}
              for k, v in vt.items()}
    verify_s = sum(x[2] for v in vt.values() for x in v)

    greedy: dict[str, Any] = {}
    for kind in kinds + ("all",):
        idx = set(range(len(prompts))) if kind == "all" else set(by_kind[kind])
        greedy[kind] = {}
        for k, per in runs.items():
            sel = sorted(i for i in per if i in idx)
            if not sel:
                continue
            greedy[kind][k] = aggregate([per[i] for i in sel], verify[k])
            if len(sel) < len(idx):  # big budgets: chain's best and AR on the same prompts
                greedy[kind][k]["chain_best_same_prompts"] = max(
                    sum(runs[key("chain", g)][i].tokens for i in sel) / sum(runs[key("chain", g)][i].steps for i in sel)
                    for g in args.gammas)
    shapes = {str(b): shape_summary(list(runs[key("specexec", b)].values())) for b in args.budgets}

    sampling_res: dict[str, Any] = {}
    if args.sampling_prompts:
        t0 = time.perf_counter()
        sampling_res = run_sampling(engine, prompts, samp_set, greedy_short, args)
        sampling_res["wall_s"] = time.perf_counter() - t0

    e2e: dict[str, Any] = {}
    if args.e2e:
        t0 = time.perf_counter()
        known = {k: {**runs.get(k, {}), **real_chain_runs.get(k, {}), **e2e_extra.get(k, {})}
                 for k in set(runs) | set(real_chain_runs) | set(e2e_extra)}
        e2e = run_e2e(engine, prompts, refs, known, verify, e2e_set, e2e_cfgs, args)
        e2e["wall_s"] = time.perf_counter() - t0

    tc = TreeConfig()
    report = {
        "what": "acceptance on the real pair, CPU, greedy unless stated. tokens/step: exact (draft-only replay of "
                "the engine's loop against the target's greedy continuation). tokens/s: COMPOSED = tokens / "
                "(measured draft time + steps x measured target verify time for that tree size); prefill excluded.",
        "target": args.target, "draft": args.draft, "new_tokens": args.new_tokens, "tree": asdict(tc),
        "grow_cost": stop_desc,
        "cap": f"max_depth {tc.max_depth} caps a step at {tc.max_depth + 1} tokens, and a {args.new_tokens}-token "
               f"run at {args.new_tokens} tokens/step",
        "budget_prompts": {str(b): sorted(budget_set[b]) for b in args.budgets if len(budget_set[b]) < len(prompts)},
        "chain_note": f"chain tokens/step for every gamma from the draft's teacher-forced agreement (exact for greedy);"
                      f" real Drafter.chain replays for gamma {args.chain_replay_gammas} on every prompt (their draft "
                      f"time is measured); other gammas' draft time = passes x {s_per_pass:.3f} s, the measured mean "
                      f"per chain draft pass",
        "chain_s_per_pass": s_per_pass,
        "env": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "machine": platform.machine(), "cpus": os.cpu_count(), "nice": os.nice(0),
                "loadavg_end": os.getloadavg()},
        "prompts": [{"kind": p.kind, "source": p.source, "lines": list(p.lines), "prompt_tokens": len(p.ids),
                     "ref_tokens": len(refs[i][: args.new_tokens]), "text_head": p.text[:60]}
                    for i, p in enumerate(prompts)],
        "verify": verify, "greedy": greedy, "tree_shapes": shapes, "sampling": sampling_res, "e2e": e2e,
        "checks": {**checks, "ref_engine_vs_replay_prompts": 0 if stop_cost is not None else sum(
            m["budget"] in args.budgets and m["max_new"] == args.new_tokens for m in ref_meta)},
        "per_prompt_tokens_per_step": {k: {str(i): round(r.tokens / r.steps, 3) for i, r in per.items()}
                                       for k, per in runs.items()},
        "timing_s": {"references": ref_s, "replay": replay_s, "verify": verify_s,
                     "total": time.perf_counter() - wall0},
    }
    report["goals"] = goals(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(write_markdown(report, Path(args.md)))
    plot(report, Path(args.png))
    log(f"wrote {args.out}, {args.md}, {args.png}; total {report['timing_s']['total'] / 60:.1f} min")
    ok = not any(checks.values()) and (not e2e or e2e["all_ok"])
    return 0 if ok else 1


def run_sampling(engine: Any, prompts: list[Prompt], idx: list[int], greedy_short: dict[str, dict[int, Run]],
                 args: argparse.Namespace) -> dict[str, Any]:
    """The real engine at temperature/top-p on a few prompts: tokens/step next to greedy's (replayed)."""
    from specexec.config import ChainConfig, SamplingConfig, TreeConfig

    cfgs = [("chain", args.sampling_gamma)] + [("specexec", b) for b in args.sampling_budgets]
    out: dict[str, Any] = {"temperature": args.temperature, "top_p": args.top_p, "tokens": args.sampling_tokens,
                           "prompts": idx, "configs": {}}
    acc: dict[str, dict[str, list[float]]] = {}
    for j, i in enumerate(idx):
        engine.reset()  # then the prompt's prefix is reused across its configs
        for m, v in cfgs:
            k = f"{m}:{v}"
            samp = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed + 1000 * j + v)
            r = engine.generate(prompts[i].ids, args.sampling_tokens, method=m, sampling_cfg=samp,
                                tree=TreeConfig(budget=v) if m == "specexec" else None,
                                chain=ChainConfig(gamma=v) if m == "chain" else None)
            a = acc.setdefault(k, {"tokens": [], "steps": [], "draft_s": [], "target_s": []})
            a["tokens"].append(r.stats.new_tokens)
            a["steps"].append(r.stats.steps)
            a["draft_s"].append(r.stats.draft_s)
            a["target_s"].append(r.stats.target_s)
        log(f"sampling {j + 1}/{len(idx)}: tokens/step " + " ".join(
            f"{k}={acc[k]['tokens'][-1] / acc[k]['steps'][-1]:.1f}" for k in acc))
    for k, a in acc.items():
        g = [greedy_short[k][i] for i in idx]
        out["configs"][k] = {
            "sampled_tokens_per_step": sum(a["tokens"]) / sum(a["steps"]),
            "greedy_tokens_per_step": sum(r.tokens for r in g) / sum(r.steps for r in g),
            "sampled_tokens_per_s_measured": sum(a["tokens"]) / (sum(a["draft_s"]) + sum(a["target_s"])),
            "per_prompt_sampled": [round(t / s, 3) for t, s in zip(a["tokens"], a["steps"])],
            "per_prompt_greedy": [round(r.tokens / r.steps, 3) for r in g],
        }
    return out


def run_e2e(engine: Any, prompts: list[Prompt], refs: list[list[int]], runs: dict[str, dict[int, Run]],
            verify: dict[str, Any], idx: list[int], cfgs: list[tuple[str, int]], args: argparse.Namespace
            ) -> dict[str, Any]:
    """The full engine vs the replay: same tokens as the reference (= AR), same steps."""
    from specexec.config import ChainConfig, TreeConfig

    rows, ok_all = [], True
    for i in idx:
        engine.reset()
        ref = refs[i][: args.new_tokens]
        for m, v in cfgs:
            k = m if m == "ar" else f"{m}:{v}"
            r = engine.generate(prompts[i].ids, args.new_tokens, method=m,
                                tree=TreeConfig(budget=v) if m == "specexec" else None,
                                chain=ChainConfig(gamma=v) if m == "chain" else None)
            rep = runs.get(k, {}).get(i)
            same_tokens = r.tokens == ref
            same_steps = rep is not None and (r.stats.steps, r.stats.new_tokens) == (rep.steps, rep.tokens)
            row = {"prompt": i, "kind": prompts[i].kind, "config": k, "tokens_equal_ref": same_tokens,
                   "engine_steps": r.stats.steps, "replay_steps": rep.steps if rep else None,
                   "engine_tokens_per_step": r.stats.tokens_per_step,
                   "replay_tokens_per_step": rep.tokens / rep.steps if rep else None, "steps_equal": same_steps,
                   "engine_tokens_per_s": r.stats.tokens_per_s, "engine_draft_s": r.stats.draft_s,
                   "engine_target_s": r.stats.target_s,
                   "composed_tokens_per_s": rep.tokens / (rep.draft_s + rep.steps * verify[k]["s"]) if rep else None}
            if not same_tokens:
                d = next((j for j, (a, b) in enumerate(zip(ref, r.tokens)) if a != b), min(len(ref), len(r.tokens)))
                row["first_difference"] = d
                row["near_tie_gap"] = _top2_gap(engine, prompts[i].ids + ref[:d])
            ok_all &= same_tokens and same_steps
            rows.append(row)
            log(f"e2e prompt {i} {k}: engine {r.stats.steps} steps / replay {row['replay_steps']}; tokens = reference: "
                f"{same_tokens}; engine {r.stats.tokens_per_s:.2f} tok/s vs composed "
                f"{row['composed_tokens_per_s'] or 0:.2f}" + ("" if same_tokens and same_steps else "  <-- MISMATCH"))
    return {"rows": rows, "all_ok": ok_all}


def _top2_gap(engine: Any, ids: list[int]) -> float:
    """The target's top-2 logit gap after ``ids`` (a divergence at a gap ~1e-5 is an fp32 near-tie)."""
    import torch

    m = engine.target
    cache = m.new_cache(len(ids) + 1)
    pos = torch.arange(len(ids))
    lg = m.forward(torch.tensor(ids), pos, pos, pos[None, :] <= pos[:, None], cache, logits_rows=slice(-1, None))
    top = torch.topk(lg[0], 2).values
    return float(top[0] - top[1])


# -- goals, tables, plot ----------------------------------------------------------------------------------------------
def _spec_keys(section: dict[str, Any]) -> list[tuple[int, str]]:
    return sorted((int(k.split(":")[1]), k) for k in section if k.startswith("specexec:"))


def _chain_best(section: dict[str, Any], by: str = "tokens_per_step") -> tuple[str, float]:
    k = max((k for k in section if k.startswith("chain:")), key=lambda k: section[k][by])
    return k, section[k][by]


def goals(report: dict[str, Any]) -> dict[str, Any]:
    g: dict[str, Any] = {}
    for kind, start in (("code", 64), ("prose", 256)):
        sec = report["greedy"][kind]
        ck, cb = _chain_best(sec)
        ratios = {str(b): round(sec[k]["tokens_per_step"] / sec[k].get("chain_best_same_prompts", cb), 2)
                  for b, k in _spec_keys(sec) if b >= start}
        g[f"{kind}: specexec tokens/step vs chain's best"] = {
            "goal": f">= 2x from budget {start} on", "chain_best": f"{ck} = {cb:.2f} tokens/step",
            "ratio_by_budget": ratios, "met": all(v >= 2.0 for v in ratios.values()) if ratios else None}
    for kind in ("code", "prose", "all"):
        sec = report["greedy"][kind]
        bk = max((k for _, k in _spec_keys(sec)), key=lambda k: sec[k]["tokens_per_s"])
        ratio = sec[bk]["tokens_per_s"] / sec["ar"]["tokens_per_s"]
        cpu = max(sec["ar"]["cpu_s_per_token"] / sec[k]["cpu_s_per_token"] for _, k in _spec_keys(sec))
        g[f"{kind}: best specexec tok/s vs AR"] = {"goal": ">= 1.5x (CPU, composed)", "best": bk,
                                                  "ratio": round(ratio, 2), "ratio_cpu_time_basis": round(cpu, 2),
                                                  "met": ratio >= 1.5}
    return g


def write_markdown(report: dict[str, Any], path: Path) -> str:
    L: list[str] = []
    L.append(f"# Acceptance on the real pair (CPU): {report['target']} verifies, {report['draft']} drafts\n")
    L.append(f"{report['what']} {report['cap']}. {report['chain_note']}.\n")
    L.append(f"Early stop of the trees' growth: {report.get('grow_cost', 'off (not recorded)')}.\n")
    nk = {k: sum(p["kind"] == k for p in report["prompts"]) for k in ("code", "prose")}
    fewer = "; ".join(f"budget {b} on prompts {v} only" for b, v in report["budget_prompts"].items())
    L.append(f"{nk['code']} code prompts (CPython stdlib sources) and {nk['prose']} prose prompts "
             f"(pydoc_data/topics.py), {report['new_tokens']} greedy tokens each"
             + (f"; {fewer} (their ratio to chain's best uses chain on the same prompts)" if fewer else "") + ".\n")
    for kind in ("code", "prose"):
        sec = report["greedy"][kind]
        ar = sec["ar"]["tokens_per_s"]
        L.append(f"\n## {kind.capitalize()}\n")
        L.append("| method | prompts | tokens/step | draft passes/step | draft s/step | target s/step | "
                 "tok/s (composed) | x AR tok/s | x AR, CPU-time basis |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        rows = [("ar", "AR")] + [(k, f"chain γ={k.split(':')[1]}") for k in sec if k.startswith("chain:")]
        rows += [(k, f"specexec {b}") for b, k in _spec_keys(sec)]
        for k, name in rows:
            s = sec[k]
            star = "*" if s.get("draft_time_modeled") else ""
            L.append(f"| {name} | {s['prompts']} | {s['tokens_per_step']:.2f} | {s['draft_passes_per_step']:.1f} | "
                     f"{s['draft_s_per_step']:.2f}{star} | {s['target_s_per_step']:.2f} | {s['tokens_per_s']:.2f} | "
                     f"{s['tokens_per_s'] / ar:.2f} | {sec['ar']['cpu_s_per_token'] / s['cpu_s_per_token']:.2f} |")
        ck, cb = _chain_best(sec)
        ckt, cbt = _chain_best(sec, "tokens_per_s")
        L.append(f"\nChain's best: {ck.replace('chain:', 'γ=')} at {cb:.2f} tokens/step; fastest chain "
                 f"{ckt.replace('chain:', 'γ=')} at {cbt:.2f} tok/s. * draft time = passes x measured s/pass.")
    L.append("\n## Tree shapes (specexec, greedy, every step of every prompt)\n")
    L.append("| budget | steps | draft passes/step | draft tokens/step | tokens per pass (mean over the steps reaching it) |")
    L.append("|---:|---:|---:|---:|---|")
    for b, s in sorted(report["tree_shapes"].items(), key=lambda kv: int(kv[0])):
        L.append(f"| {b} | {s['steps']} | {s['passes']:.1f} | {s['draft_tokens_per_step']:.0f} | "
                 f"{' '.join(str(round(x)) for x in s['beams_per_pass'])} |")
    L.append("\nPass 0 is the catch-up pass (the tokens the draft cache lacks, the root included).\n")
    L.append("\n## Target verify time per step (score_tree, timed once per prompt after its replays; median)\n")
    L.append("| config | prompts | tree tokens | prefix tokens | median s | min s | max s |")
    L.append("|---|---:|---:|---:|---:|---:|---:|")
    for k, v in sorted(report["verify"].items(), key=lambda kv: kv[1]["tree_tokens"]):
        L.append(f"| {k} | {v['samples']} | {v['tree_tokens']:.0f} | {v['prefix_tokens']:.0f} | {v['s']:.2f} | "
                 f"{v['min_s']:.2f} | {v['max_s']:.2f} |")
    smp = report.get("sampling") or {}
    if smp:
        L.append(f"\n## Sampling (temperature {smp['temperature']}, top-p {smp['top_p']}) next to greedy\n")
        L.append(f"Real engine on prompts {smp['prompts']}, {smp['tokens']} tokens each; greedy: the replay on the "
                 "same prompts and length.\n")
        L.append("| config | greedy tokens/step | sampled tokens/step | sampled tok/s (engine, measured) |")
        L.append("|---|---:|---:|---:|")
        for k, v in smp["configs"].items():
            L.append(f"| {k} | {v['greedy_tokens_per_step']:.2f} | {v['sampled_tokens_per_step']:.2f} | "
                     f"{v['sampled_tokens_per_s_measured']:.2f} |")
    e2e = report.get("e2e") or {}
    if e2e:
        L.append(f"\n## End-to-end check (full engine vs replay): {'all equal' if e2e['all_ok'] else 'MISMATCH'}\n")
        L.append("| prompt | config | tokens = reference | engine steps | replay steps | engine tok/s (measured) | "
                 "composed tok/s |")
        L.append("|---|---|---|---:|---:|---:|---:|")
        for r in e2e["rows"]:
            L.append(f"| {r['prompt']} ({r['kind']}) | {r['config']} | {'yes' if r['tokens_equal_ref'] else 'NO'} "
                     f"| {r['engine_steps']} | {r['replay_steps']} | {r['engine_tokens_per_s']:.2f} | "
                     f"{(r['composed_tokens_per_s'] or 0):.2f} |")
    c = report["checks"]
    n_ref = c["ref_engine_vs_replay_prompts"]
    ref_diff, chain_diff = c["ref_engine_vs_replay"], c["chain_agreement_vs_replay"]
    ref_check = ("not compared (early stop: the engine's and the replay's measured costs differ)" if not n_ref
                 else f"on {n_ref} prompts: " + ("all equal" if not ref_diff else str(ref_diff)))
    L.append(f"\nOther checks: engine (reference generation, specexec 64) vs replay steps {ref_check}; chain "
             f"agreement count vs real Drafter.chain replay: {'all equal' if not chain_diff else chain_diff}.")
    L.append("\n## Goals\n")
    for name, v in report["goals"].items():
        detail = ", ".join(f"{k}: {v[k]}" for k in v if k not in ("goal", "met"))
        verdict = "not measured" if v["met"] is None else "met" if v["met"] else "NOT met"
        L.append(f"- {name} {v['goal']}: **{verdict}** ({detail})")
    t = report["timing_s"]
    L.append(f"\nWall time: {t['total'] / 60:.1f} min (references {t['references']:.0f} s, replay {t['replay']:.0f} s, "
             f"of which verify timing {t['verify']:.0f} s, sampling {(report.get('sampling') or {}).get('wall_s', 0):.0f} s, "
             f"e2e {(report.get('e2e') or {}).get('wall_s', 0):.0f} s).")
    text = "\n".join(L) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"code": "tab:blue", "prose": "tab:orange"}
    for kind in ("code", "prose"):
        sec = report["greedy"][kind]
        sk = _spec_keys(sec)
        xs = [b for b, _ in sk]
        a1.plot(xs, [sec[k]["tokens_per_step"] for _, k in sk], "o-", color=colors[kind], label=f"specexec, {kind}")
        ck, cb = _chain_best(sec)
        a1.axhline(cb, ls="--", color=colors[kind], label=f"chain's best (γ={ck.split(':')[1]}), {kind}")
        a2.plot(xs, [sec[k]["tokens_per_s"] for _, k in sk], "o-", color=colors[kind], label=f"specexec, {kind}")
        ckt, cbt = _chain_best(sec, "tokens_per_s")
        a2.axhline(cbt, ls="--", color=colors[kind], label=f"fastest chain (γ={ckt.split(':')[1]}), {kind}")
        a2.axhline(sec["ar"]["tokens_per_s"], ls=":", color="gray", label="AR" if kind == "code" else None)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(xs, [str(x) for x in xs])
        a.set_xlabel("tree budget (draft tokens per target step)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel("tokens per target step")
    a1.set_title("greedy acceptance (exact replay)")
    a2.set_ylabel("tokens/s (draft + steps x verify, measured)")
    a2.set_title("CPU speed (composed)")
    fig.suptitle(f"{report['target']} target, {report['draft']} draft, {report['new_tokens']} tokens per prompt")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
