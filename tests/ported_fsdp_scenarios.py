"""Behaviours that PyTorch FSDP2's fully_shard tests check
(test/distributed/_composable/fsdp/test_fully_shard_autograd.py,
_training.py and _frozen.py), written from scratch against zero_ext's API:
unused outputs and units, container activations, gradient hooks, units run
several times, partial and chunked forwards, optimizer step hooks, tied
weights, accumulation with and without sync, frozen and trainable units
interleaved, and a forward that raised on every rank, retried."""
from __future__ import annotations

import collections
import contextlib
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import parity_scenarios as ps
import zero_ext
from parity_scenarios import BATCH, SEQ, Context
from ported_models import (
    ChunkedHead, ContainerBlock, D, DoubleLinear, FromContainer, Inner, MLP, MLPStack, MultiForward, MultiForwardMixed,
    ParamOnly, TiedEmbedOutput, ToContainer, _adam, _backward_counting, _bf16_training, _init, _is_linear, _lm,
    _mean_over_ranks, _released, _rows, _seeded, _step, _tokens, _wrap)


# --- FSDP2: test_fully_shard_autograd.py --------------------------------------------

def fsdp_unused_forward_output(ctx: Context) -> None:
    """FSDP2 test_unused_forward_output: both outputs in the loss, then only the first; zero_grad(set_to_none) alternating."""
    model = DoubleLinear(use_second_linear=True)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(4):
        loss = 0.0
        for r, w in ctx.participants():
            out1, out2 = model(_rows(step, r, ctx.world))
            loss = loss + w * ((out1 * out2).sum() if step < 2 else out1.sum())
        loss.backward()
        # zero_grad(set_to_none=False) after step 1: lin2 keeps a zero gradient that Adam steps in steps 2-3
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_unused_forward_module(ctx: Context) -> None:
    """FSDP2 test_unused_forward_module: a Linear (a stage 3 unit) that never runs; its gradient stays None."""
    model = DoubleLinear(use_second_linear=False)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def _nontensor_activations(ctx: Context, kind: str) -> None:
    model = _init(nn.Sequential(ToContainer(kind), ContainerBlock(), ContainerBlock(), ContainerBlock(),
                                FromContainer()), 21)
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: each ContainerBlock by the automatic policy
    for step in range(2):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_nontensor_activations_list(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (list): units take and return lists."""
    _nontensor_activations(ctx, "list")


def fsdp_nontensor_activations_namedtuple(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (namedtuple): units take and return namedtuples with a passthrough tensor."""
    _nontensor_activations(ctx, "namedtuple")


def fsdp_nontensor_activations_tuple(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (tuple): units take and return tuples."""
    _nontensor_activations(ctx, "tuple")


def fsdp_nontensor_activations_dict(ctx: Context) -> None:
    """FSDP2 test_nontensor_activations (dict): units take and return dicts."""
    _nontensor_activations(ctx, "dict")


def fsdp_multi_grad_hook_and_tensor_hooks(ctx: Context) -> None:
    """FSDP2's register_multi_grad_hook use (ModuleTracker) and test_post_acc_grad_hook_runs: user multi-grad hooks on a unit's activations and parameters, and post-accumulate-grad hooks, fire once per backward with the right gradients."""
    model = ps.Net()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=ps.net_units)
    fired: Dict[str, List[torch.Tensor]] = {"activations": [], "parameters": []}
    handles = []

    def on_activations(grads):
        fired["activations"].append(torch.stack([g.sum() for g in grads]))

    def on_parameters(grads):
        fired["parameters"].append(torch.stack([g.sum() for g in grads]))

    def forward_hook(module, args, out):  # what torch.utils.module_tracker does
        handles.append(torch.autograd.graph.register_multi_grad_hook([args[0], out], on_activations))

    model.mid.register_forward_hook(forward_hook)
    torch.autograd.graph.register_multi_grad_hook([model.mid.weight, model.mid.bias], on_parameters)
    accumulated = collections.Counter()  # FSDP2 test_post_acc_grad_hook_runs
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.update([name]))
    for step in range(2):
        ps.mlp_loss(ctx, model, step).backward()
        counts = {k: len(v) for k, v in fired.items()}
        ctx.record_check(f"step {step}: activation hook fired once per forward, parameter hook once",
                         counts == {"activations": len(ctx.participants()), "parameters": 1})
        ctx.record_check(f"step {step}: every parameter's post-accumulate-grad hook fired once",
                         dict(accumulated) == {n: 1 for n, _ in model.named_parameters()})
        accumulated.clear()
        for kind, values in fired.items():
            ctx.checkpoints.append((f"step {step}: {kind} hook gradient sums",
                                    {"sums": _mean_over_ranks(ctx, torch.stack(values).sum(0))}))
            values.clear()
        _step(ctx, model, opt, f"step {step}")


# --- FSDP2: test_fully_shard_training.py ---------------------------------------------

def fsdp_multi_forward_module(ctx: Context) -> None:
    """FSDP2 test_multi_forward_module: a unit that runs twice in one forward."""
    model = MultiForward()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units={Inner})
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_two_forwards_one_backward_checkpointed(ctx: Context) -> None:
    """FSDP2 test_double_forward_with_nested_fsdp_and_checkpoint (DPO): two forwards, one loss over both; checkpointed blocks (non-reentrant, reentrant, none)."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: one unit per block
    for step, mode in enumerate(("non-reentrant", "reentrant", None)):
        loss = 0.0
        for r, w in ctx.participants():
            chosen, rejected = _tokens(step, r, ctx.world, salt=0), _tokens(step, r, ctx.world, salt=1)
            ce1 = _lm(model(chosen[:, :-1], checkpointing=mode), chosen)
            ce2 = _lm(model(rejected[:, :-1], checkpointing=mode), rejected)
            loss = loss + w * ((ce1 - ce2).square() + ce1)
        loss.backward()
        _step(ctx, model, opt, f"step {step} ({mode})")


def fsdp_double_partial_forward_then_backward(ctx: Context) -> None:
    """FSDP2 test_double_partial_forward_then_backward: two forwards that skip the head (a unit), one backward; the head's gradient stays None."""
    model = ChunkedHead()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        loss = 0.0
        for r, w in ctx.participants():
            if step == 0:
                h1 = model(_tokens(step, r, ctx.world, salt=0)[:, :-1], skip_head=True)
                h2 = model(_tokens(step, r, ctx.world, salt=1)[:, :-1], skip_head=True)
                loss = loss + w * (h1.tanh().sum() + h2.square().mean())
            else:
                tokens = _tokens(step, r, ctx.world)
                loss = loss + w * _lm(model(tokens[:, :-1]), tokens)
        loss.backward()
        _step(ctx, model, opt, f"step {step}")


def _chunked_head_backward(ctx: Context, model: nn.Module, step: int, salt: int, record: bool,
                           quiet: Optional[bool] = None, chunks: int = 2) -> None:
    """FSDP2's chunked-loss loop: forward without the head, then per chunk of
    the detached hidden states the head called by itself (the root does not
    take part) and a backward each, then h.backward(cat(chunk grads)).
    `quiet`: check that every backward issues no gradient collective (True) or some (False)."""
    def backward(loss: torch.Tensor, label: str) -> None:
        if quiet is None:
            loss.backward()
        else:
            _backward_counting(ctx, model, loss, label, expect_quiet=quiet)

    hidden = {}
    for r, w in ctx.participants():
        tokens = _tokens(step, r, ctx.world, salt=salt)
        hidden[r] = (w, tokens, model(tokens[:, :-1], skip_head=True), [])
    for k in range(chunks):
        loss = 0.0
        for r, (w, tokens, h, chunk_grads) in hidden.items():
            chunk = h.detach().chunk(chunks, dim=1)[k].contiguous().requires_grad_(True)
            start = sum(c.shape[1] for c in h.chunk(chunks, dim=1)[:k])
            target = tokens[:, 1:][:, start:start + chunk.shape[1]]
            logits = model.head(chunk)
            loss = loss + w * F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (BATCH * SEQ)
            chunk_grads.append(chunk)
        backward(loss, f"step {step} micro-batch {salt} chunk {k}")
        if record:
            ctx.record_grads(f"step {step} after chunk {k}", model)
    outs = [h for (w, tokens, h, chunk_grads) in hidden.values()]
    grads = [torch.cat([c.grad for c in chunk_grads], dim=1) for (w, tokens, h, chunk_grads) in hidden.values()]
    if quiet is None:
        torch.autograd.backward(outs, grads)
    else:
        before = None if ctx.reference else model._zero_ext.handles.diagnostics.stats()["collectives"]
        torch.autograd.backward(outs, grads)
        issued = 0 if ctx.reference else model._zero_ext.handles.diagnostics.stats()["collectives"] - before
        ctx.record_check(f"step {step} micro-batch {salt} h.backward: "
                         f"{'no' if quiet else 'some'} gradient collective",
                         ctx.reference or (issued == 0 if quiet else issued > 0 or ctx.world == 1))


def fsdp_chunked_head_loss_standalone_head(ctx: Context) -> None:
    """FSDP2 test_partial_group_forward_then_standalone (root not participating): the head called by itself per chunk, a backward each, then h.backward(cat(chunk grads))."""
    model = ChunkedHead()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        _chunked_head_backward(ctx, model, step, salt=0, record=True)
        _step(ctx, model, opt, f"step {step}")


def fsdp_chunked_head_loss_grad_accumulation(ctx: Context) -> None:
    """FSDP2 test_partial_group_forward_grad_accum_chunked: the chunked-head loop over 3 micro-batches, the first two under no_sync()."""
    model = ChunkedHead()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(2):
        for micro in range(3):
            with ctx.no_sync(model) if micro < 2 else contextlib.nullcontext():
                _chunked_head_backward(ctx, model, step, salt=micro, record=False, quiet=micro < 2)
        _step(ctx, model, opt, f"step {step}")


def fsdp_non_root_forward_backward(ctx: Context) -> None:
    """FSDP2 test_non_root_forward_backward: a step through the root, then a step through model[0] alone."""
    model = MLPStack(n=3, seed=22)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units={MLP})
    for step in range(2):
        sum(w * (model(_rows(step, r, ctx.world)) if step == 0 else model[0](_rows(step, r, ctx.world))).sum()
            for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")
    with torch.no_grad():
        ctx.record_value(f"no_grad loss on rank {ctx.rank}'s rows", model(_rows(9, ctx.rank, ctx.world)).sum())


def fsdp_root_without_forward_inputs(ctx: Context) -> None:
    """FSDP2 test_root_no_forward_inputs: forward() takes no arguments; the loss weights its output per rank."""
    model = ParamOnly()
    model, opt = _wrap(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in range(3):
        sum(w * (model() * torch.randn(D, D, generator=_seeded(60 + 10 * step + r))).sum()
            for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")


def fsdp_optimizer_step_hooks(ctx: Context) -> None:
    """FSDP2 test_post_optim_event (optimizer.register_step_post_hook): pre- and post-step hooks on the returned optimizer fire once per step and see the old and new values."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, torch.optim.AdamW(model.parameters(), lr=0.01))
    calls = {"pre": 0, "post": 0}
    full = contextlib.nullcontext if ctx.reference else (lambda: zero_ext.full_params(model))

    def norm_of_parameters() -> torch.Tensor:
        with torch.no_grad(), full():
            return torch.stack([p.norm() for p in model.parameters()]).norm()

    def hook(kind):
        def fn(optimizer, args, kwargs):
            calls[kind] += 1
            ctx.record_value(f"{kind}-step hook call {calls[kind]}: norm of the parameters", norm_of_parameters())
        return fn

    opt.register_step_pre_hook(hook("pre"))
    opt.register_step_post_hook(hook("post"))
    for step in range(3):
        ps.token_loss(ctx, model, step).backward()
        _step(ctx, model, opt, f"step {step}")
    ctx.record_check("each hook fired once per step", calls == {"pre": 3, "post": 3})


def fsdp_tied_embedding_uneven_vocab(ctx: Context) -> None:
    """FSDP2 test_train_shared_params_uneven_shard: tied embedding/output with a vocabulary that does not divide by the world size; every row trains."""
    vocab = 4 * ctx.world + 1
    model = TiedEmbedOutput(vocab)
    initial = model.tok_embeddings.weight.detach().clone()
    model, opt = _wrap(ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        sum(w * _lm(model(ids[:, :-1]), ids) for r, w in ctx.participants()
            for ids in [_tokens(step, r, ctx.world, vocab=vocab)]).backward()
        _step(ctx, model, opt, f"step {step}")
    final = model.tok_embeddings.weight if ctx.reference else zero_ext.full_state_dict(model)["tok_embeddings.weight"]
    ctx.record_check("every row of the tied weight changed", all(
        not torch.equal(initial[row], final[row]) for row in range(vocab)))


def fsdp_train_parity_with_shared_params_checkpointed(ctx: Context) -> None:
    """FSDP2 test_train_parity_with_shared_params: tied embedding/head with checkpointed blocks; zero_grad(set_to_none) alternating."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))
    for step in range(3):
        ps.token_loss(ctx, model, step, checkpointing="non-reentrant").backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_grad_accumulation_with_and_without_sync(ctx: Context) -> None:
    """FSDP2 test_gradient_accumulation: 3 micro-batches, the first two without sync (no_sync(), then DDP's require_backward_grad_sync), then all synced; zero_grad(set_to_none) alternating."""
    model = MLPStack(n=3, lead_linear=True, seed=23)
    model, opt = _wrap(ctx, model, _adam(model.parameters()))  # stage 3: one unit per MLP, the root holds the Linear
    for step in range(3):
        for micro in range(3):
            last = micro == 2
            unsynced = micro < 2 and step < 2
            if step == 1 and not ctx.reference:
                model.require_backward_grad_sync = last
            loss = sum(w * model(_rows(step, r, ctx.world, salt=micro)).sum() for r, w in ctx.participants())
            with ctx.no_sync(model) if step == 0 and not last else contextlib.nullcontext():
                _backward_counting(ctx, model, loss, f"step {step} micro {micro}", expect_quiet=unsynced)
        ctx.record_check(f"step {step}: require_backward_grad_sync reads True",
                         ctx.reference or model.require_backward_grad_sync)
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 1)


def fsdp_forwards_first_then_backwards(ctx: Context) -> None:
    """FSDP2 test_1f1b_microbatching (several forwards before backward): three micro-batch forwards, then their backward calls, the first two under no_sync."""
    model = ps.Blocks()
    model, opt = _wrap(ctx, model, _adam(model.parameters()))
    for step in range(2):
        losses = [sum(w * _lm(model(t[:, :-1]), t) for r, w in ctx.participants()
                      for t in [_tokens(step, r, ctx.world, salt=micro)]) for micro in range(3)]
        with ctx.no_sync(model):
            _backward_counting(ctx, model, losses[0], f"step {step} first", expect_quiet=True)
            _backward_counting(ctx, model, losses[1], f"step {step} second", expect_quiet=True)
        _backward_counting(ctx, model, losses[2], f"step {step} third", expect_quiet=False)
        _step(ctx, model, opt, f"step {step}")


def fsdp_bf16_grad_accumulation_no_sync(ctx: Context) -> None:
    """FSDP2 test_grad_acc_with_reduce_dtype: bf16 compute, fp32 reduction, accumulation over no_sync micro-batches."""
    def loss(model, step, micro, r):
        return F.mse_loss(model(_rows(step, r, ctx.world, salt=micro).to(torch.bfloat16)).float(),
                          _rows(step, r, ctx.world, salt=10 + micro))
    _bf16_training(ctx, MLPStack(n=2, seed=24), loss, steps=2, micros=3, synced_from=2,
                   optimizer_params=lambda m: m.parameters())


# --- FSDP2: test_fully_shard_frozen.py -------------------------------------------------

def fsdp_biases_only_trainable_checkpointed(ctx: Context) -> None:
    """FSDP2 test_train_mixed_requires_grad_per_group (BitFit): frozen weights and trainable biases in one unit, with and without checkpointing."""
    model = MLPStack(n=3, seed=25)
    for name, p in model.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)
    model, opt = _wrap(ctx, model, _adam(model.parameters()))
    for step in range(4):
        model.checkpointing = step % 2 == 1
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _released(ctx, model, f"step {step}")
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_frozen_linears_across_units_with_no_grad_step(ctx: Context) -> None:
    """FSDP2 test_train_mixed_requires_grad_across_groups: frozen and trainable Linear units interleaved, and a torch.no_grad() forward between training steps."""
    model = _init(nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(D, D), nn.Tanh()))), 26)
    for i in range(0, 12, 4):
        model[i].requires_grad_(False)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                ctx.record_value(f"no_grad loss on rank {ctx.rank}'s rows",
                                 model(_rows(step, ctx.rank, ctx.world)).sum())
            continue
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


def fsdp_multi_forward_mixed_requires_grad(ctx: Context) -> None:
    """FSDP2 test_multi_forward_mixed_requires_grad: a frozen and a trainable unit run three times per forward, the trainable one under no_grad too."""
    model = MultiForwardMixed()
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    for step in range(3):
        sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}", set_to_none=step % 2 == 0)


class RaisesWhenAsked(nn.Module):
    """A block whose forward raises while `fail` is set, after its Linear ran:
    on every rank alike, as an out-of-memory error on the same batch would."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if self.fail:
            raise RuntimeError("injected out of memory")
        return y


def fsdp_reset_after_an_exception_on_every_rank(ctx: Context) -> None:
    """FSDP2 test_reset_iter_state_after_exception, and accelerate's find_executable_batch_size: a forward raises on every rank at the same point (inside the middle unit, after the first gathers and prefetches), twice in a row, is caught, and training goes on exactly."""
    model = _init(nn.Sequential(nn.Linear(D, D), RaisesWhenAsked(), nn.Linear(D, D), nn.Linear(D, D)), 61)
    model, opt = _wrap(ctx, model, _adam(model.parameters()), units=_is_linear)
    raiser = model[1]
    for step in range(3):
        if step == 1:
            raiser.fail = True
            for attempt in range(2):
                try:
                    sum(w * model(_rows(step, r, ctx.world)).sum() for r, w in ctx.participants())
                    raised = False
                except RuntimeError as e:
                    raised = "injected out of memory" in str(e)
                ctx.record_check(f"step {step}: attempt {attempt} raised the injected error", raised)
            raiser.fail = False
        sum(w * model(_rows(step, r, ctx.world)).square().sum() for r, w in ctx.participants()).backward()
        _step(ctx, model, opt, f"step {step}")
    with torch.no_grad():  # and an evaluation forward that raises, then one that does not
        raiser.fail = True
        try:
            model(_rows(9, ctx.rank, ctx.world))
        except RuntimeError:
            pass
        raiser.fail = False
        ctx.record_value("evaluation after a raised one", _mean_over_ranks(
            ctx, sum(w * model(_rows(9, r, ctx.world)).sum() for r, w in ctx.participants())))
