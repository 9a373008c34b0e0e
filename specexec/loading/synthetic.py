"""Shaped random models with a planted agreement: a target and a draft of any shapes (e.g. Llama-2-70B and 7B)
whose next-token distributions agree to a chosen degree, so the real engine can be timed end to end on a GPU
where no real weights of those sizes exist.

Random weights accept nothing (a random draft never guesses a random target), so a decode loop over them says
nothing about steps with accepted tokens: subtree reuse, overlapped growth, the auto budget. Time does not depend
on the weights' values, so here the values are chosen to make acceptance what we ask for, while every tensor keeps
its real shape, dtype and format (the streamed bytes and the matmuls are those of the real model):

* both models are bigram models: the decoder layers' output projections (``wo``, ``w2``) are scaled by ``eps``
  (1e-4), so the residual stream stays the token's embedding (bf16 rounds the layers' contributions away) and the
  logits are ``lm_head · norm(embed[x])``;
* every token x has ``k`` successors with planted logits ``z[x]`` (the target's and the draft's differ); the
  embedding row is ``Σ_i z[x, i] · U[succ[x, i]]`` over the lm_head's rows U (random, nearly orthogonal), plus a
  ballast coordinate that gives every row the same norm R, and the final norm's weight is ``R / sqrt(D)``: the
  logits are then ``z`` on the successors and a small random background elsewhere (the cross-talk of U, std
  ``|z| / sqrt(D)``), far below them;
* the target's greedy successor of x is a random cyclic permutation of the vocabulary (greedy text never loops
  within V tokens); the draft's logits are the target's plus Gaussian noise of a std found by bisection so that
  the draft's argmax equals the target's on ``agreement`` of the tokens, and on ``1 - coverage`` of them the
  draft misses the target's choice entirely (it is pushed among the background).

Defaults follow the real Qwen2.5-Coder pair on code (top-1 agreement 0.72, the target's top-1 in
the draft's top-8 on 0.965); ``PROSE`` uses its prose figures. The realised rates are measured on the planted
logits (:attr:`Planted.agreement` / :attr:`Planted.coverage`), and a benchmark reports the tokens per step the
engine actually got. This is a model of acceptance, not a language: say so next to any number it produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specexec.model.transformer import Globals, ModelConfig, ResidentLayers, Transformer

# Real models' shapes, for random models of their sizes (the GPU benchmarks' targets and drafts)
SHAPES: dict[str, dict[str, Any]] = {
    "llama2-70b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
        num_layers=80,
    ),
    "llama2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
        num_layers=32,
    ),
    "qwen2.5-32b": dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_heads=40, num_kv_heads=8, head_dim=128,
        num_layers=64, qkv_bias=True, rope_theta=1e6,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=152064, hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
        num_layers=24, qkv_bias=True, rope_theta=1e6,
    ),
    "llama3-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
        num_layers=80, rope_theta=5e5,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
        num_layers=32, rope_theta=5e5,
    ),
    "llama3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
        num_layers=16, rope_theta=5e5,
    ),
}  # fmt: skip

# --smoke: every shape shrunk so a whole benchmark runs on a CPU in seconds (checks the flow, measures nothing);
# the shapes that serve as targets keep more layers and wider ones than the drafts
SMOKE_TARGETS = ("llama2-70b", "llama3-70b", "qwen2.5-32b", "llama3-8b")
SMOKE_BIG = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
SMOKE_SMALL = {**SMOKE_BIG, "hidden_size": 128, "intermediate_size": 128}


def shape(name: str, smoke: bool = False, layers: int | None = None) -> dict[str, Any]:
    """``SHAPES[name]`` (a copy), shrunk for a smoke run (4 layers for a target, 2 for a draft), with ``layers``
    layers if given."""
    s = dict(SHAPES[name])
    if smoke:
        big = name in SMOKE_TARGETS
        s.update(SMOKE_BIG if big else SMOKE_SMALL, num_layers=4 if big else 2)
    if layers is not None:
        s["num_layers"] = layers
    return s


def model_config(name: str, smoke: bool = False, layers: int | None = None, context: int = 8192) -> ModelConfig:
    """A :class:`~specexec.model.transformer.ModelConfig` of :func:`shape`."""
    return ModelConfig(max_position_embeddings=context, **shape(name, smoke, layers))


CODE = (0.72, 0.965)  # (top-1 agreement, coverage) of the real demo pair on code
PROSE = (0.58, 0.925)  # ... on English prose
BASE_LOGIT = 16.0  # the successors' mean logit: above the background's log-mass (~ln V plus a little)
SPREAD = 2.5  # std of the target's successor logits around BASE_LOGIT (how peaked its choices are)
TARGET_MARGIN = 0.5  # a target's two best logits are at least this far apart (16-bit logits of ~16 round to 1/8)
EPS = 1e-4  # scale of the layers' output projections (their contributions vanish in 16-bit)
INIT_STD = 0.02


@dataclass(frozen=True)
class Planted:
    """The planted bigram tables. ``succ`` (V, k) long: each token's successors, ``succ[:, 0]`` the target's
    greedy choice; ``z_target`` / ``z_draft`` (V, k) fp32: their logits in each model."""

    succ: Tensor
    z_target: Tensor
    z_draft: Tensor
    noise_std: float  # the draft's logit noise that bisection found

    @property
    def vocab_size(self) -> int:
        return int(self.succ.shape[0])

    @property
    def agreement(self) -> float:
        """Fraction of tokens whose draft argmax is the target's argmax (over the planted logits)."""
        return float((self.z_draft.argmax(-1) == 0).float().mean())

    @property
    def coverage(self) -> float:
        """Fraction of tokens whose target choice is among the draft's ``k`` best (the draft keeps it planted)."""
        return float((self.z_draft[:, 0] > BASE_LOGIT / 2).float().mean())


def plant(
    vocab_size: int,
    agreement: float = CODE[0],
    coverage: float = CODE[1],
    k: int = 8,
    seed: int = 0,
    hidden: tuple[int, ...] = (),
) -> Planted:
    """Draw the successor tables for a vocabulary (CPU, deterministic in ``seed``); see the module docstring.

    ``hidden``: the hidden sizes of the models these tables go into. Their lm_heads' cross-talk adds noise of std
    about ``|z| / sqrt(hidden)`` to each model's logits; the draft's planted noise is reduced by it so the built
    pair's agreement (:func:`realised`) lands near ``agreement``."""
    if not 0.0 < agreement <= coverage <= 1.0:
        raise ValueError(f"need 0 < agreement <= coverage <= 1, got agreement={agreement}, coverage={coverage}")
    if not 2 <= k < vocab_size:
        raise ValueError(f"k={k} successors need 2 <= k < vocab_size={vocab_size}")
    V = vocab_size
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(V, generator=g)
    nxt = torch.empty(V, dtype=torch.long)
    nxt[order] = order.roll(-1)  # one cycle through the whole vocabulary
    # k-1 more successors at distinct offsets from the greedy one (strictly increasing, below V)
    steps = torch.randint(1, max(2, V // k), (V, k - 1), generator=g)
    succ = torch.cat([nxt[:, None], (nxt[:, None] + steps.cumsum(-1)) % V], dim=1)
    z = torch.randn(V, k, generator=g).mul_(SPREAD).add_(BASE_LOGIT)
    z = z.sort(dim=-1, descending=True).values  # successor 0 is the target's argmax
    noise = torch.randn(V, k, generator=g)
    missed = torch.rand(V, generator=g) >= coverage  # the draft does not see the target's choice at all
    want = agreement / coverage  # argmax agreement among the covered tokens

    def draft_logits(std: float) -> Tensor:
        zd = z + std * noise
        zd[missed, 0] = 0.0  # among the background: out of the draft's top k
        return zd

    def agree(std: float) -> float:
        zd = draft_logits(std)
        return float((zd.argmax(-1) == 0)[~missed].float().mean()) if bool((~missed).any()) else 0.0

    lo, hi = 0.0, 64.0 * SPREAD  # agreement falls (on average) as the noise grows
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if agree(mid) > want else (lo, mid)
    std = (lo + hi) / 2
    # the cross-talk of each model's lm_head is noise too: plant only the rest
    cross = sum(float((z**2).sum(-1).mean()) / max(1, d - 1) for d in hidden)
    std = math.sqrt(max(0.0, std**2 - cross))
    return Planted(succ=succ, z_target=z, z_draft=draft_logits(std), noise_std=std)


def planted_globals(
    planted: Planted,
    z: Tensor,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    margin: float = 0.0,
) -> Globals:
    """Embedding, final norm and lm_head of one model whose logits at token x are ``z[x]`` on ``succ[x]``
    (plus a small background). ``z`` is ``planted.z_target`` or ``planted.z_draft``. Built in fp32 on ``device``
    in row blocks (a 152k x 8192 fp32 matrix would be 5 GB), stored in ``dtype``. ``margin`` > 0 (targets): no
    token's two best logits are closer than that (see :func:`_widen_ties`)."""
    V, K = planted.vocab_size, hidden - 1  # the last coordinate is the ballast
    if K < 2:
        raise ValueError(f"hidden size {hidden} is too small to plant logits")
    g = torch.Generator(device=device).manual_seed(seed)
    U = torch.empty(V, hidden, dtype=dtype, device=device)  # the lm_head rows, unit norm in the first K dims
    block = max(1, (1 << 26) // hidden)
    for s in range(0, V, block):
        u = torch.randn(min(block, V - s), K, generator=g, device=device)
        U[s : s + u.shape[0], :K] = (u / u.norm(dim=-1, keepdim=True)).to(dtype)
    U[:, K] = 0
    sq = (z.float() ** 2).sum(-1)  # |z|^2 per token: the planted part's squared norm, up to cross-talk
    R = float(sq.max().sqrt()) * 1.25
    E = torch.empty(V, hidden, dtype=dtype, device=device)
    succ, zf = planted.succ.to(device), z.float().to(device)
    eblock = max(1, (1 << 24) // (hidden * succ.shape[1]))  # (rows, k, hidden) fp32 gathers of 64 MB
    for s in range(0, V, eblock):
        e = slice(s, min(V, s + eblock))
        rows = torch.einsum("vk,vkd->vd", zf[e], U[succ[e]].float())  # (v, hidden), ballast still 0
        rows[:, K] = (R**2 - rows[:, :K].pow(2).sum(-1)).clamp(min=0).sqrt()
        E[e] = rows.to(dtype)
    norm = torch.full((hidden,), R / math.sqrt(hidden), dtype=dtype, device=device)
    glob = Globals(embed=E, norm=norm, lm_head=U)
    if margin > 0:
        _widen_ties(glob, margin, R)
    return glob


def _widen_ties(glob: Globals, margin: float, R: float, block: int = 1024) -> None:
    """Raise the top logit of every token whose two best logits (as stored, in fp32) are within ``margin``: add
    ``margin`` x its lm_head row to its embedding row and rebalance the ballast. A 16-bit pass rounds logits of ~16
    to 0.125, so near-ties would let a 1-token pass and a tree pass pick different tokens: a genuine floating-point
    near-tie, but one a benchmark's exactness check would have to explain at every turn."""
    E, U = glob.embed, glob.lm_head
    V, K = E.shape[0], E.shape[1] - 1
    for _ in range(3):
        fixed = 0
        for s in range(0, V, block):
            ids = torch.arange(s, min(V, s + block), device=E.device)
            top = bigram_logits(glob, ids).topk(2, dim=-1)
            tie = (top.values[:, 0] - top.values[:, 1]) < margin
            if not bool(tie.any()):
                continue
            rows, best = ids[tie], top.indices[tie, 0]
            e = E[rows].float()
            e[:, :K] += margin * U[best, :K].float()
            e[:, K] = (R**2 - e[:, :K].pow(2).sum(-1)).clamp(min=0).sqrt()
            E[rows] = e.to(E.dtype)
            fixed += int(tie.sum())
        if not fixed:
            return


def bigram_logits(glob: Globals, ids: Tensor, eps: float = 1e-6) -> Tensor:
    """(n, V) fp32: a planted model's logits after token ``ids`` (n,), from its globals alone (its layers add
    nothing visible: see the module docstring)."""
    x = glob.embed[ids].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * glob.norm.float()
    return x @ glob.lm_head.float().T


def realised(target: Globals, draft: Globals, block: int = 1024) -> dict[str, float]:
    """What the built models agree on, measured from their logits over every token (not from the planted tables:
    the lm_head's cross-talk moves a few choices): ``agreement`` (the draft's argmax is the target's), ``top8``
    (the target's argmax is among the draft's 8 best), ``target_top1_p`` (the target's mean top-1 probability)."""
    V = target.embed.shape[0]
    agree = top8 = p1 = 0.0
    for s in range(0, V, block):
        ids = torch.arange(s, min(V, s + block), device=target.embed.device)
        lt = bigram_logits(target, ids)
        ld = bigram_logits(draft, ids.to(draft.embed.device)).to(lt.device)
        a = lt.argmax(-1)
        agree += float((ld.argmax(-1) == a).sum())
        top8 += float((ld.topk(min(8, V), dim=-1).indices == a[:, None]).any(-1).sum())
        p1 += float(lt.softmax(-1).max(-1).values.sum())
    return {"agreement": agree / V, "top8": top8 / V, "target_top1_p": p1 / V}


def layer_tensors(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int, eps: float = EPS
) -> dict[str, Tensor]:
    """One decoder layer of random weights (std 0.02; ``wo`` and ``w2`` scaled by ``eps``: the layer adds nothing
    visible to the residual stream), in the names and shapes of :func:`offload.layout.layer_shapes`."""
    from offload.layout import layer_shapes

    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name, shape in layer_shapes(cfg).items():
        if name.endswith("norm"):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name == "bqkv":
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            w = torch.randn(shape, generator=g, dtype=dtype, device=device) * INIT_STD
            out[name] = w * eps if name in ("wo", "w2") else w
    return out


def resident_model(
    cfg: ModelConfig,
    glob: Globals,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    distinct: int | None = None,
    fmt: str = "dense",
) -> Transformer:
    """A model with every layer resident on ``device``: ``distinct`` different random layers (default all) that
    the layer list cycles through (the compute is the same; memory is that of ``distinct`` layers unless a
    caller needs each one distinct). ``fmt`` int8 / nf4 quantizes every linear and the lm_head as a low-bit
    draft loads them (:func:`specexec.loading.checkpoint.quantize_weight`)."""
    from specexec.loading.checkpoint import quantize_weight

    n = cfg.num_layers if distinct is None else max(1, min(distinct, cfg.num_layers))
    made: list[dict[str, Any]] = []
    for i in range(n):
        t = layer_tensors(cfg, dtype, device, seed + 1 + i)
        if fmt != "dense":
            t = {k: (quantize_weight(v, fmt, device, dtype) if v.dim() == 2 else v) for k, v in t.items()}
        made.append(t)
    if fmt != "dense":
        glob = Globals(glob.embed, glob.norm, quantize_weight(glob.lm_head, fmt, device, dtype))
    layers = [made[i % n] for i in range(cfg.num_layers)]
    return Transformer(cfg=cfg, globals=glob, layers=ResidentLayers(layers), device=device, dtype=dtype)


class SyntheticTokenizer:
    """A tokenizer for planted models: ids print as ``<id>``; no special tokens, no EOS (generations run to their
    token limit). Enough for :class:`specexec.decoding.text.TextStream` and the engine."""

    chat_template = None
    all_special_ids: list[int] = []
    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(p) for p in text.replace(">", " ").replace("<", " ").split()]

    def __len__(self) -> int:
        return self.vocab_size


def tokenizer_info(vocab_size: int) -> Any:
    """A :class:`specexec.loading.checkpoint.TokenizerInfo` around :class:`SyntheticTokenizer` (no EOS ids)."""
    from specexec.loading.checkpoint import TokenizerInfo

    return TokenizerInfo(tokenizer=SyntheticTokenizer(vocab_size), eos_ids=frozenset())


def prompts(planted: Planted, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``length`` ids (their last ids start the greedy walks at random places)."""
    g = torch.Generator().manual_seed(seed + 7919)
    return [torch.randint(0, planted.vocab_size, (length,), generator=g).tolist() for _ in range(n)]
