#!/usr/bin/env python
"""CPU end to end: our decoding against our AR and transformers' options on the same two models, in one process.

Configurations, each run on every prompt back to back (the order rotates per prompt: none always runs first):

  ours AR              engine.generate(method="ar") on the target's shape-invariant passes (what every method runs)
  ours AR fast         the same on the fastest kernel for each pass's shape: what invariance costs (--no-fast-ar: off)
  ours default         what ``specexec generate`` does with no tuning flags (method default, budget auto)
  ours <--methods>     e.g. specexec:16, specexec:64, chain:2, ngram, heads (any method name the engine accepts)
  HF AR, assisted      transformers ``model.generate``, plain and with ``assistant_model=`` the draft in fp32 / bf16
  HF prompt lookup     ``prompt_lookup_num_tokens=``
  llama.cpp AR, spec   ``llama-completion`` and ``llama-speculative-simple`` on GGUF files (with --llama-cpp DIR),
                       given the text our engine tokenizes; other weights, so their text is recorded, not compared

Prompts: the ``code``, ``prose`` and ``grounded`` sets, built from this Python's standard library (no download).
tok/s: new tokens / seconds of the whole call (prefill included; llama.cpp's: its model loading too); decode tok/s
excludes prefill (llama.cpp's is read from its own timing lines: compare llama.cpp with us on it); transformers'
tokens per step count its streamer calls (one per target pass).

Exactness: the target's passes are shape-invariant, so greedy, every method of ours must reproduce our AR's tokens,
and sampling, our tree-walk methods (default, specexec, ngram) must with the same seed; a run that differs is a bug
(reported with its first differing token and the top-2 gap there; exit 1). Sampled ``chain:G`` runs are not compared
(exact in distribution only); our fast-kernel AR's and transformers' outputs are reported, not asserted.

    python scripts/bench_cpu.py --out bench_out/cpu.json --md bench_out/cpu.md
    python scripts/bench_cpu.py --sets code --methods specexec:8,specexec:auto,chain:3 --hf hf-ar
    python scripts/bench_cpu.py --target-dtype int8 --hf '' --llama-cpp ~/llama.cpp/build/bin

``--smoke`` (with tiny models given by --target/--draft) checks the script's logic and measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from specexec.bench import SETS, Prompt  # noqa: E402
from specexec.bench import prompt_sets as build_prompts  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
HF_CONFIGS = ("hf-ar", "hf-assisted-fp32", "hf-assisted-bf16", "hf-lookup")
HF_SPECULATIVE = ("hf-assisted-fp32", "hf-assisted-bf16", "hf-lookup")
FAST_AR = "ours-ar-fast"
LLAMA_AR, LLAMA_SPEC = "llama.cpp-ar", "llama.cpp-spec"
LLAMA_BINS = {LLAMA_AR: "llama-completion", LLAMA_SPEC: "llama-speculative-simple"}
GGUF_TARGET, GGUF_DRAFT = "qwen2.5-coder-1.5b.gguf", "qwen2.5-coder-0.5b.gguf"  # under $SPECEXEC_HOME/gguf
TARGET_DTYPES = ("auto", "int8", "q4", "bf16", "fp16", "fp32")  # OffloadConfig.target_dtype's, and a dense fp32
Log = Callable[[str], None]


@dataclass(frozen=True)
class Config:
    """One thing to time (``side``: ours, hf or llama); ``invariant`` False: ours on the fastest per-shape kernels."""

    name: str
    side: str
    method: str | None = None
    param: str | None = None  # specexec: budget (int or "auto"); chain: gamma
    invariant: bool = True


def our_configs(methods: str, fast_ar: bool = True) -> list[Config]:
    """ours-ar, ours-ar-fast (with ``fast_ar``), ours-default, each ``--methods`` entry; ValueError: a malformed one."""
    from specexec.config import METHODS

    out = [Config("ours-ar", "ours", "ar")] + ([Config(FAST_AR, "ours", "ar", invariant=False)] if fast_ar else [])
    out.append(Config("ours-default", "ours", None, "auto"))
    for item in (m.strip() for m in methods.split(",") if m.strip()):
        name, _, param = item.partition(":")
        if name not in METHODS:  # before any model loads
            raise ValueError(f"--methods {item}: unknown method; choose from {', '.join(METHODS)}")
        if name in ("specexec", "chain") and not param:
            raise ValueError(f"--methods {item}: give a budget (specexec:64) or gamma (chain:2)")
        if name not in ("specexec", "chain") and param:
            raise ValueError(f"--methods {item}: only specexec and chain take a parameter")
        if param and param != "auto" and not (param.isdigit() and int(param) > 0):
            raise ValueError(f"--methods {item}: the parameter must be a positive integer (or auto for specexec)")
        if param == "auto" and name != "specexec":
            raise ValueError(f"--methods {item}: only specexec takes auto")
        label = f"ours-{name}" + (f"-{param}" if param else "")
        if label not in {c.name for c in out}:
            out.append(Config(label, "ours", name, param or None))
    return out


def target_load(target_dtype: str, dtype: str) -> tuple[str, str]:
    """(``OffloadConfig.target_dtype``, ``dtype``) for :func:`specexec.api.load` from --target-dtype and --dtype."""
    if target_dtype in ("auto", "int8", "q4"):
        return target_dtype, dtype
    return ("auto" if target_dtype == "fp32" else target_dtype), (target_dtype if dtype == "auto" else dtype)


def llama_missing(args: argparse.Namespace) -> str | None:
    """The one error line when --llama-cpp is given and a binary or GGUF file is missing; None: all there."""
    if args.llama_cpp is None:
        return None
    bins = [args.llama_cpp / b for b in LLAMA_BINS.values()]
    missing = [str(b) for b in bins if not (b.is_file() and os.access(b, os.X_OK))]
    missing += [str(f) for f in (args.gguf_target, args.gguf_draft) if not Path(f).is_file()]
    return f"error: --llama-cpp: not found (or not executable): {', '.join(missing)}" if missing else None


def llama_command(
    name: str, args: argparse.Namespace, file: Path | str, max_new: int, threads: int, add_bos: bool, seed: int | None
) -> list[str]:
    """The llama.cpp command line of configuration ``name`` (llama.cpp-ar or llama.cpp-spec) for one prompt."""
    cmd = [
        str(args.llama_cpp / LLAMA_BINS[name]),
        "-m", str(args.gguf_target),
        "-f", str(file),
        "--no-escape",  # the prompt file's text as is (no \n processing)
        "-n", str(max_new),
        "--ignore-eos",  # every run makes -n tokens, as ours do
        "-t", str(threads),
        "-tb", str(threads),
        "-c", str(args.context),
        "--override-kv", f"tokenizer.ggml.add_bos_token=bool:{'true' if add_bos else 'false'}",
        "--perf",
        "--log-colors", "off",
    ]  # fmt: skip
    if args.temperature == 0:
        cmd += ["--temp", "0", "--top-k", "1", "-s", str(seed or 0)]
    else:  # plain sampling at the temperature, as ours (llama.cpp's own draws: not comparable)
        cmd += ["--temp", str(args.temperature), "--top-k", "0", "--top-p", "1", "--min-p", "0", "-s", str(seed or 0)]
    if name == LLAMA_AR:
        cmd += ["-no-cnv", "--no-display-prompt", "--simple-io"]
    else:
        cmd += ["-md", str(args.gguf_draft), "--spec-type", "draft-simple"]
        if args.llama_draft_max:
            cmd += ["--spec-draft-n-max", str(args.llama_draft_max)]
    return cmd


# what a run's record reads in llama.cpp's log (stderr), each line by its first matching pattern: the speculative
# example's counts, then the perf lines (whatever their prefix), which under its ``draft:`` heading are the draft's
_PERF = (
    r"\bdecoded\s+(?P<decoded_tokens>\d+) tokens in\s+(?P<decoded_s>[0-9.]+) seconds",
    r"\bencoded\s+(?P<encoded_tokens>\d+) tokens in\s+(?P<encoded_s>[0-9.]+) seconds",
    r"\b(?P<count>n_draft|n_predict|n_drafted|n_accept)\s*=\s*(?P<n>\d+)\s*$",
    r"\baccept\s*=\s*(?P<accept_pct>[0-9.]+)%",
    r"prompt eval time =\s*(?P<prompt_ms>[0-9.]+) ms /\s*(?P<prompt_tokens>\d+) tokens",
    r"(?<!prompt )\beval time =\s*(?P<eval_ms>[0-9.]+) ms /\s*(?P<eval_runs>\d+) (?:runs|tokens)",
    r"\bload time =\s*(?P<load_ms>[0-9.]+) ms",
)


def parse_llama(log: str) -> dict[str, Any]:
    """The fields of :data:`_PERF`'s patterns in llama.cpp's log (times and percentages float, counts int)."""
    out: dict[str, Any] = {}
    draft = False
    for line in log.splitlines():
        if line.rstrip().endswith(("draft:", "target:")):
            draft = line.rstrip().endswith("draft:")
        elif m := next(filter(None, (re.search(p, line) for p in _PERF[: 4 if draft else None])), None):
            got = {m["count"]: m["n"]} if "count" in m.groupdict() else m.groupdict()
            out.update({k: float(v) if k.endswith(("_s", "_ms", "_pct")) else int(v) for k, v in got.items()})
    return out


def llama_record(name: str, stdout: str, stderr: str, prompt: str, seconds: float) -> dict[str, Any]:
    """A run record from a llama.cpp run's output; ValueError: its decode timing line is missing."""
    perf = parse_llama(stderr)
    rec: dict[str, Any] = {}
    if name == LLAMA_AR:
        if "eval_ms" not in perf:
            raise ValueError(f"{LLAMA_BINS[name]}: no 'eval time = ... ms / N runs' line in its output")
        tokens = perf["eval_runs"] + 1  # N eval runs: the tokens after the first, which the prompt pass gives
        rec.update(decode_tokens=perf["eval_runs"], decode_s=perf["eval_ms"] / 1000, steps=tokens)
        rec["prefill_s"] = perf["prompt_ms"] / 1000 if "prompt_ms" in perf else None
        rec["llama_prompt_tokens"] = perf.get("prompt_tokens")
        text = stdout
    else:
        if "decoded_tokens" not in perf:
            raise ValueError(f"{LLAMA_BINS[name]}: no 'decoded N tokens in X seconds' line in its output")
        tokens = perf["decoded_tokens"]  # its own count: it may pass -n by up to a draft's length
        rec.update(decode_tokens=tokens, decode_s=perf["decoded_s"], steps=None)
        rec["prefill_s"] = perf.get("encoded_s")
        rec["llama_prompt_tokens"] = perf.get("encoded_tokens")
        rec.update({k: perf[k] for k in ("n_draft", "n_drafted", "n_accept", "accept_pct") if k in perf})
        at = stdout.find(prompt) if prompt else -1  # the example echoes the prompt before the new text
        text = stdout[at + len(prompt) :] if at >= 0 else stdout
    rec.update(
        _speed(tokens, seconds),
        tokens_per_step=1.0 if rec["steps"] else None,
        decode_tok_s=rec["decode_tokens"] / rec["decode_s"] if rec["decode_s"] > 0 else None,
        load_s=perf["load_ms"] / 1000 if "load_ms" in perf else None,
        text80=text[:80],
        ids=[],
    )
    return rec


def llama_version(bin_dir: Path) -> str:
    """``llama-completion --version``'s first line (build number and commit), or ? when it says nothing."""
    try:
        cmd = [str(bin_dir / LLAMA_BINS[LLAMA_AR]), "--version"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "?"
    lines = [ln.strip() for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "?"


def _speed(tokens: int, seconds: float) -> dict[str, Any]:
    """A run record's first fields: its new tokens, the whole call's seconds and their ratio."""
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds > 0 else 0.0}


class Runner:
    """Holds the loaded models and runs one (config, prompt ids) generation, returning a result record."""

    def __init__(self, args: argparse.Namespace, configs: list[Config]) -> None:
        import torch

        from offload.plan import OffloadConfig
        from specexec import api
        from specexec.config import SamplingConfig, TreeConfig
        from specexec.loading import hub
        from specexec.loading.checkpoint import model_dir

        self.args = args
        fixed = [int(c.param) for c in configs if c.method == "specexec" and c.param and c.param.isdigit()]
        self.tree_default = TreeConfig(budget=64, auto=True, max_budget=2048)  # ``specexec generate``'s default
        # load with room for the largest tree any configuration grows, so no run reallocates (and recalibrates)
        load_tree = replace(self.tree_default, max_budget=max([2048] + fixed))
        target_dtype, dtype = target_load(args.target_dtype, args.dtype)
        self.engine = api.load(
            args.target,
            args.draft,
            device="cpu",
            dtype=dtype,
            context=args.context,
            offload=OffloadConfig(target_dtype=target_dtype),
            tree=load_tree,
            progress=False,
            invariant=args.invariant,
        )
        if any(c.method == "heads" for c in configs):  # the target's trained heads, for --methods heads
            from specexec.propose.heads import Heads, find_heads

            found = find_heads(model_dir(hub.resolve(args.target, progress=False)))
            if found is None:
                raise SystemExit(f"error: no trained heads for {args.target}: run `specexec heads train` first")
            self.engine.heads = Heads.load(found)
        self.threads = torch.get_num_threads()  # llama.cpp's -t: as many threads as ours
        self.tok = self.engine.tokenizer.tokenizer
        self.eos = sorted(self.engine.tokenizer.eos_ids)
        self.eos_kw = {"eos_token_id": self.eos, "pad_token_id": self.eos[0] if self.eos else None}
        self.samp = SamplingConfig(temperature=args.temperature, seed=args.seed)
        self.hf: dict[str, Any] = {}  # the target, and the drafts by the configuration that uses them
        hf_names = [c.name for c in configs if c.side == "hf"]
        if hf_names:
            from transformers import AutoModelForCausalLM, GenerationConfig

            def load(name: str, dtype: Any) -> Any:
                path = model_dir(hub.resolve(name, progress=False))
                m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
                m.generation_config = GenerationConfig(**self.eos_kw)  # not the checkpoint's sampling defaults
                return m

            self.hf["target"] = load(args.target, self.engine.target.dtype)
            for name, draft_dtype in (("hf-assisted-fp32", torch.float32), ("hf-assisted-bf16", torch.bfloat16)):
                if name in hf_names:
                    self.hf[name] = load(args.draft, draft_dtype)

    def encode(self, p: Prompt) -> list[int]:
        return self.engine.encode(p.text, chat=p.chat and bool(getattr(self.tok, "chat_template", None)))

    def prompt_text(self, p: Prompt) -> str:
        """The text :meth:`encode` tokenizes (a chat prompt's rendered template), which llama.cpp is given."""
        msgs = [{"role": "user", "content": p.text}]
        if p.chat and getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return p.text

    def tie_check(self, ids: list[int], ref: list[int], i: int, seed: int | None) -> dict[str, Any]:
        """The target's top-2 gap (sampling: of the walk's Gumbel-max scores) at ``i``, where a run left ``ref``."""
        import torch

        from specexec.steps import sampling

        prefix = ids + ref[:i]  # the scores after it (the token scored there plays no part in them)
        logits = self.engine.score(prefix + [0], start=len(prefix), logits=True).logits[0]
        scores = logits.double()
        if self.args.temperature > 0 and seed is not None:
            lp = sampling.logprobs(logits[None], self.samp)[0]  # the seed plays no part in the log-probs
            scores = lp.double() + sampling.gumbels(seed, [len(prefix)], lp.shape[-1])[0]
        top2 = torch.topk(scores, 2).values
        return {"first_diff_gap": float(top2[0] - top2[1])}

    def run(self, c: Config, ids: list[int], max_new: int, seed: int | None, text: str | None = None) -> dict[str, Any]:
        """One run of ``c``; ``text``: the prompt's text (:meth:`prompt_text`), which llama.cpp is given."""
        if c.side == "llama":
            return self._llama(c, ids, text if text is not None else self.tok.decode(ids), max_new, seed)
        return self._ours(c, ids, max_new, seed) if c.side == "ours" else self._hf(c, ids, max_new, seed)

    def _llama(self, c: Config, ids: list[int], text: str, max_new: int, seed: int | None) -> dict[str, Any]:
        bos, bos_text = getattr(self.tok, "bos_token_id", None), getattr(self.tok, "bos_token", None)
        # llama.cpp adds a BOS exactly when ours did and the text does not already carry it (a chat template may)
        add_bos = bool(ids) and bos is not None and ids[0] == bos and not (bos_text and text.startswith(bos_text))
        with tempfile.TemporaryDirectory(prefix="bench_cpu_") as d:
            f = Path(d) / "prompt.txt"
            f.write_text(text, encoding="utf-8")
            cmd = llama_command(c.name, self.args, f, max_new, self.threads, add_bos, seed)
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600)
            dt = time.perf_counter() - t
        if r.returncode != 0:
            tail = " | ".join(r.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{LLAMA_BINS[c.name]} exited with {r.returncode}: {tail}")
        return llama_record(c.name, r.stdout, r.stderr, text, dt)

    def _ours(self, c: Config, ids: list[int], max_new: int, seed: int | None) -> dict[str, Any]:
        from specexec.config import ChainConfig

        tree, chain = self.tree_default, ChainConfig()
        if c.method == "specexec" and c.param and c.param != "auto":
            tree = replace(self.tree_default, budget=int(c.param), auto=False)
        elif c.method == "chain" and c.param:
            chain = ChainConfig(gamma=int(c.param))
        self.engine.reset()  # cold cache: every configuration prefills the prompt
        # ``invariant`` False: this run on the fastest per-shape kernels, then back (what each mode learnt is kept)
        fast = not c.invariant and self.engine.target.tiling is not None
        if fast:
            self.engine.set_invariant(False)
        try:
            t = time.perf_counter()
            r = self.engine.generate(
                ids, max_new, method=c.method, sampling_cfg=replace(self.samp, seed=seed), tree=tree, chain=chain
            )
            dt = time.perf_counter() - t
        finally:
            if fast:
                self.engine.set_invariant(True)
        s = r.stats
        rec = {
            **_speed(len(r.tokens), dt),
            "steps": s.steps,
            "tokens_per_step": s.tokens_per_step,
            "decode_tok_s": s.tokens_per_s,
            "prefill_s": s.prefill_s,
            "ids": list(r.tokens),
            "draft_passes": s.draft_passes,
            "mean_tree_size": round(s.mean_tree_size, 2),
            "trimmed": s.trimmed,
        }
        if s.budgets:
            rec["budgets"] = s.to_json()["budgets"]  # arms by name: -3, 0, 8, heads:4
        if s.costs_s:
            rec["costs_s"] = s.costs_s
        return rec

    def _hf(self, c: Config, ids: list[int], max_new: int, seed: int | None) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class Steps(BaseStreamer):  # counts put() calls: the first carries the prompt, each later one a pass's tokens
            puts: int = 0
            first: float | None = None

            def put(self, value: Any) -> None:
                self.puts += 1
                if self.puts == 2:
                    self.first = time.perf_counter()

            def end(self) -> None:
                pass

        greedy = self.args.temperature == 0
        gen = dict(max_new_tokens=max_new, do_sample=not greedy, num_beams=1, repetition_penalty=1.0, **self.eos_kw)
        if not greedy:
            gen.update(temperature=self.args.temperature, top_k=0, top_p=1.0)
        if c.name == "hf-lookup":
            gen["prompt_lookup_num_tokens"] = self.args.lookup_tokens
        kw = {"assistant_model": self.hf[c.name]} if c.name in self.hf else {}  # hf-assisted-*: its draft
        x = torch.tensor([ids])
        steps = Steps()
        if seed is not None:
            torch.manual_seed(seed)
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.hf["target"].generate(
                x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(**gen), streamer=steps, **kw
            )
        dt = time.perf_counter() - t
        new = out[0, len(ids) :].tolist()
        n_steps = max(steps.puts - 1, 1)
        return {
            **_speed(len(new), dt),
            "steps": n_steps,
            "tokens_per_step": len(new) / n_steps,
            "ttft_s": (steps.first - t) if steps.first is not None else None,
            "ids": new,
        }


def first_diff(a: list[int], b: list[int]) -> int | None:
    end = None if len(a) == len(b) else min(len(a), len(b))  # where the shorter one ends
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), end)


def _compared(c: Config, greedy: bool) -> bool:
    """Whether ``c``'s tokens are compared to our AR's: greedy, all but llama.cpp's; sampling, ours that draw as AR."""
    if c.side != "ours":
        return greedy and c.side != "llama"
    return greedy or c.method in (None, "specexec", "ngram", "heads", "ar")  # the tree-walk methods, and our AR


def _must_match(c: Config) -> bool:
    """Whether a compared run that differs from our AR's tokens is a bug (ours on invariant passes), not information."""
    return c.side == "ours" and c.invariant


def run_all(
    runner: Runner,
    prompts: dict[str, list[Prompt]],
    configs: list[Config],
    max_new: int,
    log: Log,
    done: Callable[[list[dict[str, Any]]], None] | None = None,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Every configuration on each prompt (ours ``repeats`` times), the order rotating; ``done``: each prompt's end."""
    greedy = runner.args.temperature == 0
    records = []
    k = n = 0
    for set_name, plist in prompts.items():
        for pi, p in enumerate(plist):
            ids = runner.encode(p)
            text = runner.prompt_text(p) if any(c.side == "llama" for c in configs) else None
            n += 1
            seed = None if greedy else runner.args.seed + n
            for rep in range(repeats):
                order = configs[k % len(configs) :] + configs[: k % len(configs)]
                k += 1
                order = [c for c in order if rep == 0 or c.side == "ours"]
                got = {}
                for c in order:
                    got[c.name] = rec = runner.run(c, ids, max_new, seed, *([text] if c.side == "llama" else []))
                    log(
                        f"{set_name} {pi + 1}/{len(plist)} {p.name[:40]:40s} {c.name:18s} {rec['tokens']:4d} tok "
                        f"{rec['tok_s']:7.2f} tok/s {_f(rec['tokens_per_step'], '5.2f')} tok/step"
                        + (f"  decode {_f(rec.get('decode_tok_s'))} tok/s" if c.side == "llama" else "")
                        + (f"  budgets {rec['budgets']} trimmed {rec['trimmed']}" if rec.get("budgets") else "")
                    )
                ref = got.get("ours-ar", {}).get("ids")
                for i, c in enumerate(order):
                    rec = got[c.name]
                    row = {"set": set_name, "prompt": p.name, "prompt_tokens": len(ids), "config": c.name, "order": i}
                    row.update(repeat=rep, **{k2: v for k2, v in rec.items() if k2 != "ids"})
                    if ref is not None and c.name != "ours-ar" and _compared(c, greedy):
                        row.update(_vs_ar(runner, c, ref, rec["ids"], ids, seed, log))
                    records.append(row)
            if done is not None:
                done(records)
    return records


def _vs_ar(runner: Runner, c: Config, ref: list[int], out: list[int], ids: list[int], seed: int | None, log: Log):
    """A compared run's fields: whether it kept our AR's tokens ``ref``, and where it left them (the top-2 gap)."""
    d = first_diff(ref, out)
    row: dict[str, Any] = {"match_ar": d is None, "must_match_ar": _must_match(c), "first_diff": d}
    if d is not None and d < len(ref):
        row.update(runner.tie_check(ids, ref, d, seed))
    if d is not None:
        kind = "MISMATCH (a bug)" if row["must_match_ar"] else "differs (reported)"
        gap = f", top-2 gap {row['first_diff_gap']:.4g}" if "first_diff_gap" in row else ""
        log(f"{kind}: {c.name} left our AR's tokens at {d}{gap}")
    return row


def summarize(records: list[dict[str, Any]], configs: list[Config], greedy: bool) -> dict[str, Any]:
    """Per set and config: tok/s over all runs, ratios, per-prompt minima (a prompt's tok/s: its runs' median)."""
    sets: dict[str, Any] = {}
    for set_name in dict.fromkeys(r["set"] for r in records):
        by = {c.name: [r for r in records if r["set"] == set_name and r["config"] == c.name] for c in configs}
        summ: dict[str, Any] = {}
        for c in configs:
            rs = by[c.name]
            tokens, secs = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
            known_steps = all(r.get("steps") is not None for r in rs)  # llama.cpp spec: not in its output
            s = {"side": c.side, "prompts": len({r["prompt"] for r in rs}), "runs": len(rs), "tokens": tokens}
            s.update(seconds=secs, tok_s=tokens / secs if secs > 0 else 0.0)
            s["tokens_per_step"] = tokens / max(sum(r["steps"] for r in rs), 1) if known_steps else None
            if c.side == "ours":
                dec = [r["tokens"] / r["decode_tok_s"] for r in rs if r.get("decode_tok_s")]
                s["decode_tok_s"] = tokens / sum(dec) if dec and sum(dec) > 0 else None
            elif c.side == "llama":  # its own decode clock: tokens after the prompt pass / their seconds
                dsec = sum(r.get("decode_s") or 0.0 for r in rs)
                s["decode_tok_s"] = sum(r.get("decode_tokens") or 0 for r in rs) / dsec if dsec > 0 else None
                drafted = sum(r.get("n_drafted") or 0 for r in rs)
                if drafted:
                    s["accept"] = sum(r.get("n_accept") or 0 for r in rs) / drafted
            if c.name != "ours-ar" and any("match_ar" in r for r in rs):
                s.update(mismatches=sum(not r.get("match_ar", True) for r in rs), must_match_ar=_must_match(c))
            summ[c.name] = s
        ar, fast_ar = summ.get("ours-ar", {}).get("tok_s"), summ.get(FAST_AR, {}).get("tok_s")
        best_hf = max((n for n in HF_SPECULATIVE if n in summ), key=lambda n: summ[n]["tok_s"], default=None)
        hf_best = summ[best_hf]["tok_s"] if best_hf else None
        ar_med = _by_prompt(by.get("ours-ar", []), statistics.median)
        for c in configs:  # llama.cpp's whole-call tok/s includes loading its models: no ratios (decode-only below)
            s, ours = summ[c.name], c.side != "llama"
            ratios = [
                m / ar_med[q] for q, m in _by_prompt(by[c.name], statistics.median).items() if ar_med.get(q, 0) > 0
            ]
            s["vs_our_ar"] = s["tok_s"] / ar if ar and ours else None
            s["vs_our_fast_ar"] = s["tok_s"] / fast_ar if fast_ar and ours else None
            s["vs_best_hf_speculative"] = s["tok_s"] / hf_best if hf_best and ours else None
            s["min_prompt_vs_our_ar"] = min(ratios) if ratios and ours else None
        # our AR's runs of each prompt, in order: its second run against its first is noise alone
        noise = [t[1] / t[0] for t in _by_prompt(by.get("ours-ar", [])).values() if len(t) >= 2 and t[0] > 0]
        if "ours-ar" in summ:
            summ["ours-ar"]["min_prompt_rerun_vs_first"] = min(noise) if noise else None
        sets[set_name] = {"configs": summ, "best_hf_speculative": best_hf, "decode": _decode_row(summ)}
    return sets


def _by_prompt(rows: list[dict[str, Any]], agg: Callable[[list[float]], Any] = list) -> dict[str, Any]:
    """Each prompt's runs' tok/s, in run order, through ``agg`` (e.g. their median)."""
    runs: dict[str, list[float]] = {}
    for r in rows:
        runs.setdefault(r["prompt"], []).append(r["tok_s"])
    return {q: agg(t) for q, t in runs.items()}


def _decode_row(summ: dict[str, Any]) -> dict[str, Any]:
    """A set's decode-only comparison (prefill and llama.cpp's model loading excluded): ours and llama.cpp's."""
    dec = lambda name: summ.get(name, {}).get("decode_tok_s")
    ar, default, l_ar, l_spec = dec("ours-ar"), dec("ours-default"), dec(LLAMA_AR), dec(LLAMA_SPEC)
    return {
        "ours_ar": ar,
        "ours_default": default,
        "default_vs_our_ar": default / ar if default and ar else None,
        "llama_ar": l_ar,
        "llama_spec": l_spec,
        "llama_spec_accept": summ.get(LLAMA_SPEC, {}).get("accept"),
        "default_vs_llama_ar": default / l_ar if default and l_ar else None,
    }


def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


RATIOS = ("vs_our_ar", "vs_our_fast_ar", "vs_best_hf_speculative", "min_prompt_vs_our_ar")  # a config's table row
NO_TILING = " **No shape-invariant tiling passed the check on this machine: the target ran its fastest kernels.**"


def markdown(report: dict[str, Any]) -> str:
    m, lc = report["meta"], report["meta"].get("llama_cpp")
    lines = [
        f"### CPU benchmark: {m['target']} + {m['draft']}, {m['date']}",
        "",
        f"{m['machine']}; torch {m['torch']} ({m['threads']} threads), transformers {m['transformers']}; "
        f"our target {m.get('target_weights', 'dense')} weights computing in {m['dtype']}"
        + (f" (--target-dtype {m['target_dtype']})" if m.get("target_dtype") else "")
        + (f"; llama.cpp {lc['version']}, {lc['gguf_target']} + {lc['gguf_draft']}" if lc else "")
        + f"; {m['max_new_tokens']} new tokens, temperature {m['temperature']}; "
        f"{m['prompts_per_set']} prompts per set"
        + (f", ours run {m['repeats']} times each (a prompt's figure: its median)" if m.get("repeats", 1) > 1 else "")
        + f"; commit {m['commit']}."
        + (" **SMOKE RUN (tiny models): the numbers mean nothing.**" if m.get("smoke") else "")
        + (NO_TILING if "invariant_tiling" in m and m["invariant_tiling"] is None else "")
        + (f" **PARTIAL: the run stopped after {m['partial']}.**" if m.get("partial") else ""),
        "",
        "tok/s = new tokens / seconds of the whole call (prefill included, same clock for every row); "
        "decode tok/s excludes our prefill. Ratios: against our AR (shape-invariant passes, as every method of "
        "ours runs), against our AR on the fastest per-shape kernels (fast AR) and against the best of "
        "transformers' speculative options (assisted fp32 / bf16, prompt lookup) in the same set; min/prompt = the "
        "lowest per-prompt tok/s ratio to our AR. llama.cpp rows: tok/s over the whole subprocess call (its model "
        "loading included; no ratios), decode tok/s from its own timing lines (prefill excluded).",
        "",
        "Decode-only tok/s (prefill excluded; llama.cpp: its own eval / decoded timings, other weights (GGUF), "
        "text not compared):",
        "",
        "| set | ours AR | ours default | default × our AR | llama.cpp AR | llama.cpp spec | llama.cpp spec accept "
        "| ours default / llama.cpp AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for set_name, d in report["sets"].items():
        r = d.get("decode") or {}
        lines.append(
            f"| {set_name} | {_f(r.get('ours_ar'))} | {_f(r.get('ours_default'))} | "
            f"{_f(r.get('default_vs_our_ar'), suffix='×')} | {_f(r.get('llama_ar'))} | {_f(r.get('llama_spec'))} | "
            f"{_f(None if r.get('llama_spec_accept') is None else 100 * r['llama_spec_accept'], '.1f', '%')} | "
            f"{_f(r.get('default_vs_llama_ar'), suffix='×')} |"
        )
    lines.append("")
    greedy = m["temperature"] == 0 or any(
        "mismatches" in s for d in report["sets"].values() for s in d["configs"].values()
    )  # the column: greedy, or sampled runs of our tree-walk methods (the same seed gives AR's text)
    for set_name, d in report["sets"].items():
        rerun = d["configs"].get("ours-ar", {}).get("min_prompt_rerun_vs_first")
        lines += [
            f"**{set_name}** (best transformers speculative: {d['best_hf_speculative'] or '-'})"
            + (f"; noise: our AR's second run against its first, lowest prompt {rerun:.2f}×" if rerun else ""),
            "",
            "| config | tok/s | × our AR | × fast AR | × best HF spec | min/prompt × our AR | decode tok/s "
            "| tokens/step |" + (" mismatches vs our AR |" if greedy else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|" if greedy else ""),
        ]
        for name, s in d["configs"].items():
            cells = [f"{s['tok_s']:.2f}", *(_f(s.get(k), suffix="×") for k in RATIOS), _f(s.get("decode_tok_s"))]
            cells += [_f(s["tokens_per_step"])] + ([_mismatches(s)] if greedy else [])
            lines.append(f"| {name} | {' | '.join(cells)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _mismatches(s: dict[str, Any]) -> str:
    """A summary's "mismatches vs our AR" cell."""
    mm = s.get("mismatches")
    if mm is None:
        return "-"
    note = " **(a bug)**" if mm else ""
    if s["side"] == "hf" or not s.get("must_match_ar", True):
        note = f" ({'HF' if s['side'] == 'hf' else 'fast kernels'}: reported, not asserted)"
    return f"{mm}/{s.get('runs', s['prompts'])}{note}"


def _meta(args: argparse.Namespace, runner: Runner, configs: list[Config], prompts: dict[str, list[Prompt]]):
    import torch
    import transformers

    e = runner.engine
    return {
        "target": args.target,
        "draft": args.draft,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()} {platform.system()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(e.target.dtype).replace("torch.", ""),  # the target's compute dtype
        "target_dtype": args.target_dtype,  # what was asked (--target-dtype)
        "target_weights": getattr(e, "target_weights", None) or "dense",  # int8 or dense
        "draft_weights": getattr(e, "draft_weights", None),
        "invariant_tiling": getattr(getattr(e, "invariance", None), "tiling", None),  # None: none on this machine
        "draft_dtype": str(e.draft.dtype).replace("torch.", "") if e.draft else None,
        **{k: getattr(args, k) for k in ("max_new_tokens", "temperature", "seed", "prompts_per_set", "repeats")},
        "lookup_tokens": args.lookup_tokens,
        "commit": git_commit(),
        "smoke": args.smoke,
        "default_tree": asdict(runner.tree_default),
        "configs": [asdict(c) for c in configs],
        "llama_cpp": _llama_meta(args, runner) if args.llama_cpp is not None else None,
        "prompts": {
            s: [{"name": p.name, "chat": p.chat, "chars": len(p.text)} for p in ps] for s, ps in prompts.items()
        },
    }


def _llama_meta(args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    """llama.cpp's version, files and command lines (PROMPT.txt stands for each prompt's file)."""
    return {
        "dir": str(args.llama_cpp),
        "version": llama_version(args.llama_cpp),
        "gguf_target": str(args.gguf_target),
        "gguf_draft": str(args.gguf_draft),
        "threads": runner.threads,
        "commands": {
            name: llama_command(name, args, "PROMPT.txt", args.max_new_tokens, runner.threads, False, None)
            for name in LLAMA_BINS  # the llama.cpp configurations
        },
    }


_HELP = {
    "--methods": "our extra configurations, comma-separated: specexec:N, specexec:auto, chain:G, a method name (ngram)",
    "--no-fast-ar": f"leave out {FAST_AR} (our AR on the target's fastest per-shape kernels)",
    "--no-invariant": "run all of ours on the target's fastest per-shape kernels (what the engine did before "
    "shape-invariant passes; exactness is then not required of the default; implies --no-fast-ar)",
    "--hf": f"transformers configurations, from {', '.join(HF_CONFIGS)} ('' for none)",
    "--target-dtype": "our target's weights: auto (q4 or int8 where this CPU's probe measures it faster), int8 "
    "(computing in bf16), q4 (4-bit, computing in fp32), or dense bf16/fp16/fp32 (sets the compute dtype when "
    "--dtype is auto)",
    "--llama-cpp": "a llama.cpp build's bin directory (llama-completion, llama-speculative-simple): adds llama.cpp "
    "AR and llama.cpp spec to the rotation",
    "--llama-draft-max": "llama.cpp spec's --spec-draft-n-max (default: llama.cpp's own)",
    "--repeats": "run our configurations N times on each prompt (interleaved; transformers and llama.cpp once) and "
    "compare each prompt at its median: a single run's host noise of a few percent otherwise sets the lowest "
    "prompt's ratio; with N >= 2 the tables also give the lowest ratio of our AR's second run to its first",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    home = Path(os.environ.get("SPECEXEC_HOME") or Path.home() / ".cache" / "specexec").expanduser()
    add, h = p.add_argument, _HELP
    add("--target", default=TARGET)
    add("--draft", default=DRAFT)
    add("--prompts-per-set", type=int, default=None, help="default 20 (1 with --smoke)")
    add("--max-new-tokens", type=int, default=None, help="default 128 (8 with --smoke)")
    add("--temperature", type=float, default=0.0, help="0 (greedy, exactness checked) or e.g. 0.7")
    add("--seed", type=int, default=0, help="sampling: prompt k uses seed + k (ours and transformers)")
    add("--sets", default=",".join(SETS), help=f"comma-separated, from {', '.join(SETS)}")
    add("--methods", default="", help=h["--methods"])
    add("--no-fast-ar", dest="fast_ar", action="store_false", help=h["--no-fast-ar"])
    add("--no-invariant", dest="invariant", action="store_false", help=h["--no-invariant"])
    add("--hf", default=",".join(HF_CONFIGS), help=h["--hf"])
    add("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-lookup")
    add("--dtype", default="auto", help="our engine's dtype (auto: what generate uses)")
    add("--target-dtype", default="auto", choices=TARGET_DTYPES, help=h["--target-dtype"])
    add("--llama-cpp", type=Path, default=None, metavar="DIR", help=h["--llama-cpp"])
    add("--gguf-target", type=Path, default=home / "gguf" / GGUF_TARGET, help="llama.cpp's target")
    add("--gguf-draft", type=Path, default=home / "gguf" / GGUF_DRAFT, help="llama.cpp's draft")
    add("--llama-draft-max", type=int, default=None, help=h["--llama-draft-max"])
    add("--repeats", type=int, default=1, help=h["--repeats"])
    add("--context", type=int, default=4096)
    add("--out", type=Path, default=None, help="write the JSON report here")
    add("--md", type=Path, default=None, help="append the markdown tables to this file")
    add("--smoke", action="store_true", help="logic check on tiny models (give --target/--draft)")
    add("--quiet", action="store_true", help="no per-run progress lines")
    args = p.parse_args(argv)
    args.prompts_per_set = (1 if args.smoke else 20) if args.prompts_per_set is None else args.prompts_per_set
    args.max_new_tokens = (8 if args.smoke else 128) if args.max_new_tokens is None else args.max_new_tokens
    if args.prompts_per_set < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        p.error("--prompts-per-set, --max-new-tokens and --repeats must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    computes = {"int8": "bf16", "q4": "fp32"}.get(args.target_dtype)  # the compute dtype of a resident format
    if computes and args.dtype not in ("auto", computes):
        p.error(f"--target-dtype {args.target_dtype} computes in {computes}: give --dtype auto or {computes}")
    if args.target_dtype not in ("auto", "int8", "q4") and args.dtype not in ("auto", args.target_dtype):
        p.error(f"--target-dtype {args.target_dtype} with --dtype {args.dtype}: give one dense dtype")
    if args.llama_draft_max is not None and args.llama_draft_max < 1:
        p.error("--llama-draft-max must be >= 1")
    args.sets = _choose(p, "--sets", args.sets, SETS, empty_ok=False)
    args.hf = _choose(p, "--hf", args.hf, HF_CONFIGS, empty_ok=True)
    args.fast_ar = args.fast_ar and args.invariant  # --no-invariant implies --no-fast-ar
    try:
        ours = our_configs(args.methods, args.fast_ar)
    except ValueError as e:
        p.error(str(e))
    if not args.invariant:  # fast kernels throughout: differences from our AR are reported, not errors
        ours = [replace(c, invariant=False) for c in ours]
    args.configs = ours + [Config(h, "hf") for h in args.hf]
    args.configs += [Config(LLAMA_AR, "llama"), Config(LLAMA_SPEC, "llama")] if args.llama_cpp is not None else []
    return args


def _choose(p: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...], empty_ok: bool):
    """The comma-separated names of ``value``; a usage error (exit 2) names any not in ``allowed``."""
    got = tuple(s.strip() for s in value.split(",") if s.strip())
    bad = [s for s in got if s not in allowed]
    if bad or not (got or empty_ok):
        p.error(f"{flag}: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(allowed)}")
    return got


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = args.configs
    if missing := llama_missing(args):  # before loading anything
        print(missing, file=sys.stderr)
        return 2
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    prompts = build_prompts(args.sets, args.prompts_per_set)
    others = (", transformers" if args.hf else "") + ("; llama.cpp runs its own" if args.llama_cpp else "")
    log(f"loading {args.target} + {args.draft} (ours{others})")
    runner = Runner(args, configs)
    # warm-up: every configuration once on a short prompt (allocations, lazy imports, the auto budget's costs)
    warm = next(p for ps in prompts.values() for p in ps)
    ids, text = runner.encode(warm), runner.prompt_text(warm)
    for c in configs:  # (llama.cpp's too: the GGUF files in the page cache before the timed runs)
        runner.run(c, ids, 2 if args.smoke else 4, args.seed, *([text] if c.side == "llama" else []))
    log("warm-up done")
    meta = _meta(args, runner, configs, prompts)  # the commit and date the run starts from
    total = sum(len(ps) for ps in prompts.values())

    def checkpoint(records: list[dict[str, Any]]) -> None:  # a stopped run still leaves its finished prompts
        if args.out:
            n = len({(r["set"], r["prompt"]) for r in records})
            write_report(args.out, {"meta": {**meta, "partial": f"{n} of {total} prompts"}, "runs": records})

    records = run_all(runner, prompts, configs, args.max_new_tokens, log, checkpoint, args.repeats)
    report = {"meta": meta, "sets": summarize(records, configs, args.temperature == 0), "runs": records}
    md = markdown(report)
    print(md)
    save(args, report, md, log)
    return _verdict(records)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write the JSON report whole (a temporary file renamed over it: a reader never sees half a report)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def save(args: argparse.Namespace, report: dict[str, Any], md: str, log: Log) -> None:
    """The JSON report to ``--out``, the markdown tables appended to ``--md`` (each when given)."""
    if args.out:
        write_report(args.out, report)
        log(f"wrote {args.out}")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        sep = "\n" if args.md.exists() and args.md.stat().st_size else ""
        with args.md.open("a", encoding="utf-8") as f:
            f.write(sep + md)
        log(f"appended the tables to {args.md}")


def git_commit() -> str:
    """This checkout's short commit ("?" where git cannot say)."""
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return r.stdout.strip() or "?"


def _verdict(records: list[dict[str, Any]]) -> int:
    """1 when a run that must reproduce our AR's tokens left them (a bug), each named with where and the top-2 gap."""
    bad = [r for r in records if r.get("must_match_ar") and not r["match_ar"]]
    for r in bad:
        gap = f", top-2 gap {r['first_diff_gap']:.4g}" if r.get("first_diff_gap") is not None else ""
        where = f"{r['set']} {r['prompt']} {r['config']}"
        print(f"error: {where}: differs from our AR at token {r['first_diff']}{gap}", file=sys.stderr)
    if bad:
        print(f"error: {len(bad)} runs of our methods differ from our AR (a bug)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
