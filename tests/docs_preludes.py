"""The preludes of the docs' `# given:` fragments (tests/test_docs_examples.py):
keyed by the page and the fragment's `# given:` line, each defines the names
the fragment is given (small models, few steps) before it, after COMMON's
helpers, and checks what it did after it, under torchrun or in one plain
process as it says."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prelude:
    setup: str  # defines the `# given:` names (after COMMON)
    check: str  # runs after the fragment: asserts, and rank 0 prints `expect`
    expect: tuple  # lines (or parts of lines) the run's stdout must hold
    ranks: int = 2  # under torchrun; 1: one plain process, torch.distributed not initialized
    each_statement: bool = False  # the fragment lists choices: setup, one statement, check, for each


COMMON = '''
import os
import torch
import torch.distributed as dist
import zero_ext

if "LOCAL_WORLD_SIZE" in os.environ:  # under torchrun
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0
world = dist.get_world_size() if dist.is_initialized() else 1
torch.manual_seed(0)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def say(*what):
    """A line of rank 0's, which the test looks for."""
    if rank == 0:
        print(*what, flush=True)


def assert_same(weights, reference, rtol=1e-5, atol=1e-6):
    """Every tensor of reference's state_dict (a module, or a dict) in `weights`, the same."""
    expected = reference if isinstance(reference, dict) else reference.state_dict()
    assert set(weights) == set(expected), (sorted(weights), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(weights[name].float(), value.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return len(expected)


def rank_batches(r, steps, per_rank=4, dim=8, out=4):
    """Rank r's (x, y) batches: the global batch of a step is every rank's, in rank order."""
    g = torch.Generator().manual_seed(1000 + r)
    return [(torch.randn(per_rank, dim, generator=g), torch.randn(per_rank, out, generator=g)) for _ in range(steps)]


def global_batch(step, steps, **shape):
    xs, ys = zip(*(rank_batches(r, steps, **shape)[step] for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
'''

# A step of the wrapped model on this rank's batch, and of a one-process reference on the global batch.
_TRAIN_BOTH = '''
def train_both(model, optimizer, reference, ref_opt, steps=2, clip=None):
    loss_fn = torch.nn.MSELoss()
    for step, (x, y) in enumerate(rank_batches(rank, steps)):
        loss_fn(model(x), y).backward()
        if clip:
            optimizer.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad()
        gx, gy = global_batch(step, steps)
        loss_fn(reference(gx), gy).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
'''

_TRAIN = Prelude(
    setup='''
import copy
model = small_model()
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.MSELoss()
loader = rank_batches(rank, steps=3)  # this rank's (batch, target) pairs
''',
    check='''
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(3):
    x, y = global_batch(step, 3)
    loss_fn(reference(x), y).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_opt.step()
    ref_opt.zero_grad()
say("the same as one process:", assert_same(zero_ext.full_state_dict(model), reference), "tensors")
''',
    expect=("the same as one process: 4 tensors",))

_SAVE_LOAD = Prelude(
    ranks=1,
    setup='''
model = small_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
model, optimizer = zero_ext.wrap(model, optimizer, stage=2)
for x, y in rank_batches(rank, steps=2):
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    sched.step()
sgd_model = small_model()
sgd_model, sgd = zero_ext.wrap(sgd_model, torch.optim.SGD(sgd_model.parameters(), lr=0.1), stage=2)
''',
    check='''
assert extra["sched"] == sched.state_dict() and torch.equal(extra["rng"], torch.get_rng_state()), extra
assert not sgd.state, "the SGD starts fresh"
n = assert_same(zero_ext.full_state_dict(sgd_model), zero_ext.full_state_dict(model), rtol=0, atol=0)
say(f"loaded: the scheduler at step {extra['sched']['last_epoch']}, {n} tensors the same in the SGD job")
''',
    expect=("loaded: the scheduler at step 2, 4 tensors the same in the SGD job",))

_DCP = Prelude(
    setup='''
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.h = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        return self.head(self.h(self.wte(tokens)))


def build():
    torch.manual_seed(0)
    return GPT()


def train(m, opt, steps):
    for step in range(steps):
        tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        m(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()


def full(m):  # FSDP2's model, whole
    return {k: v.full_tensor() for k, v in get_model_state_dict(m).items()}


model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
model, optimizer = zero_ext.wrap(model, optimizer, stage=3)
train(model, optimizer, 1)
sched.step()
written_by_zero_ext = zero_ext.full_state_dict(model)

fsdp_model = build()
fully_shard(fsdp_model)
fsdp_optimizer = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-2)
train(fsdp_model, fsdp_optimizer, 2)
msd, osd = get_state_dict(fsdp_model, fsdp_optimizer)
dcp.save({"model": msd, "optim": osd}, checkpoint_id="ckpt/fsdp2-step1000")  # FSDP2's own checkpoint
written_by_fsdp2 = full(fsdp_model)
plain_model = build()  # a plain process's model, not wrapped
''',
    check='''
n = assert_same(zero_ext.full_state_dict(model), written_by_fsdp2)   # zero_ext read FSDP2's checkpoint
assert_same(full(fsdp_model), written_by_zero_ext)                    # FSDP2 read zero_ext's
assert len(fsdp_optimizer.state) == len(list(fsdp_model.parameters())), "FSDP2's AdamW state loaded"
assert_same(plain_model.state_dict(), written_by_zero_ext)            # and one plain process
titan = zero_ext.load("ckpt/titan/step-1000", model, optimizer)      # the torchtitan layout reads back
assert titan["train_state"] == {"step": 1000} and titan["lr_scheduler"] == sched.state_dict(), titan
say(f"FSDP2, one plain process and zero_ext read what was written: {n} tensors")
''',
    expect=("FSDP2, one plain process and zero_ext read what was written: 7 tensors",))

_COMPILE = Prelude(
    setup=_TRAIN_BOTH + '''
import copy
from torch._dynamo.utils import counters
model = small_model()
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
''',
    check='''
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
train_both(compiled, optimizer, reference, ref_opt)
assert not counters["graph_break"], dict(counters["graph_break"])
say("compiled, no graph break, the same as one process:",
    assert_same(zero_ext.full_state_dict(model), reference, rtol=1e-4, atol=1e-5), "tensors")
''',
    expect=("compiled, no graph break, the same as one process: 4 tensors",))

# The whole train step compiled with compiled autograd: the snippet defines
# train_step; three steps of it, each followed by the optimizer's step.
_COMPILED_AUTOGRAD = Prelude(
    setup='''
import copy
model = small_model()
reference = copy.deepcopy(model)
model, optimizer = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
loss_fn = torch.nn.MSELoss()
''',
    check='''
from torch._dynamo.utils import counters
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for step, (x, y) in enumerate(rank_batches(rank, 3)):
    train_step(x, y)
    optimizer.step()
    optimizer.zero_grad()
    gx, gy = global_batch(step, 3)
    loss_fn(reference(gx), gy).backward()
    ref_opt.step()
    ref_opt.zero_grad()
assert counters["compiled_autograd"]["captures"] == 1, dict(counters["compiled_autograd"])
say("compiled autograd, the same as one process:",
    assert_same(zero_ext.full_state_dict(model), reference, rtol=1e-4, atol=1e-5), "tensors")
''',
    expect=("compiled autograd, the same as one process: 4 tensors",))

_ASYNC = Prelude(
    setup='''
model = small_model()
model, optimizer = zero_ext.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3)
x, y = rank_batches(rank, steps=1)[0]
torch.nn.functional.mse_loss(model(x), y).backward()
optimizer.step()
optimizer.zero_grad()
at_the_call = zero_ext.full_state_dict(model)
''',
    check='''
assert handle.done()
torch.nn.functional.mse_loss(model(x), y).backward()  # training goes on: the weights move
optimizer.step()
optimizer.zero_grad()
zero_ext.load("ckpt/step1000", model, optimizer)
say("the state at the call, published:", assert_same(zero_ext.full_state_dict(model), at_the_call), "tensors")
''',
    expect=("the state at the call, published: 4 tensors",))

_RESUME = Prelude(
    ranks=1,
    setup='''
ckpt = "ckpt/last"
model = small_model()
model, optimizer = zero_ext.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2)
assert not zero_ext.checkpoint_exists(ckpt)
zero_ext.save(ckpt, model, optimizer, extra={"step": 41})
saved = zero_ext.full_state_dict(model)
x, y = rank_batches(rank, steps=1)[0]
torch.nn.functional.mse_loss(model(x), y).backward()
optimizer.step()  # moves on from the save: the load must bring it back
optimizer.zero_grad()
''',
    check='''
say(f"resumed at step {first_step}:", assert_same(zero_ext.full_state_dict(model), saved, rtol=0, atol=0), "tensors")
''',
    expect=("resumed at step 42: 4 tensors",))

_COMPRESSION = Prelude(
    setup='''
def wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 4))


model = wide_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
plain = wide_model()  # the same, wrapped without compression
plain, plain_opt = zero_ext.wrap(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), stage=3)
''',
    check='''
x, y = rank_batches(rank, steps=1)[0]
for m, opt in ((model, optimizer), (plain, plain_opt)):
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()
    opt.zero_grad()
sent, uncompressed = zero_ext.traffic(model), zero_ext.traffic(plain)
for kind in ("all_gather", "reduce_scatter"):  # int8 and its scales: about a quarter of fp32's bytes
    assert 0 < sent[kind] < 0.3 * uncompressed[kind], (kind, sent, uncompressed)
say("int8 sent under 0.3 of fp32's bytes: all_gather", round(sent["all_gather"] / uncompressed["all_gather"], 2),
    "reduce_scatter", round(sent["reduce_scatter"] / uncompressed["reduce_scatter"], 2))
''',
    expect=("{'all_gather': ", "int8 sent under 0.3 of fp32's bytes"))

_PRECISION_CHOICES = Prelude(
    ranks=1, each_statement=True,
    setup='''
model = small_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
''',
    check='''
x, y = rank_batches(rank, steps=1)[0]
before = {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}
torch.nn.functional.mse_loss(model(x).float(), y).backward()
opt.step()
opt.zero_grad()
after = zero_ext.full_state_dict(model)
assert all(after[k].dtype == torch.float32 and torch.isfinite(after[k]).all() for k in after), "fp32 masters"
assert any(not torch.equal(before[k], after[k]) for k in after), "the step moved the weights"
say("stepped:", next(model.parameters()).dtype, "compute, fp32 masters")
''',
    expect=("stepped: torch.bfloat16 compute", "stepped: torch.float16 compute"))

_ACCUMULATION = Prelude(
    setup='''
import copy
model = small_model()
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.MSELoss()
loader = [rank_batches(rank, steps=8)[4 * step:4 * step + 4] for step in range(2)]  # 2 steps of 4 micro-batches
''',
    check='''
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(2):
    for i in range(4):
        x, y = global_batch(4 * step + i, 8)
        (loss_fn(reference(x), y) / 4).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_opt.step()
    ref_opt.zero_grad()
n = assert_same(zero_ext.full_state_dict(model), reference, rtol=2e-2, atol=2e-3)  # bf16 compute
say(f"bf16, 4 micro-batches a step: one process's weights to bf16's precision, {n} tensors")
''',
    expect=("bf16, 4 micro-batches a step: one process's weights to bf16's precision, 4 tensors",))

_HYBRID = Prelude(
    setup=_TRAIN_BOTH + '''
import copy
model = small_model()
reference = copy.deepcopy(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
''',
    check='''
train_both(model, optimizer, reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), clip=1.0)
n = assert_same(zero_ext.full_state_dict(model), reference)
say(f"mesh {tuple(mesh.shape)} ({mesh.device_type}): the same as one process, {n} tensors")
''',
    expect=("mesh (1, 2) (cpu): the same as one process, 4 tensors",))

_TENSOR_PARALLEL = Prelude(
    setup='''
import copy
import sys
sys.path.insert(0, os.path.join(os.environ["ZERO_EXT_REPO"], "examples"))
from tensor_parallel import Llama  # blocks in model.layers: attention.wq/wk/wv/wo, feed_forward.w1/w2/w3

tp = 2
torch.manual_seed(0)
model = Llama(vocab=32, dim=32, layers=2, heads=4)
reference = copy.deepcopy(model)
''',
    check='''
tokens = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))  # dp 1: every rank's batch
ref_opt = torch.optim.AdamW(reference.parameters())
for m, opt in ((model, optimizer), (reference, ref_opt)):
    for step in range(2):
        logits = m(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
n = assert_same(zero_ext.full_state_dict(model), reference, atol=1e-4)
say(f"dp {mesh['dp'].size()} x tp {mesh['tp'].size()}: the same as one process, {n} tensors")
''',
    expect=("dp 1 x tp 2: the same as one process, 21 tensors",))

# docs/multi-node.md's pipeline: pp 2 x dp 2, this dp rank's half of each global batch (the mesh puts
# dp innermost: rank = pp * 2 + dp), checked against one process by the DCP checkpoint, read whole.
_PIPELINE = Prelude(
    setup='''
import sys
sys.path.insert(0, os.path.join(os.environ["ZERO_EXT_REPO"], "tests"))
from pipeline_scenarios import PipelinedLM, batch, loss_fn, reference
torch.manual_seed(0)
model = PipelinedLM()
batches = [tuple(t.chunk(2)[rank % 2] for t in batch(step)) for step in range(3)]
''',
    check='''
barrier()
if rank == 0:
    import torch.distributed.checkpoint as dcp
    whole = {k: torch.zeros_like(v) for k, v in PipelinedLM().state_dict().items()}
    dcp.load({"model": whole}, checkpoint_id="ckpt", no_dist=True)
    expected, _ = reference(3, torch.optim.AdamW, 1.0)
    n = assert_same(whole, expected)
    say(f"pp 2 x dp 2, 1F1B: the DCP checkpoint holds the whole model, the same as one process, {n} tensors")
''',
    expect=("pp 2 x dp 2, 1F1B: the DCP checkpoint holds the whole model, the same as one process, 12 tensors",),
    ranks=4)

_EXPERTS = Prelude(
    setup='''
import sys
sys.path.insert(0, os.path.join(os.environ["ZERO_EXT_REPO"], "examples"))
from moe_expert_parallel import MoELM, batch, expert_parallel
import torch.nn.functional as F
model = MoELM()
loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
per = 16 // world
batches = [tuple(t[rank * per:(rank + 1) * per] for t in batch(step, 16, 16, 64)) for step in range(3)]
''',
    check='''
barrier()
if rank == 0:
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    expected = MoELM()
    opt = torch.optim.AdamW(expected.parameters())
    for step in range(3):
        x, y = batch(step, 16, 16, 64)
        loss_fn(expected(x), y).backward()
        torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    whole = {k: torch.zeros_like(v) for k, v in expected.state_dict().items()}
    dcp.load({"model": whole}, checkpoint_id="ckpt", no_dist=True)
    n = assert_same(whole, expected)
    say(f"ep 2 x dp_mod_ep 2: the DCP checkpoint holds every expert whole, the same as one process, {n} tensors")
''',
    expect=("ep 2 x dp_mod_ep 2: the DCP checkpoint holds every expert whole, the same as one process, 13 tensors",),
    ranks=4)

_TINY_LLAMA = '''
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
'''

_DEFERRED = Prelude(  # one process: docs/huggingface.md's example runs the same flow on 2 ranks
    ranks=1,
    setup=_TINY_LLAMA + '''
if rank == 0:  # stands in for a downloaded model
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained("path/to/model")
barrier()
''',
    check='''
barrier()
if rank == 0:
    saved = AutoModelForCausalLM.from_pretrained("out")
    n = assert_same(saved.state_dict(), AutoModelForCausalLM.from_pretrained("path/to/model"), rtol=0, atol=0)
    say(f"from_pretrained('out') holds the loaded weights: {n} tensors")
''',
    expect=("from_pretrained('out') holds the loaded weights:",))

_FROM_CONFIG = Prelude(
    ranks=1,
    setup=_TINY_LLAMA,
    check='''
torch.manual_seed(0)  # the seed the fragment started from
built_whole = AutoModelForCausalLM.from_config(config)
n = assert_same(zero_ext.full_state_dict(model), built_whole, rtol=0, atol=0)
say(f"initialized as from_config with the same seed: {n} tensors")
''',
    expect=("initialized as from_config with the same seed:",))

_TRAINER = Prelude(
    setup=_TINY_LLAMA + '''
torch.manual_seed(0)
model = LlamaForCausalLM(config)
ds = [{"input_ids": ids, "labels": ids}  # 64 sequences: 1 step an epoch of 2 x 8 x 4
      for ids in torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))]
''',
    check='''
assert trainer.state.global_step == 3, trainer.state.global_step  # 3 epochs, the last checkpoint's step
assert os.path.isdir("out/checkpoint-3/zero_ext"), os.listdir("out")
say(f"trained and resumed: step {trainer.state.global_step}, out/checkpoint-3")
''',
    expect=("trained and resumed: step 3, out/checkpoint-3",))

_ACCELERATE = Prelude(
    setup=_TINY_LLAMA + '''
torch.manual_seed(0)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader([{"input_ids": i, "labels": i} for i in ids], batch_size=2)
''',
    check='''
from transformers import AutoModelForCausalLM
weights = zero_ext.full_state_dict(accelerator.unwrap_model(model))
accelerator.wait_for_everyone()
if rank == 0:
    saved = AutoModelForCausalLM.from_pretrained("out")
    n = assert_same(saved.state_dict(), weights, rtol=0, atol=0)
    assert scheduler.state_dict()["last_epoch"] > 0
    say(f"saved, loaded and written for from_pretrained: {n} tensors")
''',
    expect=("saved, loaded and written for from_pretrained:",))

_LIGHTNING = Prelude(
    setup='''
import lightning as L


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = small_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):  # 8 batches of 2 a rank: 2 steps an epoch of 4 accumulated
        x, y = global_batch(0, 1, per_rank=16)
        return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_epoch_end(self):
        self.trainer.should_stop = True  # one epoch a fit


module, new_module = Module(), Module()
path = "lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt"  # what the first fit writes
''',
    check='''
assert trainer.current_epoch == 2 and trainer.global_step == 4, (trainer.current_epoch, trainer.global_step)
assert trainer.lightning_module is new_module
say(f"fit, then resumed from {path}: epoch {trainer.current_epoch}, step {trainer.global_step}")
''',
    expect=("resumed from lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt: epoch 2, step 4",))

PRELUDES = {
    ("README.md", "# given: model, optimizer, loader, loss_fn"): _TRAIN,
    ("docs/stages-and-memory.md", "# given: model, optimizer, loader, loss_fn"): _TRAIN,
    ("docs/checkpoints.md",
     "# given: model, optimizer (AdamW), sched; sgd_model, sgd (the same model wrapped with SGD)"):
        _SAVE_LOAD,
    ("docs/checkpoints.md",
     "# given: model, optimizer, sched (zero_ext's); fsdp_model, fsdp_optimizer (FSDP2's); plain_model (not wrapped)"):
        _DCP,
    ("docs/checkpoints.md", "# given: model, optimizer"): _ASYNC,
    ("docs/torch-compile-and-profiling.md", "# given: model, optimizer"): _COMPILE,
    ("docs/torch-compile-and-profiling.md", "# given: model (wrapped), loss_fn"): _COMPILED_AUTOGRAD,
    ("docs/multi-node.md",
     "# given: model (the whole model: emb, layers in a ModuleDict by index, head), loss_fn, batches (this dp rank's), world"):
        _PIPELINE,
    ("docs/multi-node.md",
     "# given: model (a MoE LM; expert_parallel as examples/moe_expert_parallel.py's), loss_fn, batches (this rank's), world"):
        _EXPERTS,
    ("docs/checkpoints.md", "# given: ckpt (a path), model, optimizer"): _RESUME,
    ("docs/compression.md", "# given: model, optimizer"): _COMPRESSION,
    ("docs/mixed-precision-and-offload.md", "# given: model, opt; each line is one choice (a model is wrapped once)"):
        _PRECISION_CHOICES,
    ("docs/mixed-precision-and-offload.md", "# given: model, optimizer, loader (lists of micro-batches), loss_fn"):
        _ACCUMULATION,
    ("docs/multi-node.md", "# given: model, optimizer, world"): _HYBRID,
    ("docs/multi-node.md",
     "# given: model (blocks in model.layers, as examples/tensor_parallel.py's Llama), world, tp"):
        _TENSOR_PARALLEL,
    ("docs/stage3-units.md", "# given: path/to/model (a save_pretrained directory)"): _DEFERRED,
    ("docs/huggingface.md", "# given: config (a transformers config)"): _FROM_CONFIG,
    ("docs/integrations.md", "# given: model (a transformers model), ds (its dataset)"): _TRAINER,
    ("docs/integrations.md", "# given: model (a transformers model), optimizer, scheduler, loader"): _ACCELERATE,
    ("docs/integrations.md", "# given: module, new_module (LightningModules), path (a checkpoint of the first fit)"):
        _LIGHTNING,
}
