"""specexec.model.sizes against real allocations; the load-time memory check (stored dtype, tree-sized buffers) refusing
before anything is allocated; the offload cache's read-only error; ``specexec cache``."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specexec import api
from specexec.cli import app
from specexec.config import ChainConfig, TreeConfig
from specexec.errors import OutOfMemory, SpecexecError
from specexec.loading import memory
from specexec.loading.checkpoint import load_model, read_config
from specexec.model import sizes
from specexec.model.kv_cache import KVCache
from specexec.model.transformer import ModelConfig
from specexec.steps.tree import Tree
from tests.conftest import make_tiny

CPU = torch.device("cpu")
runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sizes")
    return make_tiny(root / "target", "qwen2", seed=3), make_tiny(root / "draft", "qwen2", seed=4, layers=1)


def test_kv_and_weights_match_real_tensors(pair):
    t_cfg = read_config(pair[0])
    tree, chain = TreeConfig.fixed(40, max_beams=8), ChainConfig()
    for dtype in (torch.float32, torch.bfloat16):
        slots = sizes.target_cache_slots(100, tree, chain)
        cache = KVCache(t_cfg.num_layers, t_cfg.num_kv_heads, slots, t_cfg.head_dim, dtype, CPU)
        assert cache.nbytes() == sizes.kv_bytes(t_cfg, slots, dtype.itemsize)
    model = load_model(pair[0], CPU, torch.float32)
    real = sum(
        t.numel()
        for t in model.globals.__dict__.values()
        if isinstance(t, torch.Tensor)
        if t is not model.globals.lm_head or model.globals.lm_head is not model.globals.embed
    )
    real += sum(t.numel() for i in range(t_cfg.num_layers) for t in model.layers.layer(i).values())
    assert sizes.param_count(t_cfg) == real == sizes.stored_weights(pair[0]).params
    # the step's N x N ancestry mask is what a tree of that size allocates
    t = Tree(0, 2 * tree.budget + 1, CPU)
    t.add(torch.zeros(tree.budget + 1, dtype=torch.long), torch.arange(tree.budget + 1), torch.zeros(tree.budget + 1))
    anc = t.ancestry()
    step = sizes.step_buffers(t_cfg, None, 100, tree, chain)
    assert anc.numel() * anc.element_size() >= step.ancestry - 2 * (tree.budget + 2)  # N = budget + root
    assert step.logits == 2 * (tree.budget + 1) * t_cfg.vocab_size * 4


def test_engine_caches_are_what_sizes_says(pair):
    """The engine's two KV caches (as allocated by a real load) equal the sizes figures for them."""
    tree = TreeConfig.fixed(24, max_beams=8)
    engine = api.load(str(pair[0]), str(pair[1]), device="cpu", context=200, tree=tree, progress=False)
    need = memory.check_load(pair[0], pair[1], CPU, "auto", None, 200, tree, ChainConfig())
    real = engine.state.cache.nbytes() + engine.draft_model.cache.nbytes()
    assert need.kv == real
    # n-gram nodes merged into the tree make the engine grow its caches by exactly what sizes says
    from specexec.propose.ngram import NGramConfig

    engine.generate([5, 6, 7, 5, 6, 7, 5, 6], 2, method="specexec", tree=tree, ngram=NGramConfig(max_nodes=16))
    t_cfg, d_cfg = read_config(pair[0]), read_config(pair[1])
    chain = ChainConfig()
    assert engine.state.cache.nbytes() == sizes.kv_bytes(t_cfg, sizes.target_cache_slots(200, tree, chain, 16), 4)
    assert engine.draft_model.cache.nbytes() == sizes.kv_bytes(d_cfg, sizes.draft_cache_slots(200, tree, chain, 16), 4)


def test_host_ram_figure_uses_the_stored_dtype(pair, tmp_path):
    """A checkpoint stored in fp32 and the same in bf16: the bytes on disk differ 2x, the loaded fp32 weights do
    not (2x the file size would refuse an fp32-stored 1.5B model as needing 14.6 GB)."""
    from safetensors.torch import load_file, save_file

    bf16 = tmp_path / "bf16"
    shutil.copytree(pair[0], bf16)
    sd = load_file(pair[0] / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in sd.values())
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, bf16 / "model.safetensors", metadata={"format": "pt"})
    s32, s16 = sizes.stored_weights(pair[0]), sizes.stored_weights(bf16)
    assert (s32.dtype, s16.dtype) == ("F32", "BF16") and s32.params == s16.params
    assert s32.nbytes == 2 * s16.nbytes == 4 * s32.params
    n32 = memory.check_load(pair[0], None, CPU, "fp32", None, 64, TreeConfig.fixed(4))
    n16 = memory.check_load(bf16, None, CPU, "fp32", None, 64, TreeConfig.fixed(4))
    assert n32.weights == n16.weights == 4 * (sizes.param_count(read_config(pair[0])) + s32.largest)
    file32 = (pair[0] / "model.safetensors").stat().st_size
    assert n32.weights < 1.2 * file32  # not 2x the fp32 file
    # loaded as bf16 the figure halves, whatever the storage
    assert memory.check_load(pair[0], None, CPU, "bf16", None, 64, TreeConfig.fixed(4)).weights == n16.weights // 2


def test_huge_budget_refused_before_anything_is_allocated(pair, monkeypatch):
    """--budget 65536: the N x N mask alone is 4.3 GB; with 1 GB free the load refuses up front and names the
    largest budget whose buffers fit -- no weight is read, no cache allocated."""
    have = 1 << 30
    monkeypatch.setattr(memory, "available_bytes", lambda device: have + memory.MARGIN_BYTES)

    def no_alloc(*a, **kw):
        raise AssertionError("nothing may be loaded or allocated before the memory check")

    monkeypatch.setattr(api, "load_model", no_alloc)
    monkeypatch.setattr(KVCache, "__init__", no_alloc)
    tree = TreeConfig.fixed(65536)
    with pytest.raises(memory.NotEnoughMemory) as err:
        api.load(str(pair[0]), str(pair[1]), device="cpu", context=512, tree=tree, progress=False)
    e = err.value
    msg = str(e)
    assert isinstance(e, OutOfMemory) and e.resource == "RAM" and e.need > e.have
    assert msg.startswith("the tree's buffers for TreeConfig.budget=65536 need ") and "of RAM" in msg
    assert msg.endswith(f"the largest that fits is TreeConfig.budget={e.largest_budget}")
    assert 1 <= e.largest_budget < 65536
    t_cfg, d_cfg = read_config(pair[0]), read_config(pair[1])

    def total(b: int) -> int:
        return sizes.engine_memory(
            t_cfg,
            d_cfg,
            512,
            4,
            4,
            TreeConfig.fixed(b),
            target_weights=sizes.stored_weights(pair[0]).resident_bytes(4, t_cfg),
            draft_weights=sizes.stored_weights(pair[1]).resident_bytes(4, d_cfg),
        ).total

    assert total(e.largest_budget) <= have < total(e.largest_budget + 1)
    # the CLI turns it into one error line
    result = runner.invoke(
        app,
        [
            "generate",
            "--target",
            str(pair[0]),
            "--draft",
            str(pair[1]),
            "--device",
            "cpu",
            "--budget",
            "65536",
            "--max-new-tokens",
            "4",
            "--prompt",
            "hi",
            "-q",
        ],
    )
    assert result.exit_code != 0  # (its default context differs, so does the figure)
    assert re.search(
        r"^error: the tree's buffers for --budget 65536 need .* the largest that fits is --budget \d+$", result.output
    )
    assert "Traceback" not in result.output


def test_context_too_big_names_the_context(pair, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    with pytest.raises(
        memory.NotEnoughMemory, match="not enough RAM: the weights need .* KV caches for context=2048 .*lower context$"
    ):
        memory.check_load(pair[0], None, CPU, "auto", None, 2048, TreeConfig.fixed(4))


def test_ssd_cache_on_a_read_only_file_system(pair, tmp_path, monkeypatch, caplog):
    """--offload ssd whose cache directory cannot be written: one clear error before any layer is written; the
    write is announced (what, where, how big) first."""
    from offload import OffloadConfig
    from specexec.loading.offloaded import load_offloaded

    cache = tmp_path / "cache"
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if cache in self.parents or self == cache:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    off = OffloadConfig(mode="ssd", cache_dir=cache, resident_layers=0)
    with caplog.at_level("WARNING"), pytest.raises(SpecexecError, match="read-only file system.*--cache-dir"):
        load_offloaded(pair[0], CPU, "fp32", off)
    assert "writing the SSD-tier layer cache of target: 2 layers" in caplog.text and str(cache) in caplog.text
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    model = load_offloaded(pair[0], CPU, "fp32", off)  # a writable directory works, under <cache>/offload
    assert list((cache / "offload").glob("target-*/manifest.json"))
    model.layers.close()


def test_cache_list_and_rm(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPECEXEC_HOME", str(home))
    (home / "models" / "m1").mkdir(parents=True)
    (home / "models" / "m1" / "model.safetensors").write_bytes(b"x" * 3000)
    (home / "offload" / "m1-nf4-abc").mkdir(parents=True)
    (home / "offload" / "m1-nf4-abc" / "layer_00000.bin").write_bytes(b"y" * 1000)
    (home / "wheels").mkdir()
    (home / "wheels" / "p-1.0-py3-none-any.whl").write_bytes(b"z" * 500)
    out = runner.invoke(app, ["cache", "list"])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["models/m1", "offload/m1-nf4-abc", "wheels", "total"]
    assert str(home / "models" / "m1") in lines[0] and "layer cache" in lines[1]
    out = runner.invoke(app, ["cache", "rm", "m1-nf4-abc"], input="n\n")  # asks; "n" keeps it
    assert out.exit_code == 1 and (home / "offload" / "m1-nf4-abc").exists()
    out = runner.invoke(app, ["cache", "rm", "m1-nf4-abc", "--yes"])
    assert out.exit_code == 0 and not (home / "offload" / "m1-nf4-abc").exists()
    out = runner.invoke(app, ["cache", "rm", "nope", "--yes"])
    assert out.exit_code != 0 and "no cache entry 'nope'" in out.output
    out = runner.invoke(app, ["cache", "rm", "--all"], input="y\n")
    assert out.exit_code == 0 and "removed 2 entries" in out.stdout
    assert not (home / "models" / "m1").exists() and not (home / "wheels").exists()
    assert "the cache is empty" in runner.invoke(app, ["cache", "list", "--cache-dir", str(home)]).stdout


def test_plan_reserves_the_gpu_default_ngram_branches():
    """An offloaded (GPU) target's plan leaves room for the n-gram nodes merged into every tree by default: the
    verified pass and the KV room hold tree + NGRAM_NODES_GPU tokens; ``ngram=0`` reserves none."""
    from specexec.config import NGRAM_NODES_GPU

    cfg = ModelConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32
    )
    base = sizes.plan_reservations(cfg, cfg, 512, 2, 2, TreeConfig.fixed(128, ngram=0))
    merged = sizes.plan_reservations(cfg, cfg, 512, 2, 2, TreeConfig.fixed(128))
    assert merged.max_tokens == base.max_tokens + NGRAM_NODES_GPU
    assert merged.kv_bytes > base.kv_bytes


def test_fitting_caps_halve_only_an_auto_trees_max_budget():
    fixed = TreeConfig.fixed(300)
    assert sizes.fitting_caps(fixed) == [fixed]
    caps = sizes.fitting_caps(TreeConfig(auto=True, budget=64, max_budget=1024))
    assert [c.max_budget for c in caps] == [1024, 512, 256, 128, 64]
    assert all(c.auto and c.budget == 64 for c in caps)
    assert [c.budget for c in sizes.fitting_caps(TreeConfig(auto=True, budget=200, max_budget=256))] == [200, 128, 64]


def test_load_lowers_the_auto_max_budget_until_the_streamed_plan_fits(pair, tmp_path, monkeypatch):
    """A streamed target whose plan has no GPU memory left beside the default trees' reservation: load halves
    --max-budget until some draft format fits, the engine caps auto trees there and refuses bigger fixed ones; when
    even the smallest cap does not fit, the error says so."""
    from offload import OffloadConfig
    from specexec.loading import offloaded as offload_load

    real = offload_load.plan_with_draft
    asked: list[int] = []

    def tight(path, device, dtype, offload, reserve, formats, **kw):
        tokens = reserve(formats[0]).max_tokens
        asked.append(tokens)
        if tokens > limit[0]:
            raise OutOfMemory("VRAM too small to stream the target (test)", "GPU memory", 2, 1)
        return real(path, device, dtype, offload, reserve, formats, **kw)

    monkeypatch.setattr(offload_load, "plan_with_draft", tight)
    limit = [400]  # a 256-node tree + the n-gram branches fits, a 512-node one does not
    off = OffloadConfig(mode="ram", cache_dir=tmp_path)
    tree = TreeConfig(auto=True, max_budget=1024)
    eng = api.load(str(pair[0]), str(pair[1]), device="cpu", dtype="fp32", context=128, offload=off, tree=tree)
    assert eng.max_tree == 256 and asked[0] > asked[-1]
    r = eng.generate([5, 6, 7], 6, method="specexec", tree=tree)  # capped: the auto tree never exceeds 256
    assert r.stats.new_tokens == 6 and all(b.size <= 256 for b in r.stats.budgets)
    eng.generate([5, 6, 7], 4, method="specexec", tree=TreeConfig.fixed(256))
    with pytest.raises(SpecexecError, match="budget.512 exceeds the largest tree"):
        eng.generate([5, 6, 7], 4, method="specexec", tree=TreeConfig.fixed(512))
    limit[0] = 10  # nothing fits, even the smallest cap
    with pytest.raises(OutOfMemory, match="even with .*max_budget.64"):
        api.load(str(pair[0]), str(pair[1]), device="cpu", dtype="fp32", context=128, offload=off, tree=tree)
    with pytest.raises(OutOfMemory, match="or a smaller .*budget"):  # a fixed budget is not lowered: the error says
        api.load(str(pair[0]), str(pair[1]), device="cpu", dtype="fp32", context=128, offload=off,
                 tree=TreeConfig.fixed(512))  # fmt: skip
    limit[0] = 10**6  # everything fits: no cap
    eng = api.load(str(pair[0]), str(pair[1]), device="cpu", dtype="fp32", context=128, offload=off, tree=tree)
    assert eng.max_tree is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_lowers_the_max_budget_under_a_real_vram_cap(pair, tmp_path):
    """The real CUDA load path (probed VRAM, the offload plan, streamed layers): under a --gpu-memory cap that leaves
    no room for 1024-node trees but some for smaller ones, load lowers --max-budget (Engine.max_tree), the auto trees
    stay within it, and the tokens equal the target's greedy ones."""
    from offload import OffloadConfig

    tree = TreeConfig(auto=True, max_budget=1024)

    def attempt(gb: float):
        off = OffloadConfig(mode="ram", cache_dir=tmp_path, gpu_memory_gb=gb)
        try:
            return api.load(str(pair[0]), str(pair[1]), device="cuda", dtype="bf16", draft_dtype="bf16",
                            context=128, offload=off, tree=tree)  # fmt: skip
        except OutOfMemory:
            return None

    lo, hi = 1e-6, 4.0  # nothing fits at lo; everything at hi
    eng = attempt(hi)
    assert eng is not None and eng.max_tree is None
    for _ in range(60):  # bisect the cap down to where the 1024-node reservation just stops fitting
        mid = (lo + hi) / 2
        eng = attempt(mid)
        if eng is not None and eng.max_tree is not None:
            break
        lo, hi = (mid, hi) if eng is None else (lo, mid)
    else:
        pytest.fail("no cap found where only a lowered --max-budget fits")
    assert eng is not None and eng.max_tree is not None and 64 <= eng.max_tree < 1024
    prompt = [5, 6, 7, 8, 9]
    want = eng.generate(prompt, 24, method="ar").tokens
    r = eng.generate(prompt, 24, method="specexec", tree=tree)
    assert r.tokens == want
    assert all(b.size <= eng.max_tree for b in r.stats.budgets)
