#!/usr/bin/env python
"""CPU end to end: our decoding against our AR and transformers' options on the same two models, in one process.

Configurations, each run on every prompt back to back (interleaved per prompt; the order rotates per prompt so no
configuration always runs first):

  ours AR              engine.generate(method="ar"), the target's shape-invariant passes (what every method runs)
  ours AR fast         the same with the target's fastest kernel for each pass's shape (engine.set_invariant(False):
                       what invariance costs plain decoding; --no-fast-ar leaves it out)
  ours default         what ``specexec generate`` does with no tuning flags (method default, budget auto)
  ours <--methods>     e.g. specexec:16, specexec:64, chain:2, ngram, heads (any method name the engine accepts)
  HF AR                transformers ``model.generate``
  HF assisted fp32     ``assistant_model=`` the draft in fp32
  HF assisted bf16     ``assistant_model=`` the draft in bf16 (a second copy)
  HF prompt lookup     ``prompt_lookup_num_tokens=``
  llama.cpp AR         ``llama-completion`` on the GGUF target (with --llama-cpp DIR)
  llama.cpp spec       ``llama-speculative-simple --spec-type draft-simple`` on the GGUF target + draft

Our target's weights: ``--target-dtype`` (auto: q4 or int8 where this CPU's probe measures it clearly faster than dense;
int8: int8 weights computing in bf16; q4: 4-bit weights computing in fp32; bf16/fp16/fp32: dense in that dtype).
The report's metadata names the weight format (``target_weights``: int8, q4 or dense) and the compute dtype.

llama.cpp (``--llama-cpp DIR``, its build's bin directory): each llama.cpp configuration is a subprocess per prompt,
in the same interleaved rotation as ours, given the same prompt text our engine tokenizes (a chat-template prompt:
the rendered template, its special tokens parsed by llama.cpp; BOS added exactly when our tokenizer adds one, by
``--override-kv tokenizer.ggml.add_bos_token``), greedy (``--temp 0 --top-k 1``; sampling: ``--temp T`` with
top-k/top-p/min-p off and the prompt's seed), ``-n`` new tokens with ``--ignore-eos``, our torch thread count
(``-t``/``-tb``), ``-c --context``. Its weights are other weights (the GGUF files, e.g. Q4_K_M), so its text is
recorded (first 80 characters), not compared. Its speed is read from its own timing lines: AR, the
``eval time = X ms / N runs`` line (decode only: the first token comes from the prompt pass); spec, the
``decoded N tokens in X seconds`` line (decode only) and the acceptance lines (n_drafted, n_accept). The
speculative example may go past ``-n`` by up to a draft's length: its own token count is reported. The whole call's
wall time (model loading included) gives its tok/s column; compare llama.cpp with us on the decode-only tok/s (the
decode-only table, one row per set).

Three prompt sets built at run time from this Python's standard library (no download): ``code`` (stdlib function
headers + docstrings, raw completion), ``prose`` (openings of ``pydoc_data`` topics, raw completion) and
``grounded`` (chat-template requests that contain the material to work on: add type hints / rename / write a
docstring / translate a stdlib function given in full, summarize a given pydoc text).

Every configuration gets the same prompt ids. Speed is new tokens / seconds of the whole call (prefill included,
the same clock for ours and transformers'); our decode-only tok/s (prefill excluded, from our stats) is reported
beside it. Tokens per step for transformers counts its streamer calls (one per target pass).

Exactness: the target runs shape-invariant passes (each position's logits are bit-identical whatever pass computes
them), so with greedy decoding every method of ours must reproduce our AR's tokens exactly, and with sampling
(--temperature 0.7) our tree-walk methods (the default, specexec, ngram) must reproduce our AR with the same seed
(the walk's draws depend only on the seed and the position). Any run that differs is a bug: it is counted as a
mismatch, its first differing token and the target's top-2 gap there are reported, and the script exits 1. Sampled
``chain:G`` runs (the speculative sampling rule) are exact in distribution, not seed for seed, and are not
compared. Our fast-kernel AR and transformers' outputs are compared to our AR and reported, not asserted (other
kernels round differently, so they may part at near-ties); transformers' sampled outputs are not comparable.

    python scripts/bench_cpu.py --out bench_out/cpu.json --md bench_out/cpu.md
    python scripts/bench_cpu.py --sets code --methods specexec:8,specexec:auto,chain:3 --hf hf-ar
    python scripts/bench_cpu.py --target-dtype int8 --hf '' --llama-cpp ~/llama.cpp/build/bin

``--smoke`` (with tiny models given by --target/--draft) checks the script's logic and measures nothing.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

SETS = ("code", "prose", "grounded")
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
HF_CONFIGS = ("hf-ar", "hf-assisted-fp32", "hf-assisted-bf16", "hf-lookup")
HF_SPECULATIVE = ("hf-assisted-fp32", "hf-assisted-bf16", "hf-lookup")
FAST_AR = "ours-ar-fast"
LLAMA_AR, LLAMA_SPEC = "llama.cpp-ar", "llama.cpp-spec"
LLAMA_BINS = {LLAMA_AR: "llama-completion", LLAMA_SPEC: "llama-speculative-simple"}
GGUF_TARGET, GGUF_DRAFT = "qwen2.5-coder-1.5b.gguf", "qwen2.5-coder-0.5b.gguf"  # under $SPECEXEC_HOME/gguf
# our --target-dtype: the library's resident CPU formats (OffloadConfig.target_dtype) and a dense fp32
TARGET_DTYPES = ("auto", "int8", "q4", "bf16", "fp16", "fp32")

# Pure-Python stdlib modules whose public functions have docstrings (missing ones are skipped).
CODE_MODULES = (
    "textwrap", "fnmatch", "statistics", "heapq", "shlex", "string", "json", "base64", "calendar", "difflib",
    "glob", "posixpath", "colorsys", "html", "ipaddress", "linecache", "mimetypes", "pprint", "quopri", "shutil",
    "tempfile", "tokenize", "urllib.parse", "uuid", "gettext", "copy", "inspect", "secrets", "dataclasses",
    "functools", "keyword", "bisect", "random", "csv", "zipfile", "locale", "ntpath", "platform", "sysconfig",
    "warnings",
)  # fmt: skip
GROUNDED_TASKS = (
    ("hints", "Add type hints to this function. Reply with the complete function.\n\n```python\n{code}\n```"),
    (
        "rename",
        "Rewrite this code with clearer variable names, keeping its behaviour the same.\n\n```python\n{code}\n```",
    ),
    ("docstring", "Write a docstring for this function and show the function with it.\n\n```python\n{code}\n```"),
    ("translate", "Translate this Python function to JavaScript.\n\n```python\n{code}\n```"),
    ("summarize", "Summarize the following text in a short paragraph.\n\n{text}"),
)


# ---------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    set: str
    name: str
    text: str
    chat: bool = False


def _stdlib_functions() -> list[tuple[str, Any, str]]:
    """(qualname, function, source) of public module-level pure-Python functions with a docstring, round-robin
    over CODE_MODULES so consecutive picks come from different modules."""
    per_module: list[list[tuple[str, Any, str]]] = []
    for modname in CODE_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        found = []
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__ or not fn.__doc__:
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            found.append((f"{modname}.{name}", fn, src))
        if found:
            per_module.append(found)
    out = []
    for i in range(max((len(f) for f in per_module), default=0)):
        out += [f[i] for f in per_module if i < len(f)]
    return out


def _header_and_docstring(src: str) -> str | None:
    """A function's signature and docstring (the model writes the body); None when it has no body after them."""
    src = textwrap.dedent(src)
    try:
        node = ast.parse(src).body[0]
    except SyntaxError:
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
        return None
    first = node.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return None
    return "\n".join(src.splitlines()[: first.end_lineno]) + "\n"


def _without_docstring(src: str) -> str:
    """A function's source (from :func:`_header_and_docstring`'s checks) with its docstring cut out."""
    src = textwrap.dedent(src)
    node = ast.parse(src).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    first = node.body[0]
    lines = src.splitlines()
    return "\n".join(lines[: first.lineno - 1] + lines[first.end_lineno :])


def _pydoc_texts(chars: int) -> list[tuple[str, str]]:
    """(topic, text) from ``pydoc_data``: each topic's opening (title dropped) cut at a sentence end."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    out = []
    for topic in sorted(topics):
        body = topics[topic].split("\n\n", 1)[-1].strip()
        if len(body) < 300:
            continue
        cut = body[:chars]
        end = cut.rfind(". ")
        out.append((topic, cut[: end + 1] if end > chars // 3 else cut))
    return out


def _spread(items: list, n: int) -> list:
    """``n`` items spread evenly over the list (deterministic)."""
    if len(items) <= n:
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def build_prompts(sets: tuple[str, ...], n: int) -> dict[str, list[Prompt]]:
    funcs = _stdlib_functions()
    out: dict[str, list[Prompt]] = {}
    code = [Prompt("code", q, h) for q, _, s in funcs if (h := _header_and_docstring(s))][:n]
    if "code" in sets:
        out["code"] = code
    if "prose" in sets:
        out["prose"] = [Prompt("prose", f"pydoc:{t}", x) for t, x in _spread(_pydoc_texts(500), n)]
    if "grounded" in sets:
        # whole functions of moderate size (at least 5 lines of code besides the docstring), not in the code set
        used = {p.name for p in code}  # the same choice whichever sets run
        bodies = [
            (q, s)
            for q, _, s in funcs
            if q not in used
            and len(s) <= 2000
            and _header_and_docstring(s)
            and _without_docstring(s).strip().count("\n") >= 5
        ]
        texts = _pydoc_texts(1500)
        texts = texts[len(texts) // 2 :] + texts[: len(texts) // 2]  # not the same openings as the prose set
        grounded, bi, ti = [], 0, 0
        for i in range(n):
            kind, template = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
            if kind == "summarize":
                if ti >= len(texts):
                    continue
                topic, text = texts[ti]
                ti += 1
                grounded.append(Prompt("grounded", f"{kind}:pydoc:{topic}", template.format(text=text), chat=True))
            else:
                if bi >= len(bodies):
                    continue
                q, src = bodies[bi]
                bi += 1
                given = _without_docstring(src) if kind == "docstring" else textwrap.dedent(src)
                grounded.append(Prompt("grounded", f"{kind}:{q}", template.format(code=given.rstrip()), chat=True))
        out["grounded"] = grounded
    for s in sets:
        if len(out.get(s, [])) < n:
            print(f"warning: only {len(out.get(s, []))} {s} prompts available (asked {n})", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """One thing to time. ``side`` is ours, hf or llama (llama.cpp); ``method``/``param`` drive our engine;
    ``invariant`` False: our target runs its fastest per-shape kernels for this run (its tokens need not equal our
    AR's)."""

    name: str
    side: str
    method: str | None = None
    param: str | None = None  # specexec: budget (int or "auto"); chain: gamma
    invariant: bool = True


def our_configs(methods: str, fast_ar: bool = True) -> list[Config]:
    """ours-ar, ours-ar-fast (unless ``fast_ar`` is False), ours-default, then each ``--methods`` entry:
    ``specexec:N``, ``specexec:auto``, ``chain:G`` or a method name; ValueError names a malformed entry."""
    out = [Config("ours-ar", "ours", "ar")]
    if fast_ar:
        out.append(Config(FAST_AR, "ours", "ar", invariant=False))
    from specexec.config import METHODS

    out.append(Config("ours-default", "ours", None, "auto"))
    for item in (m.strip() for m in methods.split(",")):
        if not item:
            continue
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


def default_tree(max_budget: int = 2048):
    """The tree settings of ``specexec generate`` with no tuning flags: budget auto (starting at 64, capped at
    --max-budget 2048), beams/branch/depth at their defaults."""
    from specexec.config import TreeConfig

    return TreeConfig(budget=min(64, max_budget), auto=True, max_budget=max_budget)


def target_load(target_dtype: str, dtype: str) -> tuple[str, str]:
    """(``OffloadConfig.target_dtype``, ``dtype``) for :func:`specexec.api.load` from our --target-dtype and --dtype:
    auto and int8 pass through; a dense format (bf16, fp16, fp32) is the compute dtype when --dtype is auto (fp32 is
    no ``OffloadConfig`` format: the target is then dense in --dtype fp32)."""
    if target_dtype in ("auto", "int8", "q4"):
        return target_dtype, dtype
    return ("auto" if target_dtype == "fp32" else target_dtype), (target_dtype if dtype == "auto" else dtype)


# ---------------------------------------------------------------------------------------------- llama.cpp


def llama_missing(args: argparse.Namespace) -> str | None:
    """The one error line when --llama-cpp is given and a binary or GGUF file is missing; None: all there."""
    if args.llama_cpp is None:
        return None
    missing = [
        str(args.llama_cpp / b)
        for b in LLAMA_BINS.values()
        if not ((args.llama_cpp / b).is_file() and os.access(args.llama_cpp / b, os.X_OK))
    ]
    missing += [str(f) for f in (args.gguf_target, args.gguf_draft) if not Path(f).is_file()]
    if not missing:
        return None
    return f"error: --llama-cpp: not found (or not executable): {', '.join(missing)}"


def llama_command(
    name: str,
    args: argparse.Namespace,
    prompt_file: Path | str,
    max_new: int,
    threads: int,
    add_bos: bool,
    seed: int | None,
) -> list[str]:
    """The llama.cpp command line of configuration ``name`` (llama.cpp-ar or llama.cpp-spec) for one prompt."""
    cmd = [
        str(args.llama_cpp / LLAMA_BINS[name]),
        "-m", str(args.gguf_target),
        "-f", str(prompt_file),
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


_PERF = {
    "prompt_ms": re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens"),
    "eval_ms": re.compile(r"(?<!prompt )\beval time =\s*([0-9.]+) ms /\s*(\d+) (?:runs|tokens)"),
    "load_ms": re.compile(r"\bload time =\s*([0-9.]+) ms"),
    "encoded": re.compile(r"\bencoded\s+(\d+) tokens in\s+([0-9.]+) seconds"),
    "decoded": re.compile(r"\bdecoded\s+(\d+) tokens in\s+([0-9.]+) seconds"),
    "counts": re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$"),
    "accept": re.compile(r"\baccept\s*=\s*([0-9.]+)%"),
}


def parse_llama(log: str) -> dict[str, Any]:
    """What llama.cpp's log (stderr) says about a run: the perf lines (``load time``, ``prompt eval time = X ms /
    N tokens``, ``eval time = X ms / N runs``; from llama_perf_context_print or common_perf_print, whatever the line
    prefix) and the speculative example's ``encoded/decoded N tokens in X seconds`` and acceptance counts. Perf lines
    under the speculative example's ``draft:`` heading are the draft's and are skipped. Missing lines are absent."""
    out: dict[str, Any] = {}
    section = None
    for line in log.splitlines():
        head = line.rstrip()
        if head.endswith("draft:") or head.endswith("target:"):
            section = "draft" if head.endswith("draft:") else "target"
            continue
        if m := _PERF["decoded"].search(line):
            out["decoded_tokens"], out["decoded_s"] = int(m[1]), float(m[2])
        elif m := _PERF["encoded"].search(line):
            out["encoded_tokens"], out["encoded_s"] = int(m[1]), float(m[2])
        elif m := _PERF["counts"].search(line):
            out[m[1]] = int(m[2])
        elif m := _PERF["accept"].search(line):
            out["accept_pct"] = float(m[1])
        elif section == "draft":
            continue
        elif m := _PERF["prompt_ms"].search(line):
            out["prompt_ms"], out["prompt_tokens"] = float(m[1]), int(m[2])
        elif m := _PERF["eval_ms"].search(line):
            out["eval_ms"], out["eval_runs"] = float(m[1]), int(m[2])
        elif m := _PERF["load_ms"].search(line):
            out["load_ms"] = float(m[1])
    return out


def llama_record(name: str, stdout: str, stderr: str, prompt: str, seconds: float) -> dict[str, Any]:
    """A run record (the fields ours have, where llama.cpp says them) from a llama.cpp run's output; ValueError when
    its timing line is missing. Decode-only: AR, ``eval time`` (N runs: the tokens after the first, which the
    prompt pass gives), its tokens N + 1; spec, ``decoded N tokens in X seconds``, its tokens N (it may pass -n)."""
    perf = parse_llama(stderr)
    rec: dict[str, Any] = {}
    if name == LLAMA_AR:
        if "eval_ms" not in perf:
            raise ValueError(f"{LLAMA_BINS[name]}: no 'eval time = ... ms / N runs' line in its output")
        tokens = perf["eval_runs"] + 1
        rec.update(decode_tokens=perf["eval_runs"], decode_s=perf["eval_ms"] / 1000, steps=tokens)
        rec["prefill_s"] = perf["prompt_ms"] / 1000 if "prompt_ms" in perf else None
        rec["llama_prompt_tokens"] = perf.get("prompt_tokens")
        text = stdout
    else:
        if "decoded_tokens" not in perf:
            raise ValueError(f"{LLAMA_BINS[name]}: no 'decoded N tokens in X seconds' line in its output")
        tokens = perf["decoded_tokens"]
        rec.update(decode_tokens=tokens, decode_s=perf["decoded_s"], steps=None)
        rec["prefill_s"] = perf.get("encoded_s")
        rec["llama_prompt_tokens"] = perf.get("encoded_tokens")
        for k in ("n_draft", "n_drafted", "n_accept", "accept_pct"):
            if k in perf:
                rec[k] = perf[k]
        at = stdout.find(prompt) if prompt else -1  # the example echoes the prompt before the new text
        text = stdout[at + len(prompt) :] if at >= 0 else stdout
    ds = rec["decode_s"]
    rec.update(
        tokens=tokens,
        seconds=seconds,
        tok_s=tokens / seconds if seconds > 0 else 0.0,
        tokens_per_step=1.0 if rec["steps"] else None,
        decode_tok_s=rec["decode_tokens"] / ds if ds > 0 else None,
        load_s=perf["load_ms"] / 1000 if "load_ms" in perf else None,
        text80=text[:80],
        ids=[],
    )
    return rec


def llama_version(bin_dir: Path) -> str:
    """``llama-completion --version``'s first line (build number and commit), or ? when it says nothing."""
    try:
        r = subprocess.run(
            [str(bin_dir / LLAMA_BINS[LLAMA_AR]), "--version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    lines = [ln.strip() for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "?"


# ---------------------------------------------------------------------------------------------- running


class Runner:
    """Holds the loaded models and runs one (config, prompt ids) generation, returning a result record."""

    def __init__(self, args: argparse.Namespace, configs: list[Config]) -> None:
        import torch

        from offload.plan import OffloadConfig
        from specexec import api
        from specexec.config import SamplingConfig
        from specexec.loading import hub
        from specexec.loading.checkpoint import model_dir

        self.args, self.configs = args, configs
        fixed = [int(c.param) for c in configs if c.method == "specexec" and c.param and c.param.isdigit()]
        self.tree_default = default_tree()
        # load with room for the largest tree any configuration grows, so no run reallocates (and recalibrates)
        load_tree = default_tree(max([2048] + fixed))
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
        self.samp = SamplingConfig(temperature=args.temperature, seed=args.seed)
        self.hf: dict[str, Any] = {}
        hf_names = [c.name for c in configs if c.side == "hf"]
        if hf_names:
            from transformers import AutoModelForCausalLM, GenerationConfig

            t_path = model_dir(hub.resolve(args.target, progress=False))
            d_path = model_dir(hub.resolve(args.draft, progress=False))
            clean = GenerationConfig(eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None)

            def load(path: Path, dtype: Any) -> Any:
                m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
                m.generation_config = clean  # not the checkpoint's sampling defaults (repetition penalty, top-k)
                return m

            self.hf["target"] = load(t_path, self.engine.target.dtype)
            if "hf-assisted-fp32" in hf_names:
                self.hf["draft-fp32"] = load(d_path, torch.float32)
            if "hf-assisted-bf16" in hf_names:
                self.hf["draft-bf16"] = load(d_path, torch.bfloat16)

    def encode(self, p: Prompt) -> list[int]:
        from specexec.decoding.text import encode_text, render_chat

        if p.chat and getattr(self.tok, "chat_template", None):
            return render_chat(self.tok, [{"role": "user", "content": p.text}])
        return encode_text(self.tok, p.text)

    def prompt_text(self, p: Prompt) -> str:
        """The text :meth:`encode` tokenizes: a chat prompt's rendered template (special tokens as text), else the
        prompt as is (what llama.cpp is given)."""
        if p.chat and getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(
                [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=False
            )
        return p.text

    def tie_check(self, ids: list[int], ref: list[int], i: int, seed: int | None) -> dict[str, Any]:
        """At the first token ``i`` where a run left our AR's ``ref``: the gap between the target's two best scores
        there (computed by one pass over the common prefix; sampling: the walk's Gumbel-max scores for ``seed``).
        Information only: with invariant passes any difference is a bug, whatever the gap."""
        import torch

        from specexec.decoding import sampling

        m = self.engine.target
        prefix = ids + ref[:i]
        pos = torch.arange(len(prefix))
        cache = m.new_cache(len(prefix) + 1)
        with torch.no_grad():
            logits = m.forward(
                torch.tensor(prefix), pos, pos, pos[None, :] <= pos[:, None], cache, logits_rows=slice(-1, None)
            )[0].float()
        t = self.args.temperature
        scores = logits.double()
        if t > 0 and seed is not None:
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
        bos = getattr(self.tok, "bos_token_id", None)
        bos_text = getattr(self.tok, "bos_token", None)
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
        from dataclasses import replace

        from specexec.config import ChainConfig

        tree, chain = self.tree_default, ChainConfig()
        if c.method == "specexec" and c.param:
            tree = (
                self.tree_default if c.param == "auto" else replace(self.tree_default, budget=int(c.param), auto=False)
            )
        elif c.method == "chain" and c.param:
            chain = ChainConfig(gamma=int(c.param))
        self.engine.reset()  # cold cache: every configuration prefills the prompt
        with _kernels(self.engine, c.invariant):
            t = time.perf_counter()
            r = self.engine.generate(
                ids, max_new, method=c.method, sampling_cfg=replace(self.samp, seed=seed), tree=tree, chain=chain
            )
            dt = time.perf_counter() - t
        s = r.stats
        rec = {
            "tokens": len(r.tokens),
            "seconds": dt,
            "tok_s": len(r.tokens) / dt if dt > 0 else 0.0,
            "steps": s.steps,
            "tokens_per_step": s.tokens_per_step,
            "decode_tok_s": s.tokens_per_s,
            "prefill_s": s.prefill_s,
            "ids": list(r.tokens),
        }
        rec["draft_passes"] = s.draft_passes
        rec["mean_tree_size"] = round(s.mean_tree_size, 2)
        rec["trimmed"] = s.trimmed
        if s.budgets:
            rec["budgets"] = s.to_json()["budgets"]  # arms by name: -3, 0, 8, heads:4
        if s.costs_s:
            rec["costs_s"] = s.costs_s
        return rec

    def _hf(self, c: Config, ids: list[int], max_new: int, seed: int | None) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class Steps(BaseStreamer):
            """Counts put() calls: the first carries the prompt, each later one a target pass's new tokens."""

            def __init__(self) -> None:
                self.puts = 0
                self.first: float | None = None

            def put(self, value: Any) -> None:
                self.puts += 1
                if self.puts == 2:
                    self.first = time.perf_counter()

            def end(self) -> None:
                pass

        greedy = self.args.temperature == 0
        gen = dict(
            max_new_tokens=max_new,
            do_sample=not greedy,
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=self.eos,
            pad_token_id=self.eos[0] if self.eos else None,
        )
        if not greedy:
            gen.update(temperature=self.args.temperature, top_k=0, top_p=1.0)
        kw: dict[str, Any] = {}
        if c.name == "hf-assisted-fp32":
            kw["assistant_model"] = self.hf["draft-fp32"]
        elif c.name == "hf-assisted-bf16":
            kw["assistant_model"] = self.hf["draft-bf16"]
        elif c.name == "hf-lookup":
            gen["prompt_lookup_num_tokens"] = self.args.lookup_tokens
        model = self.hf["target"]
        x = torch.tensor([ids])
        steps = Steps()
        if seed is not None:
            torch.manual_seed(seed)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(**gen), streamer=steps, **kw
            )
        dt = time.perf_counter() - t
        new = out[0, len(ids) :].tolist()
        n_steps = max(steps.puts - 1, 1)
        return {
            "tokens": len(new),
            "seconds": dt,
            "tok_s": len(new) / dt if dt > 0 else 0.0,
            "steps": n_steps,
            "tokens_per_step": len(new) / n_steps,
            "ttft_s": (steps.first - t) if steps.first is not None else None,
            "ids": new,
        }


@contextmanager
def _kernels(engine: Any, invariant: bool) -> Iterator[None]:
    """Run the block with the target's fastest per-shape kernels when ``invariant`` is False, then put the engine
    back as it was (it keeps each mode's measured costs and learnt rates, and the process keeps the model's
    tiling, so the other configurations run as they would without this one)."""
    was = engine.target.tiling is not None
    if invariant or not was:
        yield
        return
    engine.set_invariant(False)
    try:
        yield
    finally:
        engine.set_invariant(True)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _walk_verified(c: Config) -> bool:
    """Our configurations whose every step is verified by the tree walk, so a seed gives our AR's text also when
    sampling (the default's chain arms propose coupled draws; ``chain:G`` samples under the chain rule)."""
    return c.side == "ours" and c.method in (None, "specexec", "ngram", "heads")


def _compared(c: Config, greedy: bool) -> bool:
    """Whether a run of ``c`` is compared token for token to our AR's: greedy, every configuration; sampling, the
    ones that draw as our AR does with the same seed (the tree-walk methods, and our AR on fast kernels). llama.cpp's
    runs are never compared (other weights)."""
    if c.side == "llama":
        return False
    return greedy or _walk_verified(c) or (c.side == "ours" and c.method == "ar")


def _must_match(c: Config) -> bool:
    """Whether a compared run of ``c`` that differs from our AR's tokens is a bug (our methods on invariant passes)
    rather than information (our fast-kernel AR, transformers)."""
    return c.side == "ours" and c.invariant


def run_all(
    runner: Runner,
    prompts: dict[str, list[Prompt]],
    configs: list[Config],
    max_new: int,
    log: Callable[[str], None],
    done: Callable[[list[dict[str, Any]]], None] | None = None,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Every configuration on each prompt, back to back; the order rotates by one per prompt (and per repeat:
    ``repeats`` rounds of our configurations, the others in the first round only). ``done`` gets the records so far
    after each prompt (the partial report a long run leaves behind if it is stopped)."""
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
                    rec = runner.run(c, ids, max_new, seed, *([text] if c.side == "llama" else []))
                    got[c.name] = rec
                    log(
                        f"{set_name} {pi + 1}/{len(plist)} {p.name[:40]:40s} {c.name:18s} {rec['tokens']:4d} tok "
                        f"{rec['tok_s']:7.2f} tok/s {_f(rec['tokens_per_step'], '5.2f')} tok/step"
                        + (f"  decode {_f(rec.get('decode_tok_s'))} tok/s" if c.side == "llama" else "")
                        + (f"  budgets {rec['budgets']} trimmed {rec['trimmed']}" if rec.get("budgets") else "")
                    )
                records += _compare(runner, got, order, set_name, p.name, ids, seed, greedy, rep, log)
            if done is not None:
                done(records)
    return records


def _compare(
    runner: Runner,
    got: dict[str, dict[str, Any]],
    order: list[Config],
    set_name: str,
    prompt: str,
    ids: list[int],
    seed: int | None,
    greedy: bool,
    rep: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One round's records of a prompt, each run that must (or may) equal our AR's tokens compared with them."""
    records = []
    ref = got.get("ours-ar", {}).get("ids")
    for c in order:
        rec = got[c.name]
        row = {
            "set": set_name,
            "prompt": prompt,
            "prompt_tokens": len(ids),
            "config": c.name,
            "order": order.index(c),
            "repeat": rep,
            **{k2: v for k2, v in rec.items() if k2 != "ids"},
        }
        if ref is not None and c.name != "ours-ar" and _compared(c, greedy):
            d = _first_diff(ref, rec["ids"])
            row["match_ar"] = d is None
            row["must_match_ar"] = _must_match(c)
            row["first_diff"] = d
            if d is not None and d < len(ref):
                row.update(runner.tie_check(ids, ref, d, seed))
            if d is not None:
                log(
                    f"{'MISMATCH (a bug)' if row['must_match_ar'] else 'differs (reported)'}: {c.name} "
                    f"left our AR's tokens at {d}"
                    + (f", top-2 gap {row['first_diff_gap']:.4g}" if "first_diff_gap" in row else "")
                )
        records.append(row)
    return records


# ---------------------------------------------------------------------------------------------- summary


def summarize(records: list[dict[str, Any]], configs: list[Config], greedy: bool) -> dict[str, Any]:
    """Per set and config: tokens, seconds, tok/s (total tokens / total seconds over all runs), ratios, per-prompt
    minima (a prompt's tok/s: the median of its runs)."""
    sets: dict[str, Any] = {}
    for set_name in dict.fromkeys(r["set"] for r in records):
        rows = [r for r in records if r["set"] == set_name]
        by = {c.name: [r for r in rows if r["config"] == c.name] for c in configs}
        summ: dict[str, Any] = {}
        for c in configs:
            rs = by[c.name]
            tokens, secs = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
            known_steps = all(r.get("steps") is not None for r in rs)  # llama.cpp spec: not in its output
            steps = sum(r["steps"] for r in rs) if known_steps else 0
            s = {
                "side": c.side,
                "prompts": len({r["prompt"] for r in rs}),
                "runs": len(rs),
                "tokens": tokens,
                "seconds": secs,
                "tok_s": tokens / secs if secs > 0 else 0.0,
                "tokens_per_step": tokens / max(steps, 1) if known_steps else None,
            }
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
                s["mismatches"] = sum(not r.get("match_ar", True) for r in rs)
                s["must_match_ar"] = _must_match(c)
            summ[c.name] = s
        ar = summ.get("ours-ar", {}).get("tok_s")
        fast_ar = summ.get(FAST_AR, {}).get("tok_s")
        hf_best = max((summ[n]["tok_s"] for n in HF_SPECULATIVE if n in summ), default=None)
        ar_by_prompt = _median_by_prompt(by.get("ours-ar", []))
        for c in configs:
            s = summ[c.name]
            if c.side == "llama":  # its whole-call tok/s includes loading the models: compared decode-only below
                s["vs_our_ar"] = s["vs_our_fast_ar"] = s["vs_best_hf_speculative"] = s["min_prompt_vs_our_ar"] = None
                continue
            s["vs_our_ar"] = s["tok_s"] / ar if ar else None
            s["vs_our_fast_ar"] = s["tok_s"] / fast_ar if fast_ar else None
            s["vs_best_hf_speculative"] = s["tok_s"] / hf_best if hf_best else None
            ratios = [
                tok_s / ar_by_prompt[prompt]
                for prompt, tok_s in _median_by_prompt(by[c.name]).items()
                if ar_by_prompt.get(prompt, 0) > 0
            ]
            s["min_prompt_vs_our_ar"] = min(ratios) if ratios else None
        # our AR's runs of each prompt, in order: its second run against its first is noise alone
        runs: dict[str, list[float]] = {}
        for r in by.get("ours-ar", []):
            runs.setdefault(r["prompt"], []).append(r["tok_s"])
        noise = [t[1] / t[0] for t in runs.values() if len(t) >= 2 and t[0] > 0]
        if "ours-ar" in summ:
            summ["ours-ar"]["min_prompt_rerun_vs_first"] = min(noise) if noise else None
        best_hf_name = max((n for n in HF_SPECULATIVE if n in summ), key=lambda n: summ[n]["tok_s"], default=None)
        sets[set_name] = {"configs": summ, "best_hf_speculative": best_hf_name, "decode": _decode_row(summ)}
    return sets


def _median_by_prompt(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each prompt's tok/s: the median of its runs' (one run: that run's)."""
    runs: dict[str, list[float]] = {}
    for r in rows:
        runs.setdefault(r["prompt"], []).append(r["tok_s"])
    return {p: statistics.median(t) for p, t in runs.items()}


def _decode_row(summ: dict[str, Any]) -> dict[str, Any]:
    """A set's decode-only comparison (prefill excluded, and llama.cpp's model loading): our AR, our default, the
    default's ratio to our AR, llama.cpp's AR and spec, our default's ratio to llama.cpp's AR."""

    def dec(name: str) -> float | None:
        return summ.get(name, {}).get("decode_tok_s")

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


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        f"### CPU benchmark: {m['target']} + {m['draft']}, {m['date']}",
        "",
        f"{m['machine']}; torch {m['torch']} ({m['threads']} threads), transformers {m['transformers']}; "
        f"our target {m.get('target_weights', 'dense')} weights computing in {m['dtype']}"
        + (f" (--target-dtype {m['target_dtype']})" if m.get("target_dtype") else "")
        + (
            f"; llama.cpp {m['llama_cpp']['version']}, {m['llama_cpp']['gguf_target']} + {m['llama_cpp']['gguf_draft']}"
            if m.get("llama_cpp")
            else ""
        )
        + f"; {m['max_new_tokens']} new tokens, temperature {m['temperature']}; "
        f"{m['prompts_per_set']} prompts per set"
        + (f", ours run {m['repeats']} times each (a prompt's figure: its median)" if m.get("repeats", 1) > 1 else "")
        + f"; commit {m['commit']}."
        + (" **SMOKE RUN (tiny models): the numbers mean nothing.**" if m.get("smoke") else "")
        + (
            " **No shape-invariant tiling passed the check on this machine: the target ran its fastest kernels.**"
            if "invariant_tiling" in m and m["invariant_tiling"] is None
            else ""
        )
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
            lines.append(
                f"| {name} | {s['tok_s']:.2f} | {_f(s['vs_our_ar'], suffix='×')} | "
                f"{_f(s.get('vs_our_fast_ar'), suffix='×')} | {_f(s['vs_best_hf_speculative'], suffix='×')} | "
                f"{_f(s['min_prompt_vs_our_ar'], suffix='×')} | "
                f"{_f(s.get('decode_tok_s'))} | {_f(s['tokens_per_step'])} |"
                + (f" {_mismatches(s)} |" if greedy else "")
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def _mismatches(s: dict[str, Any]) -> str:
    """A summary's "mismatches vs our AR" cell."""
    mm = s.get("mismatches")
    if mm is None:
        return "-"
    if s["side"] == "hf":
        note = " (HF: reported, not asserted)"
    elif not s.get("must_match_ar", True):
        note = " (fast kernels: reported, not asserted)"
    else:
        note = " **(a bug)**" if mm else ""
    return f"{mm}/{s.get('runs', s['prompts'])}{note}"


def _meta(args: argparse.Namespace, runner: Runner, configs: list[Config], prompts: dict[str, list[Prompt]]):
    import torch
    import transformers

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[1],
                timeout=10,
            ).stdout.strip()
            or "?"
        )
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return {
        "target": args.target,
        "draft": args.draft,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()} {platform.system()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(runner.engine.target.dtype).replace("torch.", ""),  # the target's compute dtype
        "target_dtype": args.target_dtype,  # what was asked (--target-dtype)
        "target_weights": getattr(runner.engine, "target_weights", None) or "dense",  # int8 or dense
        "draft_weights": getattr(runner.engine, "draft_weights", None),
        # the target's shape-invariant tiling on this machine (None: none found, see specexec.loading.invariance)
        "invariant_tiling": getattr(getattr(runner.engine, "invariance", None), "tiling", None),
        "draft_dtype": str(runner.engine.draft.dtype).replace("torch.", "") if runner.engine.draft else None,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "prompts_per_set": args.prompts_per_set,
        "repeats": args.repeats,
        "lookup_tokens": args.lookup_tokens,
        "commit": commit,
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
    lc = [c for c in args.configs if c.side == "llama"]
    return {
        "dir": str(args.llama_cpp),
        "version": llama_version(args.llama_cpp),
        "gguf_target": str(args.gguf_target),
        "gguf_draft": str(args.gguf_draft),
        "threads": runner.threads,
        "commands": {
            c.name: llama_command(c.name, args, "PROMPT.txt", args.max_new_tokens, runner.threads, False, None)
            for c in lc
        },
    }


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--prompts-per-set", type=int, default=None, help="default 20 (1 with --smoke)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (8 with --smoke)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy, exactness checked) or e.g. 0.7")
    p.add_argument("--seed", type=int, default=0, help="sampling: prompt k uses seed + k (ours and transformers)")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {', '.join(SETS)}")
    p.add_argument(
        "--methods",
        default="",
        help="our extra configurations, comma-separated: specexec:N, specexec:auto, chain:G, a method name (ngram)",
    )
    p.add_argument(
        "--no-fast-ar",
        dest="fast_ar",
        action="store_false",
        help=f"leave out {FAST_AR} (our AR on the target's fastest per-shape kernels)",
    )
    p.add_argument(
        "--no-invariant",
        dest="invariant",
        action="store_false",
        help="run all of ours on the target's fastest per-shape kernels (what the engine did before shape-invariant "
        "passes; exactness is then not required of the default; implies --no-fast-ar)",
    )
    p.add_argument(
        "--hf",
        default=",".join(HF_CONFIGS),
        help=f"transformers configurations, from {', '.join(HF_CONFIGS)} ('' for none)",
    )
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-lookup")
    p.add_argument("--dtype", default="auto", help="our engine's dtype (auto: what generate uses)")
    p.add_argument(
        "--target-dtype",
        default="auto",
        choices=TARGET_DTYPES,
        help="our target's weights: auto (q4 or int8 where this CPU's probe measures it faster), int8 (computing in "
        "bf16), q4 (4-bit, computing in fp32), or dense bf16/fp16/fp32 (sets the compute dtype when --dtype is auto)",
    )
    home = Path(os.environ.get("SPECEXEC_HOME") or Path.home() / ".cache" / "specexec").expanduser()
    p.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        metavar="DIR",
        help="a llama.cpp build's bin directory (llama-completion, llama-speculative-simple): adds llama.cpp AR "
        "and llama.cpp spec to the rotation",
    )
    p.add_argument("--gguf-target", type=Path, default=home / "gguf" / GGUF_TARGET, help="llama.cpp's target")
    p.add_argument("--gguf-draft", type=Path, default=home / "gguf" / GGUF_DRAFT, help="llama.cpp's draft")
    p.add_argument(
        "--llama-draft-max",
        type=int,
        default=None,
        help="llama.cpp spec's --spec-draft-n-max (default: llama.cpp's own)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run our configurations N times on each prompt (interleaved; transformers and llama.cpp once) and "
        "compare each prompt at its median: a single run's host noise of a few percent otherwise sets the lowest "
        "prompt's ratio; with N >= 2 the tables also give the lowest ratio of our AR's second run to its first",
    )
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--md", type=Path, default=None, help="append the markdown tables to this file")
    p.add_argument("--smoke", action="store_true", help="logic check on tiny models (give --target/--draft)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    args = p.parse_args(argv)
    if args.prompts_per_set is None:
        args.prompts_per_set = 1 if args.smoke else 20
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.smoke else 128
    if args.prompts_per_set < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        p.error("--prompts-per-set, --max-new-tokens and --repeats must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.target_dtype == "int8" and args.dtype not in ("auto", "bf16"):
        p.error("--target-dtype int8 computes in bf16: give --dtype auto or bf16")
    if args.target_dtype == "q4" and args.dtype not in ("auto", "fp32"):
        p.error("--target-dtype q4 computes in fp32: give --dtype auto or fp32")
    if args.target_dtype not in ("auto", "int8", "q4") and args.dtype not in ("auto", args.target_dtype):
        p.error(f"--target-dtype {args.target_dtype} with --dtype {args.dtype}: give one dense dtype")
    if args.llama_draft_max is not None and args.llama_draft_max < 1:
        p.error("--llama-draft-max must be >= 1")
    sets = tuple(s.strip() for s in args.sets.split(",") if s.strip())
    bad = [s for s in sets if s not in SETS]
    if bad or not sets:
        p.error(f"--sets: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(SETS)}")
    args.sets = sets
    hf = tuple(h.strip() for h in args.hf.split(",") if h.strip())
    bad = [h for h in hf if h not in HF_CONFIGS]
    if bad:
        p.error(f"--hf: unknown {', '.join(bad)}; choose from {', '.join(HF_CONFIGS)}")
    args.hf = hf
    if not args.invariant:
        args.fast_ar = False
    try:
        args.configs = our_configs(args.methods, args.fast_ar) + [Config(h, "hf") for h in hf]
        if args.llama_cpp is not None:
            args.configs += [Config(LLAMA_AR, "llama"), Config(LLAMA_SPEC, "llama")]
    except ValueError as e:
        p.error(str(e))
    if not args.invariant:  # fast kernels throughout: differences from our AR are reported, not errors
        args.configs = [replace(c, invariant=False) if c.side == "ours" else c for c in args.configs]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = args.configs
    missing = llama_missing(args)
    if missing:  # before loading anything
        print(missing, file=sys.stderr)
        return 2
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    prompts = build_prompts(args.sets, args.prompts_per_set)
    log(
        f"loading {args.target} + {args.draft} (ours{', transformers' if args.hf else ''}"
        f"{'; llama.cpp runs its own' if args.llama_cpp else ''})"
    )
    runner = Runner(args, configs)
    # warm-up: every configuration once on a short prompt (allocations, lazy imports, the auto budget's costs)
    warm = next(p for ps in prompts.values() for p in ps)
    ids = runner.encode(warm)
    text = runner.prompt_text(warm)
    for c in configs:  # (llama.cpp's too: the GGUF files in the page cache before the timed runs)
        runner.run(c, ids, 2 if args.smoke else 4, args.seed, *([text] if c.side == "llama" else []))
    log("warm-up done")
    meta = _meta(args, runner, configs, prompts)  # the commit and date the run starts from
    total = sum(len(ps) for ps in prompts.values())

    def checkpoint(records: list[dict[str, Any]]) -> None:  # a stopped run still leaves its finished prompts
        if args.out:
            n = len({(r["set"], r["prompt"]) for r in records})
            _write_report(args.out, {"meta": {**meta, "partial": f"{n} of {total} prompts"}, "runs": records})

    records = run_all(runner, prompts, configs, args.max_new_tokens, log, checkpoint, args.repeats)
    greedy = args.temperature == 0
    sets = summarize(records, configs, greedy)
    report = {"meta": meta, "sets": sets, "runs": records}
    md = markdown(report)
    print(md)
    if args.out:
        _write_report(args.out, report)
        log(f"wrote {args.out}")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        sep = "\n" if args.md.exists() and args.md.stat().st_size else ""
        with args.md.open("a", encoding="utf-8") as f:
            f.write(sep + md)
        log(f"appended the tables to {args.md}")
    return _verdict(records)


def _write_report(path: Path, report: dict[str, Any]) -> None:
    """Write the JSON report whole (a temporary file renamed over it: a reader never sees half a report)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def _verdict(records: list[dict[str, Any]]) -> int:
    """1 when a run that must reproduce our AR's tokens (our methods on invariant passes) left them anywhere (a bug):
    each such run is named with its first differing token and the target's top-2 gap there."""
    bad = [r for r in records if r.get("must_match_ar") and not r["match_ar"]]
    for r in bad:
        gap = f", top-2 gap {r['first_diff_gap']:.4g}" if r.get("first_diff_gap") is not None else ""
        print(
            f"error: {r['set']} {r['prompt']} {r['config']}: differs from our AR at token {r['first_diff']}{gap}",
            file=sys.stderr,
        )
    if bad:
        print(f"error: {len(bad)} runs of our methods differ from our AR (a bug)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
