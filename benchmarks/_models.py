"""GPT-style models with random weights for the benchmarks (no downloads).

A preset names a shape. With transformers installed, `build_model` returns its
GPT2LMHeadModel / LlamaForCausalLM built from a config; without it (the GPU
machine has only torch), `builtin=True` or a missing transformers gives the
equivalent pre-LayerNorm GPT-2 defined here (tied embedding, GELU MLP, causal
scaled-dot-product attention), so the parameter count matches the preset.

Every model's forward takes token ids (batch, seq) and returns logits
(batch, seq, vocab); `blocks_of(model)` lists its transformer blocks (the units
to shard in FSDP2 and zero_ext stage 3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Preset:
    family: str  # "gpt2" or "llama"
    dim: int
    layers: int
    heads: int
    vocab: int
    context: int
    ffn: int = 0  # llama only: SwiGLU hidden size
    kv_heads: int = 0  # llama only: key/value heads (grouped-query attention); 0: as many as heads


PRESETS = {
    "gpt2-tiny": Preset("gpt2", 64, 2, 2, 2048, 64),  # 0.2M parameters: the benchmarks' own tests
    "gpt2-10m": Preset("gpt2", 256, 4, 4, 32000, 512),
    "gpt2-50m": Preset("gpt2", 512, 8, 8, 32000, 1024),
    "gpt2-124m": Preset("gpt2", 768, 12, 12, 50257, 1024),  # GPT-2 small
    "llama-tiny": Preset("llama", 256, 4, 4, 2048, 256, ffn=688, kv_heads=2),  # RMSNorm, GQA, SwiGLU
    "llama-200m": Preset("llama", 1024, 10, 16, 32000, 2048, ffn=2816),
    "gpt2-1b": Preset("gpt2", 2048, 18, 16, 50257, 1024),
}


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln_1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return h + self.out(F.gelu(self.fc(self.ln_2(h)), approximate="tanh"))


class BuiltinGPT2(nn.Module):
    """GPT-2 in plain torch: same parameter shapes and count as transformers'
    GPT2LMHeadModel for the same config (lm_head tied to the token embedding)."""

    def __init__(self, p: Preset):
        super().__init__()
        self.wte = nn.Embedding(p.vocab, p.dim)
        self.wpe = nn.Embedding(p.context, p.dim)
        self.h = nn.ModuleList(_Block(p.dim, p.heads) for _ in range(p.layers))
        self.ln_f = nn.LayerNorm(p.dim)
        self.lm_head = nn.Linear(p.dim, p.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


class _Logits(nn.Module):
    """A transformers causal LM whose forward returns the logits tensor."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits


def _transformers_model(p: Preset) -> nn.Module:
    import transformers

    if p.family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=p.vocab, n_positions=p.context, n_embd=p.dim, n_layer=p.layers, n_head=p.heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        lm = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=p.vocab, hidden_size=p.dim, intermediate_size=p.ffn, num_hidden_layers=p.layers,
            num_attention_heads=p.heads, num_key_value_heads=p.kv_heads or p.heads,
            max_position_embeddings=p.context,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        lm = transformers.LlamaForCausalLM(config)
    lm.config.use_cache = False
    return _Logits(lm)


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def build_model(name: str, builtin: bool = False, seed: int = 0) -> nn.Module:
    """The preset's model in fp32 on the CPU, the same weights for the same
    seed in every process."""
    p = PRESETS[name]
    torch.manual_seed(seed)
    if builtin or not transformers_available():
        if p.family != "gpt2":
            raise SystemExit(f"{name} needs transformers (pip install transformers); "
                             f"the built-in model is GPT-2 only")
        return BuiltinGPT2(p)
    return _transformers_model(p)


def blocks_of(model: nn.Module) -> List[nn.Module]:
    """The transformer blocks, in order."""
    if isinstance(model, BuiltinGPT2):
        return list(model.h)
    lm = model.lm
    return list(lm.transformer.h) if hasattr(lm, "transformer") else list(lm.model.layers)


def describe(name: str) -> str:
    p = PRESETS[name]
    return f"{name} ({p.family}, dim {p.dim}, {p.layers} layers, {p.heads} heads, vocab {p.vocab})"
