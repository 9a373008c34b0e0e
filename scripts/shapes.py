"""Model shapes the GPU benchmarks fill with random weights, and the HF accelerate baseline built from one.

Random weights of a real model's shape stream the real bytes and run the real matmuls; only acceptance needs
something else (``specexec.loading.synthetic`` plants it). Used by ``bench_gpu.py`` and ``bench_offload.py``.
"""

from __future__ import annotations

from typing import Any

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


def model_config(name: str, smoke: bool = False, layers: int | None = None, context: int = 8192) -> Any:
    """A :class:`specexec.model.transformer.ModelConfig` of :func:`shape`."""
    from specexec.model.transformer import ModelConfig

    return ModelConfig(max_position_embeddings=context, **shape(name, smoke, layers))


def accelerate_llama(n_layers: int, main: Any, s: dict[str, Any]) -> Any:
    """An ``n_layers`` bf16 HF LlamaForCausalLM of shape ``s`` (a :func:`shape`) with random weights, dispatched by
    accelerate ``device_map``: decoder layers on "cpu" (offloaded, what users try first), embedding, norm and
    lm_head on ``main`` (a CUDA index; "cpu" for a smoke run)."""
    import torch
    from accelerate import dispatch_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=n_layers,
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.to_empty(device="cpu")
    block = torch.randn(1 << 20, dtype=torch.bfloat16) * 0.02  # tiled into every weight (normal_ over GBs is slow)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.data.view(-1)
            if "norm" in name:
                flat.fill_(1.0)
                continue
            k, B = flat.numel() // block.numel(), block.numel()
            flat[: k * B].view(k, B).copy_(block.expand(k, B))
            flat[k * B :].copy_(block[: flat.numel() - k * B])
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its inv_freq was made on meta
    device_map = {
        "model.embed_tokens": main,
        "model.rotary_emb": main,
        "model.norm": main,
        "lm_head": main,
        **{f"model.layers.{i}": "cpu" for i in range(n_layers)},
    }
    return dispatch_model(model, device_map=device_map, main_device=main).eval()
