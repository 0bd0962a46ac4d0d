"""GPT-style models with random weights for the benchmarks (no downloads).

A preset names a shape. With transformers installed, `build_model` returns its
GPT2LMHeadModel / LlamaForCausalLM built from a config; without it (the GPU
machine has only torch), `builtin=True` or a missing transformers gives the
equivalent model defined here, with the preset's parameter count: a
pre-LayerNorm GPT-2 (tied embedding, GELU MLP, causal scaled-dot-product
attention) or a Llama (RMSNorm, rotary positions, grouped-query attention,
SwiGLU, untied head). `vocab=` replaces the preset's vocabulary.

Every model's forward takes token ids (batch, seq) and returns logits
(batch, seq, vocab); `blocks_of(model)` lists its transformer blocks (the units
to shard in FSDP2 and zero_ext stage 3).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

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
    "gpt2-14m": Preset("gpt2", 384, 8, 6, 256, 256),  # 14.4M, byte vocabulary: issue 56's resident-memory model
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


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _LlamaBlock(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.heads, self.kv_heads = p.heads, p.kv_heads or p.heads
        head_dim = p.dim // p.heads
        self.input_norm = _RMSNorm(p.dim)
        self.q = nn.Linear(p.dim, p.heads * head_dim, bias=False)
        self.kv = nn.Linear(p.dim, 2 * self.kv_heads * head_dim, bias=False)
        self.o = nn.Linear(p.dim, p.dim, bias=False)
        self.post_norm = _RMSNorm(p.dim)
        self.gate_up = nn.Linear(p.dim, 2 * p.ffn, bias=False)
        self.down = nn.Linear(p.ffn, p.dim, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        x = self.input_norm(h)
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True,
                                              enable_gqa=True)
        h = h + self.o(attn.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class BuiltinLlama(nn.Module):
    """A Llama in plain torch, as many parameters as transformers'
    LlamaForCausalLM for the same config (q/k/v and gate/up fused: the same
    numbers of elements in fewer tensors)."""

    def __init__(self, p: Preset):
        super().__init__()
        head_dim = p.dim // p.heads
        self.embed = nn.Embedding(p.vocab, p.dim)
        self.layers = nn.ModuleList(_LlamaBlock(p) for _ in range(p.layers))
        self.norm = _RMSNorm(p.dim)
        self.lm_head = nn.Linear(p.dim, p.vocab, bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(p.context).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


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


def build_model(name: str, builtin: bool = False, seed: int = 0, vocab: Optional[int] = None) -> nn.Module:
    """The preset's model (with `vocab` tokens, if given) in fp32 on the CPU,
    the same weights for the same seed in every process."""
    p = PRESETS[name] if vocab is None else replace(PRESETS[name], vocab=vocab)
    torch.manual_seed(seed)
    if builtin or not transformers_available():
        return BuiltinGPT2(p) if p.family == "gpt2" else BuiltinLlama(p)
    return _transformers_model(p)


def blocks_of(model: nn.Module) -> List[nn.Module]:
    """The transformer blocks, in order."""
    if isinstance(model, BuiltinGPT2):
        return list(model.h)
    if isinstance(model, BuiltinLlama):
        return list(model.layers)
    lm = model.lm
    return list(lm.transformer.h) if hasattr(lm, "transformer") else list(lm.model.layers)


def describe(name: str) -> str:
    p = PRESETS[name]
    return f"{name} ({p.family}, dim {p.dim}, {p.layers} layers, {p.heads} heads, vocab {p.vocab})"
