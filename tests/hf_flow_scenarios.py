"""Rank-side half of tests/test_hf_flow.py: the Hugging Face flow at stage 3.
A Llama config built under zero_ext.empty_init(), wrapped without
initialization (zero_ext.skip_init), weights streamed in from a save_pretrained directory, a few
training steps, then save_weights and from_pretrained of the result."""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

import zero_ext

STEPS, BATCH, SEQ = 3, 2, 8


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=True)


def write_pretrained(path: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(config()).save_pretrained(path, max_shard_size="20KB")


def tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (world * BATCH, SEQ + 1), generator=g)


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def train_and_save(rank: int, world: int, pretrained: str, out: str) -> Optional[str]:
    from transformers import LlamaForCausalLM

    with zero_ext.empty_init():
        model = LlamaForCausalLM(config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=0.01, timeout=30,
                               param_init_fn=zero_ext.skip_init)  # every weight is loaded next
    loaded = zero_ext.load_weights(model, pretrained)
    # The reference: the pretrained model in one process over the global batch.
    reference = LlamaForCausalLM.from_pretrained(pretrained)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    problems = []
    if loaded.missing_keys or loaded.unexpected_keys:
        problems.append(f"keys: {loaded}")
    probe = tokens(99, 1)[:, :-1]
    if not torch.equal(model(probe).logits, reference(probe).logits):
        problems.append("logits differ after loading")
    for step in range(STEPS):
        batch = tokens(step, world)
        lm_loss(model, batch[rank * BATCH:(rank + 1) * BATCH]).backward()
        opt.step()
        opt.zero_grad()
        sum(lm_loss(reference, batch[r * BATCH:(r + 1) * BATCH]) / world for r in range(world)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = zero_ext.full_state_dict(model)
    for name, value in reference.state_dict().items():
        if not torch.allclose(full[name], value, rtol=1e-4, atol=1e-5):
            problems.append(f"{name} differs from the reference by {(full[name] - value).abs().max():.2e}")
    zero_ext.save_weights(model, out, max_shard_size="20KB")
    if rank == 0:
        saved = LlamaForCausalLM.from_pretrained(out)  # save_weights wrote config.json too
        if not torch.equal(saved(probe).logits, model(probe).logits):
            problems.append("from_pretrained of save_weights' output gives other logits")
    else:
        model(probe)  # the forward is collective in stage 3
    return "; ".join(problems) or None
