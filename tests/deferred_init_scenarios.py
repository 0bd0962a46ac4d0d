"""Rank-side half of tests/test_deferred_init.py: a model built under
zero_ext.empty_init() (or torch.device("meta")) and materialized by wrap()
in every stage, with bf16 and offload, against the same model constructed
normally from the same seed; the bytes a rank holds while wrap() initializes
it."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

import zero_ext
from parity_scenarios import VOCAB, InitBlock, InitBlocks

CONFIGS = [(stage, precision, offload) for stage in (0, 1, 2, 3)
           for precision, offload in ((None, False), ("bf16", False), ("bf16", True))]
BUILDS = ["empty_init", "meta_device", "frozen_block"]
SEED = 5


def build(kind: str) -> InitBlocks:
    model = InitBlocks()
    if kind == "frozen_block":
        model.blocks[1].requires_grad_(False)  # stages 0-2 keep it outside the buckets
    return model


def deferred(kind: str) -> InitBlocks:
    if kind == "meta_device":
        with torch.device("meta"):
            return build(kind)
    with zero_ext.empty_init():
        return build(kind)


def unit_of(name: str) -> int:
    return int(name.split(".")[1]) + 1 if name.startswith("blocks.") else 0


class BytesAtEachInit:
    """A param_init_fn that runs the module's own reset_parameters() (the
    default's values) and records, at each call, the bytes of the full
    buffers the model's parameters view (closed stage 3 units view
    unreadable storages of no memory, never resizable)."""

    def __init__(self, model: nn.Module):
        self.params = list(model.parameters())
        self.seen: List[int] = []

    def __call__(self, module: nn.Module) -> None:
        storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in self.params
                    if p.untyped_storage().resizable()}
        self.seen.append(sum(storages.values()))
        if isinstance(module, InitBlocks):  # only its buffer is meta (built under torch.device("meta"))
            module.scale.copy_(InitBlocks.SCALE)
        else:
            module.reset_parameters()


def check_values_and_bytes(rank: int, world: int) -> Dict[str, Optional[str]]:
    """Per configuration and build: None, or what went wrong."""
    torch.manual_seed(SEED)
    reference = build("empty_init")
    want = reference.state_dict()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    expected_out = reference(tokens)
    results: Dict[str, Optional[str]] = {}
    for stage, precision, offload in CONFIGS:
        for kind in BUILDS:
            label = f"stage{stage}-{precision or 'fp32'}{'-offload' if offload else ''}-{kind}"
            problems: List[str] = []
            try:
                model = deferred(kind)
                if not all(p.is_meta for p in model.parameters()):
                    problems.append("built with real parameters")
                if model.scale.is_meta != (kind == "meta_device"):
                    problems.append("the buffer is not as built")
                opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=0.01)
                recorder = BytesAtEachInit(model)
                torch.manual_seed(SEED)
                model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.0005,
                                           offload_optimizer="cpu" if offload else None, timeout=20,
                                           units={InitBlock} if stage == 3 else None, param_init_fn=recorder)
                full = zero_ext.full_state_dict(model)
                problems += [f"{n} differs" for n, v in want.items() if not torch.equal(full[n].float(), v)]
                leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
                if leftovers:
                    problems.append(f"still on meta: {leftovers}")
                if precision is None and not torch.equal(model(tokens), expected_out):
                    problems.append("forward differs from the normally built model's")
                if stage == 3:
                    problems += _stage3_bytes(model, recorder)
                if model._zero_ext.handles.diagnostics.stats()["materializing_bytes"]:
                    problems.append("temporary full buffers outlive wrap()")
            except Exception as error:  # noqa: BLE001 - reported per label
                problems.append(f"{type(error).__name__}: {error}")
            results[label] = "; ".join(problems) or None
    return results


def _stage3_bytes(model, recorder: BytesAtEachInit) -> List[str]:
    """Stage 3 holds whole, at every initializer call, at most the root unit
    and one other unit (in fp32, the parameters' own dtype while they are
    initialized) besides its shards; and it does hold them."""
    state = model._zero_ext
    layout = state.handles.reduction.bucket_layout()  # (first, count, padded) per bucket
    unit_bytes: Dict[int, int] = {}
    for b in range(len(layout) // 3):
        first, padded = layout[3 * b], layout[3 * b + 2]
        unit = unit_of(state.bucketed_names[first])
        unit_bytes[unit] = unit_bytes.get(unit, 0) + 4 * padded
    bound = unit_bytes[0] + max(v for u, v in unit_bytes.items() if u != 0)
    problems = []
    if len(recorder.seen) < 10:
        problems.append(f"recorded {len(recorder.seen)} initializer calls")
    if max(recorder.seen) > bound:
        problems.append(f"held {max(recorder.seen)} bytes whole during wrap, bound {bound} (units {unit_bytes})")
    if max(recorder.seen) < unit_bytes[0] + min(unit_bytes.values()):
        problems.append(f"held at most {max(recorder.seen)} bytes whole: the root and a unit never were")
    return problems


def init_fails_on_one_rank(rank: int, world: int) -> str:
    """Rank 1's initializer raises in the second block: every rank raises,
    naming it, none hangs in a broadcast."""
    with zero_ext.empty_init():
        model = InitBlocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    target = model.blocks[1].ff

    def init(module: nn.Module) -> None:
        if module is target and rank == 1:
            raise ValueError("no weights for this layer")
        module.reset_parameters()

    try:
        zero_ext.wrap(model, opt, stage=3, bucket_mb=0.0005, units={InitBlock}, timeout=20, param_init_fn=init)
    except ValueError as error:
        return str(error)
    return "no error"


def load_after_deferred_init(rank: int, world: int, path: str) -> Optional[str]:
    """The pretrained flow: build under empty_init, wrap at stage 3 with no
    initialization (param_init_fn does nothing), stream the weights in."""
    with zero_ext.empty_init():
        model = InitBlocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=0.0005, units={InitBlock}, timeout=20,
                               param_init_fn=lambda module: None)
    zero_ext.load_weights(model, path)
    torch.manual_seed(SEED)
    want = InitBlocks().state_dict()
    full = zero_ext.full_state_dict(model)
    bad = [n for n, v in want.items() if not torch.equal(full[n], v)]
    return f"{bad} differ" if bad else None


def skip_init_then_load(rank: int, world: int, path: str) -> Dict[str, Optional[str]]:
    """zero_ext.skip_init in every configuration: no unit is opened or
    broadcast (on more than one rank: fewer collectives than a no-op
    initializer, by at least one per bucket), every weight is NaN until loaded (a forgotten load gives a
    NaN output, not a silently zero model), and load_weights then gives the
    weights exactly."""
    torch.manual_seed(SEED)
    reference = InitBlocks()
    want = reference.state_dict()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    results: Dict[str, Optional[str]] = {}
    for stage, precision, offload in CONFIGS:
        label = f"stage{stage}-{precision or 'fp32'}{'-offload' if offload else ''}"
        problems: List[str] = []
        try:
            collectives = {}
            for init in ("skip", "noop"):
                with zero_ext.empty_init():
                    model = InitBlocks()
                opt = torch.optim.AdamW(model.parameters(), lr=0.01)
                model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.0005,
                                           offload_optimizer="cpu" if offload else None, timeout=20,
                                           units={InitBlock} if stage == 3 else None,
                                           param_init_fn=zero_ext.skip_init if init == "skip" else lambda m: None)
                collectives[init] = model._zero_ext.handles.diagnostics.stats()["collectives"]
                if init == "noop":
                    continue
                buckets = model._zero_ext.handles.diagnostics.stats()["buckets"]
                full = zero_ext.full_state_dict(model)
                not_nan = [n for n in want if n != "scale" and not torch.isnan(full[n]).all()]
                if not_nan:
                    problems.append(f"{not_nan} hold values before any load")
                if precision is None and not torch.isnan(model(tokens)).all():
                    problems.append("a model never loaded computes numbers")
                zero_ext.load_weights(model, path)
                full = zero_ext.full_state_dict(model)
                problems += [f"{n} differs after loading" for n, v in want.items() if not torch.equal(full[n].float(), v)]
                if precision is None and not torch.equal(model(tokens), reference(tokens)):
                    problems.append("forward differs after loading")
            if world > 1 and collectives["skip"] > collectives["noop"] - buckets:
                problems.append(f"skip_init issued {collectives['skip']} collectives, a no-op initializer "
                                f"{collectives['noop']} ({buckets} buckets)")
        except Exception as error:  # noqa: BLE001 - reported per label
            problems.append(f"{type(error).__name__}: {error}")
        results[label] = "; ".join(problems) or None
    return results


# --- transformers models: the initialization normal construction runs ------------
PRETRAINED_CONFIGS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in (None, "bf16")]


def llama_config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=tied)


class WholeBytesAtInit:
    """Wraps the _init_weights of every PreTrainedModel in the model (the
    root and its LlamaModel, which initializes the layers) and records, at
    each call into the parameters themselves (not wrap()'s first pass over
    scratch tensors, when they are still on meta), the bytes of the full
    buffers they view: closed stage 3 units view storages of no memory."""

    def __init__(self, model: nn.Module):
        from transformers import PreTrainedModel

        self.params = list(model.parameters())
        self.seen: List[int] = []
        for module in model.modules():
            if isinstance(module, PreTrainedModel):
                module._init_weights = self._recording(module._init_weights)

    def _recording(self, init_weights):
        def recorded(module: nn.Module) -> None:
            live = [p for p in self.params if not p.is_meta]
            if live:
                storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in live
                            if p.untyped_storage().resizable()}
                self.seen.append(sum(storages.values()))
            init_weights(module)
        return recorded


def _llama_unit(name: str) -> int:
    return int(name.split(".")[2]) + 1 if name.startswith("model.layers.") else 0


def _stage3_llama_bytes(model, recorder: WholeBytesAtInit) -> List[str]:
    """At every _init_weights call at most the root unit and one layer are whole."""
    state = model._zero_ext
    layout = state.handles.reduction.bucket_layout()  # (first, count, padded) per bucket
    unit_bytes: Dict[int, int] = {}
    for b in range(len(layout) // 3):
        unit = _llama_unit(state.bucketed_names[layout[3 * b]])
        unit_bytes[unit] = unit_bytes.get(unit, 0) + 4 * layout[3 * b + 2]
    bound = unit_bytes[0] + max(v for u, v in unit_bytes.items() if u != 0)
    if len(recorder.seen) < 20:
        return [f"recorded {len(recorder.seen)} _init_weights calls into the parameters"]
    if max(recorder.seen) > bound:
        return [f"held {max(recorder.seen)} bytes whole during wrap, bound {bound} (units {unit_bytes})"]
    return []


def _train(model, optimizer, ids, steps: int = 2) -> List[float]:
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def pretrained_values(rank: int, world: int) -> Dict[str, Optional[str]]:
    """A transformers Llama (tied embeddings or not) built under empty_init
    with no param_init_fn, wrapped in every stage: its values are those of the
    same model built normally from the same seed (construction's
    reset_parameters, then post_init's _init_weights, children first), the
    random stream is left where construction leaves it, it trains as the
    normally built model trains (every rank the same batch), and stage 3 holds
    at most the root and one layer whole."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    results: Dict[str, Optional[str]] = {}
    for tied in (False, True):
        config = llama_config(tied)
        torch.manual_seed(SEED)
        reference = AutoModelForCausalLM.from_config(config)
        stream_after = torch.get_rng_state()
        want = {n: v.detach().clone() for n, v in reference.state_dict().items()}
        trained = copy.deepcopy(reference)
        _train(trained, torch.optim.AdamW(trained.parameters(), lr=1e-2), ids)
        want_trained = trained.state_dict()
        for stage, precision in PRETRAINED_CONFIGS:
            label = f"llama{'-tied' if tied else ''}-stage{stage}-{precision or 'fp32'}"
            problems: List[str] = []
            try:
                with zero_ext.empty_init():
                    model = AutoModelForCausalLM.from_config(config)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                recorder = WholeBytesAtInit(model) if stage == 3 else None
                torch.manual_seed(SEED)
                model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.0005,
                                           units={LlamaDecoderLayer} if stage == 3 else None, timeout=20)
                if not torch.equal(torch.get_rng_state(), stream_after):
                    problems.append("the random stream after wrap() is not where normal construction leaves it")
                full = zero_ext.full_state_dict(model)
                problems += [f"{n} differs" for n, v in want.items() if not torch.equal(full[n].float(), v)]
                if recorder is not None:
                    problems += _stage3_llama_bytes(model, recorder)
                losses = _train(model, opt, ids)
                if precision is None:
                    full = zero_ext.full_state_dict(model)
                    problems += [f"{n} differs after training by {(full[n] - v).abs().max():.2e}"
                                 for n, v in want_trained.items() if not torch.allclose(full[n], v, 1e-5, 1e-6)]
                elif not losses[1] < losses[0]:
                    problems.append(f"bf16 training does not learn: losses {losses}")
            except Exception as error:  # noqa: BLE001 - reported per label
                problems.append(f"{type(error).__name__}: {error}")
            results[label] = "; ".join(problems) or None
    return results


def gpt2_statistics(rank: int, world: int) -> Optional[str]:
    """GPT-2 built under empty_init, wrapped at stage 3 with no param_init_fn.
    Its Conv1D draws in __init__ (no reset_parameters to replay), so post_init
    draws from another point of the random stream: the values differ from a
    normally built model's, but every tensor has its distribution (constants
    equal, std within 10%, mean near 0), including the attention and MLP
    c_proj's 1/sqrt(2 * n_layer) scaling that GPT2Attention's _init_weights
    applies after its c_proj's own; and it trains."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(SEED)
    want = GPT2LMHeadModel(config).state_dict()
    with zero_ext.empty_init():
        model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(SEED)
    model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=0.0005, timeout=20)
    full = zero_ext.full_state_dict(model)
    problems = []
    for name, value in want.items():
        got = full[name].float()
        value = value.float()
        if value.numel() and bool(value.min() == value.max()):
            if not torch.equal(got, value):
                problems.append(f"{name}: not the constant {value.flatten()[0].item()}")
            continue
        ratio = got.std().item() / value.std().item()
        if not 0.9 < ratio < 1.1 or abs(got.mean().item()) > 5 * value.std().item() / value.numel() ** 0.5:
            problems.append(f"{name}: std {got.std().item():.4f} (normally {value.std().item():.4f}), "
                            f"mean {got.mean().item():.4f}")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = _train(model, opt, ids, steps=3)
    if not losses[2] < losses[0]:
        problems.append(f"does not learn: losses {losses}")
    return "; ".join(problems) or None
