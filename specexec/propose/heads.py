"""Heads: proposals from the target's own last hidden state and the tokens of the path, no draft model.

Head k (k = 1..K) is a small residual stage that carries a state one token ahead: from the state before it and
the embedding of the token it reads (the target's own input embedding), ``s_k = s_{k-1} + silu(n(s_{k-1}) A_k +
n(e) G_k + c_k) B_k`` (low rank, ``n`` an RMS normalisation), and guesses the next token from ``s_k`` through the
target's own output layer restricted to a frequency-ranked token subset (``ids``; its rows are the target's,
shared, never trained). ``s_0`` is the target's final (normed) hidden state at the last accepted node, whose own
logits chose the pending token, so head 1 reads the pending token and guesses the one after it; head 2 reads one
of head 1's guesses, and so on. This is Medusa's idea (Cai et al. 2024) with each head conditioned on the tokens
before it, as the MLP speculator of Wertheimer et al. 2024 and Hydra (Ankner et al. 2024) do: a Medusa head
guessing two tokens ahead does not know the token between, and that costs most of its acceptance.

A proposal is the tree of the ``budget`` most probable head paths (top tokens per node, a path's score the sum of
its heads' log-probs), grown level by level from the pending token: a level's heads run only on the nodes that
are among the ``budget`` best so far (one batched product a level). The exact tree walk verifies it, never
Medusa's lossy "typical acceptance": greedy output is the target's greedy decoding, sampling its distribution. A
proposal costs K small products and K output-layer slices, far below a draft model's pass.

Heads are trained by self-distillation (:func:`train`): over local text the frozen target computes h and its own
greedy prediction at every position; head k, reading the text's next k tokens, learns the target's prediction
after them. Trained heads are kept under ``<cache home>/heads/`` keyed by the target's weights
(:func:`target_key`); the demo target's heads ship in the package (``specexec/configs/heads``).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specexec.errors import SpecexecError
from specexec.formats.dense import linear
from specexec.propose.ngram import NGramDraft
from specexec.steps.proposal import Proposal, StepContext
from specexec.steps.record import Arm
from specexec.steps.tree import Tree

log = logging.getLogger(__name__)

HEADS = 3  # heads: guesses 2, 3 and 4 tokens ahead (the target's own logits give the next one)
RANK = 256  # a stage's rank
VOCAB = 16384  # the frequency-ranked token ids the heads score
TOP = 8  # candidates per node a proposal draws from
STEPS_PER_PASS = 2  # optimizer steps after each target pass over a chunk
FEATURE_BYTES = 512 << 20  # the most hidden states (bf16) a training run keeps to draw its batches from
FORM = "chained"  # the heads' form in saved files (files of another form are trained again)
SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "heads"


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass
class Heads:
    """K heads' weights: ``a`` and ``g`` (K, D, r), ``b`` (K, r, D), ``c`` (K, r) and the token ids they score
    (V',)."""

    a: Tensor
    g: Tensor
    b: Tensor
    c: Tensor
    ids: Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(cls, hidden: int, ids: Tensor, heads: int = HEADS, rank: int = RANK, seed: int = 0) -> Heads:
        """Untrained heads: every stage starts as the identity (``b`` zero), i.e. every head guesses what the
        target's own output layer says at the last position (Medusa's initialisation)."""
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(heads, hidden, rank, generator=gen) / math.sqrt(hidden)
        g = torch.randn(heads, hidden, rank, generator=gen) / math.sqrt(hidden)
        return cls(a, g, torch.zeros(heads, rank, hidden), torch.zeros(heads, rank), ids.long())

    @property
    def k(self) -> int:
        return self.a.shape[0]

    def stage(self, k: int, s: Tensor, e: Tensor) -> Tensor:
        """Head ``k`` (0-based): states (n, D) and the embeddings of the tokens they read (n, D) -> the states
        one token further (n, D), in fp32."""
        s = s.float()
        z = _rms(s) @ self.a[k].float() + _rms(e.float()) @ self.g[k].float() + self.c[k].float()
        return s + F.silu(z) @ self.b[k].float()

    def states(self, h: Tensor, e: Tensor) -> Tensor:
        """Teacher-forced: hidden states (n, D) and the embeddings of the K tokens after each (n, K, D) -> every
        head's state (n, K, D)."""
        s, out = h, []
        for k in range(self.k):
            s = self.stage(k, s, e[:, k])
            out.append(s)
        return torch.stack(out, 1)

    def parameters(self) -> list[Tensor]:
        return [self.a, self.g, self.b, self.c]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tensors = {
            "a": self.a.detach().to(torch.bfloat16).contiguous(),
            "g": self.g.detach().to(torch.bfloat16).contiguous(),
            "b": self.b.detach().to(torch.bfloat16).contiguous(),
            "c": self.c.detach().float().contiguous(),
            "ids": self.ids.to(torch.int32).contiguous(),
        }
        save_file(tensors, str(tmp), metadata={"specexec_heads": json.dumps({**self.meta, "form": FORM})})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Heads:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("specexec_heads", "{}"))
                if meta.get("form") != FORM:
                    raise SpecexecError(f"the heads in {path} are of an older form: train them again")
                t = {k: f.get_tensor(k) for k in ("a", "g", "b", "c", "ids")}
        except SpecexecError:
            raise
        except Exception as e:  # noqa: BLE001  (safetensors raises several types for a damaged file)
            raise SpecexecError(f"cannot read heads from {path}: {e}") from None
        return cls(t["a"].float(), t["g"].float(), t["b"].float(), t["c"].float(), t["ids"].long(), meta)


# ---------------------------------------------------------------------------------------------- where heads live


def target_key(model_dir: Path) -> str:
    """A key for a target's weights: its config's shapes and a hash of its first embedding rows (as stored), so
    heads trained on one checkpoint are never used on another."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    h = hashlib.sha256()
    for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        h.update(f"{k}={cfg.get(k)};".encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                rows = st.get_slice("model.embed_tokens.weight")[:16]
                h.update(rows.float().numpy().tobytes())
                break
    return h.hexdigest()[:16]


def heads_path(model_dir: Path, home: Path | None = None) -> Path:
    """Where trained heads for this target are kept in the cache."""
    from specexec.home import cache_home

    return cache_home(home) / "heads" / f"{target_key(model_dir)}.safetensors"


def find_heads(model_dir: Path, home: Path | None = None) -> Path | None:
    """Trained heads for this target: the cache's, else the package's (the demo target's); None: none."""
    key = target_key(model_dir)
    for p in (heads_path(model_dir, home), *sorted(SHIPPED.glob(f"*{key}.safetensors"))):
        if p.is_file():
            return p
    return None


# ---------------------------------------------------------------------------------------------- the proposer


class HeadsDraft:
    """Proposals from :class:`Heads` on the last accepted node's hidden state (``ctx.arm.size`` nodes).

    With an :class:`~specexec.propose.ngram.NGramDraft` attached, a step of no heads (a plain arm) verifies prompt
    lookup's trie alone (the root alone where nothing matches: a plain step), and the lookup's continuations are
    merged into every head tree as extra branches, as a draft model's trees get them."""

    name = "heads"
    wants_hidden = True  # the decode loop hands :meth:`commit` the accepted node's final hidden state

    def __init__(
        self, heads: Heads, lm_head: Any, embed: Any, device: torch.device, ngram: NGramDraft | None = None
    ) -> None:
        self.ngram = ngram
        a, g, b, c, ids = (t.to(device) for t in (heads.a, heads.g, heads.b, heads.c, heads.ids))
        self.heads = Heads(a, g, b, c, ids, heads.meta)
        self.device = device
        self._ids = ids
        self._embed = embed
        if isinstance(lm_head, Tensor):
            self._rows: Any = lm_head[ids]
        elif hasattr(lm_head, "subset"):  # int8 and 4-bit targets: the same rows, the same kernel
            self._rows = lm_head.subset(ids)
        else:  # NF4: its rows dequantized once (V' x D)
            self._rows = lm_head.dequantize()[ids]
        self._hidden: Tensor | None = None

    def begin(self, seq: list[int]) -> None:
        self._hidden = None  # the first step verifies the root alone; its pass gives the hidden state
        if self.ngram is not None:
            self.ngram.begin(seq)

    def embed(self, tokens: Tensor) -> Tensor:
        """The target's input embeddings of ``tokens`` (n, D)."""
        e = self._embed
        return e[tokens] if isinstance(e, Tensor) else e.rows(tokens)

    def guess(self, k: int, states: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
        """Head ``k`` (0-based) on n nodes: the states their tokens were guessed from (n, D) and those tokens
        (n,) -> the nodes' own states (n, D), each node's ``top`` most probable next tokens (n, top) and their
        log-probs (n, top)."""
        s = self.heads.stage(k, states, self.embed(tokens))
        rows = self._rows
        x = s
        if isinstance(rows, Tensor):
            x = s.to(rows.dtype)
        elif getattr(rows, "kernel", "") == "int8pack":  # a CPU target's int8 weights: bf16 activations
            x = s.to(torch.bfloat16)
        logp = torch.log_softmax(linear(x, rows).float(), dim=-1)
        lp, idx = logp.topk(min(top, logp.shape[-1]), dim=-1)
        return s, self._ids[idx], lp

    def grow(self, seq: list[int], budget: int, room: int = 0) -> Tree:
        """The tree of the ``budget`` most probable head paths below the pending token ``seq[-1]`` (the root alone
        before the first verify pass has given a hidden state), with ``room`` for nodes merged into it after."""
        tree = Tree(seq[-1], budget + 1 + room, self.device)
        if budget > 0 and self._hidden is not None:
            parents, toks, depths, scores = self.paths(self._hidden, seq[-1], budget)
            if parents:
                tree.append(parents, toks, depths, scores)
        return tree

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        b = ctx.arm.size  # a head tree of b nodes (a policy's heads arm, or a fixed size)
        if b == 0 and self.ngram is not None:  # no heads this step: prompt lookup's trie alone
            prop = self.ngram.propose(seq, replace(ctx, arm=Arm.nodes(self.ngram.max_nodes())))
            prop.arm = ctx.arm
            return prop
        ngram = self.ngram  # a head tree, with prompt lookup's continuations merged into it
        tree = self.grow(seq, b, ngram.max_nodes() if ngram is not None else 0)
        merged_at = tree.size
        if ngram is None or not ngram.merge_into(tree, seq):
            merged_at = 0
        prop = Proposal(tree, arm=ctx.arm, source=self.name, merged_at=merged_at)
        prop.trim(ctx.trim)
        return prop

    @torch.inference_mode()
    def paths(self, hidden: Tensor, root: int, budget: int) -> tuple[list, list, list, list]:
        """The ``budget`` most probable head paths from the pending token ``root`` as tree nodes below it (node
        0), best first: (parents, tokens, depths, cumulative log-probs). Grown a level at a time: head k runs on
        the depth-k nodes among the ``budget`` best found so far (deeper nodes only score less, so no node outside
        them can have a child among the final best)."""
        top = min(TOP, budget)
        # a node: (score, depth, tie order, parent node, token); its state row for expanding it is kept apart
        nodes: list[tuple[float, int, int, int, int]] = []
        frontier = [-1]  # -1: the root
        states = hidden.float()[None]
        tokens = [root]
        for k in range(min(self.heads.k, budget)):
            s, tok, lp = self.guess(k, states, torch.tensor(tokens, device=self.device), top)
            tok_l, lp_l = tok.tolist(), lp.tolist()
            first = len(nodes)
            for i, parent in enumerate(frontier):
                base = 0.0 if parent < 0 else nodes[parent][0]
                for j in range(len(tok_l[i])):
                    nodes.append((base + lp_l[i][j], k + 1, len(nodes), parent, tok_l[i][j]))
            best = set(heapq.nlargest(budget, range(len(nodes)), key=lambda n: (nodes[n][0], -nodes[n][1])))
            grow = [n for n in range(first, len(nodes)) if n in best]
            if not grow or k + 1 == self.heads.k:
                break
            rows = torch.tensor([nodes[n][3] for n in grow], device=self.device)  # their parents' rows in s
            parent_row = {p: i for i, p in enumerate(frontier)}
            states = s[torch.tensor([parent_row[int(p)] for p in rows.tolist()], device=self.device)]
            tokens = [nodes[n][4] for n in grow]
            frontier = grow
        chosen = sorted(
            heapq.nlargest(budget, range(len(nodes)), key=lambda n: (nodes[n][0], -nodes[n][1])),
            key=lambda n: (-nodes[n][0], nodes[n][1], n),
        )
        number = {n: i + 1 for i, n in enumerate(chosen)}  # tree node ids: the root is 0
        parents = [0 if nodes[n][3] < 0 else number[nodes[n][3]] for n in chosen]
        return parents, [nodes[n][4] for n in chosen], [nodes[n][1] for n in chosen], [nodes[n][0] for n in chosen]

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        self._hidden = getattr(proposal, "hidden", None)
        if self.ngram is not None:
            self.ngram.commit(proposal, path, seq)


# ---------------------------------------------------------------------------------------------- training


def stdlib_texts() -> Iterable[str]:
    """Local text that needs no download: the Python standard library's sources (its packages' too, tests
    left out), each followed by one of pydoc's topic texts while they last (code and English prose mixed, so a
    short run learns both)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "tests", "site-packages", "idle_test"} & set(p.parts))
    try:
        from pydoc_data.topics import topics

        prose = [topics[k] for k in sorted(topics)]
    except ImportError:
        prose = []
    for i, p in enumerate(files):
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            pass
        if i < len(prose):
            yield prose[i]
    yield from prose[len(files) :]


def path_texts(path: Path) -> Iterable[str]:
    """Text from a file, or every text file under a directory (sorted; undecodable files skipped)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


@dataclass
class TrainState:
    """What a training run has done (saved beside the heads, so a run resumes where the last one stopped)."""

    chunks: int = 0  # text chunks the target has read
    steps: int = 0  # optimizer steps
    tokens: int = 0  # positions seen
    seconds: float = 0.0
    loss: list[float] = field(default_factory=list)  # per head, the latest EMA
    acc: list[float] = field(default_factory=list)  # per head, the EMA of top-1 agreement with the target


def train(
    model: Any,
    tokenize: Callable[[str], list[int]],
    texts: Iterable[str],
    out: Path,
    ids: Tensor,
    max_minutes: float = 20.0,
    chunk: int = 256,
    batch: int = 256,
    lr: float = 2e-3,
    progress: Callable[[TrainState, float], None] | None = None,
    key: str = "",
    max_steps: int | None = None,
) -> tuple[Heads, TrainState]:
    """Self-distil heads from ``model`` (a :class:`~specexec.model.transformer.Transformer`) over ``texts`` for at
    most ``max_minutes``, resuming from ``out`` when it holds a run for the same key; saves to ``out`` as it goes
    (every minute and at the end). Each text chunk of ``chunk`` tokens is one target pass (hidden states and the
    target's own greedy tokens); each pass is followed by optimizer steps over the positions collected so far.
    ``max_steps``: also stop once this many optimizer steps are done in all (a fixed amount of work: the same heads
    on any machine, whatever its speed). Batches are drawn from a generator seeded by the step count."""
    heads, state, opt_state = _resume(out, model.cfg.hidden_size, ids, key)
    params = [p.requires_grad_(True) for p in heads.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if opt_state is not None:
        try:
            opt.load_state_dict({**opt_state, "param_groups": opt.state_dict()["param_groups"]})
        except (ValueError, KeyError, RuntimeError):
            pass
    rows = model.globals.lm_head
    lm = (rows.subset(ids).dequantize() if hasattr(rows, "subset") else rows[ids]).float()  # (V', D), frozen
    emb = model.globals.embed
    fast = model.dtype == torch.bfloat16  # a bf16 target's machine multiplies the output layer in bf16 too
    pos_of = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    pos_of[ids] = torch.arange(len(ids))
    feats: list[Tensor] = []
    inputs: list[Tensor] = []
    labels: list[Tensor] = []
    K = heads.k
    t_start, last_save = time.perf_counter(), time.perf_counter()
    budget_s = max_minutes * 60
    texts = list(texts)
    gen = torch.Generator().manual_seed(state.steps)
    for tokens in _passes(texts, tokenize, chunk, state):
        if state.seconds + time.perf_counter() - t_start >= budget_s:
            break
        if max_steps is not None and state.steps >= max_steps:
            break
        h, pred = _features(model, tokens)
        # head k (1-based) at position i reads the text's token i + k and learns the target's prediction after it
        T = len(tokens)
        x = torch.tensor(tokens)
        inp = torch.zeros((T, K), dtype=torch.long)
        lab = torch.full((T, K), -100, dtype=torch.long)
        for k in range(1, K + 1):
            inp[: T - k, k - 1] = x[k:]
            lab[: T - k, k - 1] = pos_of[pred[k:]]
        feats.append(h.to(torch.bfloat16))
        inputs.append(inp)
        labels.append(lab)
        state.chunks += 1
        while len(feats) > 1 and sum(f.numel() for f in feats) * 2 > FEATURE_BYTES:  # the oldest chunks go first
            feats.pop(0)
            inputs.pop(0)
            labels.pop(0)
        H, X, Y = torch.cat(feats), torch.cat(inputs), torch.cat(labels)
        for _ in range(STEPS_PER_PASS):  # a target pass costs far more than a step: reuse what was collected
            pick = torch.randint(0, H.shape[0], (min(batch, H.shape[0]),), generator=gen)
            xi = X[pick]
            with torch.no_grad():
                e = (emb[xi] if isinstance(emb, Tensor) else emb.rows(xi.reshape(-1)).reshape(*xi.shape, -1)).float()
            with torch.autocast(lm.device.type, dtype=torch.bfloat16, enabled=fast):
                logits = (heads.states(H[pick].float(), e) @ lm.T).float()  # (n, K, V')
            y = Y[pick]
            losses = [F.cross_entropy(logits[:, k], y[:, k], ignore_index=-100) for k in range(K)]
            loss = torch.stack(losses).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.steps += 1
            state.tokens += len(pick)
            with torch.no_grad():
                ok = (logits.argmax(-1) == y).float()
                valid = (y >= 0).float()
                acc = [float((ok[:, k] * valid[:, k]).sum() / valid[:, k].sum().clamp(min=1)) for k in range(K)]
            state.loss = [_ema_list(state.loss, k, v.item()) for k, v in enumerate(losses)]
            state.acc = [_ema_list(state.acc, k, a) for k, a in enumerate(acc)]
        elapsed = state.seconds + time.perf_counter() - t_start
        if progress is not None:
            progress(state, min(elapsed / budget_s, 1.0))
        if time.perf_counter() - last_save > 60:
            _save(out, heads, state, opt, key, elapsed)
            last_save = time.perf_counter()
    state.seconds += time.perf_counter() - t_start
    _save(out, heads, state, opt, key, state.seconds)
    for p in params:
        p.requires_grad_(False)
    return heads, state


def _ema_list(old: list[float], k: int, v: float) -> float:
    return v if k >= len(old) or math.isnan(old[k]) else 0.9 * old[k] + 0.1 * v


def _passes(
    texts: list[str], tokenize: Callable[[str], list[int]], chunk: int, state: TrainState
) -> Iterable[list[int]]:
    """The text's chunks not read yet (``state.chunks`` counts those read), then pass after pass over all of them
    again while the caller keeps asking (the time limit ends training, not the data)."""
    skip = state.chunks
    while True:
        n = 0
        for tokens in _chunks(texts, tokenize, chunk):
            n += 1
            if skip > 0:
                skip -= 1
                continue
            yield tokens
        if n == 0:
            return
        skip = 0


def _chunks(texts: Iterable[str], tokenize: Callable[[str], list[int]], chunk: int) -> Iterable[list[int]]:
    buf: list[int] = []
    for t in texts:
        buf.extend(tokenize(t))
        while len(buf) >= chunk:
            yield buf[:chunk]
            buf = buf[chunk:]


@torch.inference_mode()
def _features(model: Any, tokens: list[int]) -> tuple[Tensor, Tensor]:
    """The target's final hidden states (T, D) and greedy tokens (T,) over one causal pass."""
    ids = torch.tensor(tokens, device=model.device)
    pos = torch.arange(len(tokens), device=model.device)
    hidden: list[Tensor] = []
    logits = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(len(tokens)), hidden=hidden)
    return torch.cat(hidden).float().cpu().clone(), logits.argmax(-1).cpu()


def _save(out: Path, heads: Heads, state: TrainState, opt: Any, key: str, seconds: float) -> None:
    from dataclasses import asdict, replace

    from safetensors.torch import save_file

    heads.meta = {"key": key, "train": asdict(replace(state, seconds=round(seconds, 1)))}
    heads.save(out)
    moments = {
        f"{i}.{name}": t.detach().float().reshape(-1) if name == "step" else t.detach().contiguous()
        for i, st in opt.state_dict()["state"].items()
        for name, t in st.items()
        if isinstance(t, Tensor)
    }  # the optimizer's moments as safetensors (nothing is ever unpickled)
    save_file(moments, str(out.with_suffix(".optim")))


def _optimizer_state(path: Path) -> dict[str, Any] | None:
    """AdamW's state as saved by :func:`_save` (None when absent); param_groups come from the new optimizer."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    state: dict[int, dict[str, Tensor]] = {}
    for name, t in load_file(str(path)).items():
        i, key = name.split(".", 1)
        state.setdefault(int(i), {})[key] = t.reshape(()) if key == "step" else t
    return {"state": state}


def _resume(out: Path, hidden: int, ids: Tensor, key: str) -> tuple[Heads, TrainState, Any]:
    if out.is_file():
        try:
            h = Heads.load(out)
            if h.meta.get("key") == key and h.a.shape[1] == hidden and torch.equal(h.ids, ids.long()):
                state = TrainState(**h.meta.get("train", {}))
                opt_state = _optimizer_state(out.with_suffix(".optim"))
                log.info("resuming heads training: %d chunks, %d steps so far", state.chunks, state.steps)
                return h, state, opt_state
        except (SpecexecError, TypeError, RuntimeError, OSError):
            pass
    return Heads.new(hidden, ids), TrainState(), None
