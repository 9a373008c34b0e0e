"""A CPU block target from a GGUF takes the file's own Q4_K and Q6_K blocks: every linear tensor (layers, embedding,
lm_head) stored so is, in the loaded model, exactly the values ``gguf`` dequantizes from the file (llama q/k rows
un-permuted as the conversion does), where the fp16 copy re-quantized lost some; tensors of other types are
quantized to 4 bits from the fp16 copy as before.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open

from offload.plan import OffloadConfig
from specexec import api
from specexec.formats import q4
from specexec.formats.blocks import BLOCK_LINEARS, Q6KLinear, leaves
from specexec.loading import convert, hub
from specexec.loading.checkpoint import load_model
from tests.conftest import assert_methods_equal_ar
from tests.loading.test_convert import Q, _permute, write_gguf
from tests.loading.test_int8_target import LOW_BIT_METHODS

CPU = torch.device("cpu")
HEADS, KV_HEADS, HIDDEN, FFN = 4, 2, 256, 512  # rows of whole Q4_K blocks (256 values)
# Q4_K_M-like mixes: most linears Q4_K, some Q6_K / Q8_0 / F16, one fused part of another type in each fused weight
QTYPES = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_K,
    "blk.1.attn_q.weight": Q.F16,
    "blk.1.ffn_down.weight": Q.Q6_K,
    "blk.1.ffn_up.weight": Q.Q4_K,
    "token_embd": Q.Q4_K,
    "output": Q.Q6_K,
}
# the HF parts of each fused linear, with the GGUF kind they come from
PARTS = {
    "wqkv": (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)),
    "wo": (("attn_output", None),),
    "w13": (("ffn_gate", FFN), ("ffn_up", FFN)),
    "w2": (("ffn_down", None),),
}

pytestmark = pytest.mark.skipif(q4.available() is not None, reason=str(q4.available()))


def _write(path: Path, arch: str, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(
        path, arch=arch, hidden=HIDDEN, intermediate=FFN, heads=HEADS, kv_heads=KV_HEADS, qkv_bias=arch == "qwen2",
        qtypes=QTYPES, seed=seed,
    )  # fmt: skip
    return path


def _file_layers(path: Path, arch: str) -> dict[str, tuple[str, torch.Tensor]]:
    """{GGUF name: (ggml type, values in the HF row order)}: gguf's dequantization of the file's blocks, and for a
    llama file's q/k the inverse of llama.cpp's row permutation."""
    out = {}
    for t in GGUFReader(path).tensors:
        if len(t.shape) != 2:
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        values = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), np.float32)).reshape(rows, cols)
        heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(t.name.split(".")[-2])
        if arch == "llama" and heads is not None:
            order = _permute(np.arange(rows), heads)  # stored row r is HF row order[r]
            values = values[torch.from_numpy(np.argsort(order))]
        out[t.name] = (t.tensor_type.name, values)
    return out


def _parts(model, i: int, key: str) -> list[torch.Tensor]:
    """The loaded block weight ``key`` of layer ``i``, dequantized, split into its HF parts."""
    w = model.layers.layer(i)[key]
    assert isinstance(w, BLOCK_LINEARS)
    sizes = [
        {"attn_q": HEADS, "attn_k": KV_HEADS, "attn_v": KV_HEADS}[kind] * (HIDDEN // HEADS)
        if key == "wqkv"
        else (FFN if key == "w13" else w.shape[0])
        for kind, _ in PARTS[key]
    ]
    return list(w.dequantize().split(sizes))


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def converted(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    """(architecture, GGUF, its full conversion, the same conversion without its reading plan: as converted
    before the plan was written, which loads as today)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    gguf_path = _write(root / f"{arch}.gguf", arch)
    conv = convert.gguf_to_hf_dir(gguf_path, root / "conv", progress=False)
    old = Path(shutil.copytree(conv, root / "old"))
    (old / convert.GGUF_SOURCE).unlink()
    return arch, gguf_path, conv, old


def _raw(w) -> torch.Tensor:
    """The bytes a block weight holds, its parts' one after another."""
    return torch.cat([p.packed.flatten() for p in leaves(w)])


def test_k_quant_tensors_are_the_files_blocks_and_the_rest_is_as_before(converted):
    """Every Q4_K and Q6_K tensor's values in the loaded CPU model (layers, embedding, lm_head) equal gguf's
    dequantization of the file bit for bit (un-permuted for llama), Q6_K kept in its own blocks; every other part is
    today's 4-bit quantization of the fp16 copy."""
    arch, gguf_path, conv, old = converted
    assert convert.gguf_blocks(conv) is not None and convert.gguf_blocks(old) is None
    file = _file_layers(gguf_path, arch)
    new, before = load_model(conv, CPU, torch.float32, fmt="q4"), load_model(old, CPU, torch.float32, fmt="q4")
    taken = {"Q4_K": 0, "Q6_K": 0}
    for i in range(2):
        for key, parts in PARTS.items():
            for (kind, _), got, was in zip(parts, _parts(new, i, key), _parts(before, i, key)):
                qtype, want = file[f"blk.{i}.{kind}.weight"]
                if qtype in taken:
                    assert torch.equal(got, want), (i, kind)
                    assert not torch.equal(was, want)  # the fp16 copy quantized again is another weight
                    taken[qtype] += 1
                else:
                    assert torch.equal(got, was), (i, kind, qtype)
        assert isinstance(leaves(new.layers.layer(i)["wqkv"])[-1], Q6KLinear)  # v
        for k in ("attn_norm", "mlp_norm", *(("bqkv",) if arch == "qwen2" else ())):
            assert torch.equal(new.layers.layer(i)[k], before.layers.layer(i)[k])
    assert taken == {"Q4_K": 9, "Q6_K": 3}
    assert isinstance(new.globals.lm_head, Q6KLinear)
    assert torch.equal(new.globals.lm_head.dequantize(), file["output.weight"][1])
    ids = torch.tensor([0, 7, 200])
    assert torch.equal(new.globals.embed.rows(ids), file["token_embd.weight"][1][ids])
    for i in range(2):
        for key in PARTS:
            w = new.layers.layer(i)[key]
            x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(i))
            assert torch.equal(w.linear(x), torch.cat([p.linear(x) for p in leaves(w)], 1))  # fused = its parts


def test_a_conversion_without_layers_gives_the_same_q4_layers(converted, tmp_path):
    """A ``layers_in_gguf`` conversion reads the same plan: the same 4-bit layers as the full conversion."""
    arch, gguf_path, conv, _ = converted
    meta = convert.gguf_to_hf_dir(gguf_path, tmp_path / "meta", progress=False, layers_in_gguf=True)
    a, b = load_model(meta, CPU, torch.float32, fmt="q4"), load_model(conv, CPU, torch.float32, fmt="q4")
    for i in range(2):
        for key in PARTS:
            assert torch.equal(_raw(a.layers.layer(i)[key]), _raw(b.layers.layer(i)[key])), (i, key)


def test_a_gguf_gone_or_changed_loads_the_fp16_copy_as_before(tmp_path):
    gguf_path = _write(tmp_path / "g" / "m.gguf", "qwen2")
    conv = convert.gguf_to_hf_dir(gguf_path, tmp_path / "conv", progress=False)
    want = load_model(conv, CPU, torch.float32, fmt="q4")  # from the blocks
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert convert.gguf_blocks(conv) is None
    changed = load_model(conv, CPU, torch.float32, fmt="q4")
    gguf_path.unlink()
    assert convert.gguf_blocks(conv) is None
    gone = load_model(conv, CPU, torch.float32, fmt="q4")
    for key in PARTS:
        assert torch.equal(changed.layers.layer(0)[key].packed, gone.layers.layer(0)[key].packed)
    assert not torch.equal(changed.layers.layer(0)["w2"].packed, want.layers.layer(0)["w2"].packed)
    assert torch.equal(changed.layers.layer(0)["wo"].packed, gone.layers.layer(0)["wo"].packed)
    assert isinstance(changed.globals.lm_head, q4.Q4Linear) and isinstance(want.globals.lm_head, Q6KLinear)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_speculation_on_a_q4_gguf_target_equals_its_ar(arch, tmp_path):
    """specexec.load on the GGUF itself (`--target FILE.gguf --target-dtype q4`), a draft from another GGUF with the
    same vocabulary: the target's Q4_K tensors are the file's, and every method gives its greedy AR tokens."""
    target = _write(tmp_path / "t" / "t.gguf", arch)
    draft = tmp_path / "d" / "d.gguf"
    draft.parent.mkdir()
    write_gguf(draft, arch=arch, layers=1, seed=1, qkv_bias=arch == "qwen2")
    e = api.load(str(target), str(draft), device="cpu", offload=OffloadConfig(target_dtype="q4"), context=128,
                 progress=False, cache_dir=tmp_path / "home")  # fmt: skip
    assert e.target_weights == "q4"
    _, want = _file_layers(target, arch)["blk.0.attn_k.weight"]
    assert torch.equal(_parts(e.target, 0, "wqkv")[1], want)
    assert_methods_equal_ar(e, ([5, 9, 17, 33, 4], [3, 60, 61, 62, 63, 12, 40]), LOW_BIT_METHODS, n=16)


def test_a_cpu_gguf_target_keeps_no_16_bit_copy_and_runs_the_files_blocks(tmp_path):
    """`--target FILE.gguf` on a CPU with the weights left to auto: the conversion writes the tokenizer, config and
    small tensors only (layers, embedding and lm_head stay in the file), the target runs the file's blocks, and
    every method gives its greedy AR tokens."""
    target = _write(tmp_path / "t" / "t.gguf", "qwen2")
    draft = tmp_path / "d" / "d.gguf"
    draft.parent.mkdir()
    write_gguf(draft, arch="qwen2", layers=1, seed=1, qkv_bias=True)
    home = tmp_path / "home"
    e = api.load(str(target), str(draft), device="cpu", context=128, progress=False, cache_dir=home)
    assert e.target_weights == "q4"
    conv = hub.converted_gguf_dir(target, home, layers_in_gguf=True)
    assert convert.layers_in_gguf(conv)
    stored = {n for f in conv.glob("*.safetensors") for n in safe_open(f, "pt").keys()}
    assert stored == {"model.norm.weight"}
    file = _file_layers(target, "qwen2")
    assert torch.equal(e.target.globals.lm_head.dequantize(), file["output.weight"][1])
    assert torch.equal(_parts(e.target, 1, "w2")[0], file["blk.1.ffn_down.weight"][1])  # Q6_K
    assert_methods_equal_ar(e, ([5, 9, 17, 33, 4], [3, 60, 61, 62, 63, 12, 40]), LOW_BIT_METHODS, n=16)


def test_a_conversion_without_its_weights_loads_dense_as_the_full_one(converted, tmp_path):
    """Asked for dense weights, a conversion without its layers, embedding and lm_head reads them from the GGUF:
    the same values the full conversion stores."""
    arch, gguf_path, conv, _ = converted
    meta = convert.gguf_to_hf_dir(gguf_path, tmp_path / "meta", progress=False, layers_in_gguf=True)
    a, b = load_model(meta, CPU, torch.float32), load_model(conv, CPU, torch.float32)
    assert torch.equal(a.globals.embed, b.globals.embed) and torch.equal(a.globals.lm_head, b.globals.lm_head)
    for i in range(2):
        for key, w in b.layers.layer(i).items():
            assert torch.equal(a.layers.layer(i)[key], w), (i, key)
