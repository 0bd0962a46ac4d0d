"""Every ```python and ```bash snippet of docs/*.md and the README, run by a
test on CPU (gloo ranks), or, where it cannot run here, checked. A python
snippet's first line says which:

- `# example: torchrun --nproc-per-node N`: a whole program, run as written
  under torchrun; it checks its own result against one process and prints
  "the same as one process".
- `# given: <names>`: a fragment using names defined elsewhere (model,
  optimizer, loader...). PRELUDES below, keyed by the page and that line,
  defines them (small models, few steps) before the fragment and checks what
  it did after it; the fragment's text runs unchanged in between, under
  torchrun or in one plain process as the prelude says. The names the
  fragment reads and does not define itself must be in its `# given:` line
  (or torch, zero_ext), so the line tells a reader what to bring.
- `# not run: <why>`: cannot run here (a GPU, a network download, several
  nodes, a machine's own drive): the python is compiled.

A bash snippet's commands (its lines, and each side of `&&`) are all checked
(a script exists and parses, every flag passed is one the program's --help
lists) and then run, shortened where COMMANDS says so, with their output
checked; those COMMANDS marks check-only (the machine's setup, the whole
suite) are not run, nor is any command of a snippet marked `# not run: <why>`.
Every fence carries a language (python, bash or text), so none is skipped.
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGUAGES = {"python", "bash", "text"}
_EXAMPLE = re.compile(r"# example: torchrun --nproc-per-node (\d+)$")
_NOT_RUN = re.compile(r"# not run: (\S.{9,})$")  # a reason of ten characters or more
_GIVEN = re.compile(r"# given: (\S.*)$")


class Snippet(NamedTuple):
    page: str  # relative to the repository: "docs/checkpoints.md", "README.md"
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def first(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _pages():
    docs = os.path.join(REPO, "docs")
    return [f"docs/{p}" for p in sorted(os.listdir(docs)) if p.endswith(".md")] + ["README.md"]


@functools.lru_cache(maxsize=None)
def snippets() -> tuple:
    found = []
    for page in _pages():
        with open(os.path.join(REPO, page)) as f:
            lines = f.read().split("\n")
        i = 0
        while i < len(lines):
            fence = re.match(r"\s*```(.*)$", lines[i])
            if fence is None:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not re.match(r"\s*```\s*$", lines[j]):
                j += 1
            assert j < len(lines), f"{page}:{i + 1}: a fence that is never closed"
            code = textwrap.dedent("\n".join(lines[i + 1:j])) + "\n"
            found.append(Snippet(page, i + 1, fence.group(1).strip(), code))
            i = j + 1
    return tuple(found)


def _of(lang: str, kind=None) -> list:
    """The snippets of `lang` (and of `kind`: "example", "given", "not run",
    None for all), one param per distinct text: a snippet repeated on two
    pages (the README's on docs/install.md) runs once, its id naming both."""
    by_code: dict = {}
    for s in snippets():
        if s.lang == lang and (kind is None or _kind(s) == kind):
            by_code.setdefault(s.code, []).append(s)
    return [pytest.param(same, id="+".join(s.where for s in same)) for same in by_code.values()]


def _kind(s: Snippet) -> str:
    if _EXAMPLE.match(s.first):
        return "example"
    if _NOT_RUN.match(s.first):
        return "not run"
    if _GIVEN.match(s.first):
        return "given"
    return "plain"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ZERO_EXT_REPO": REPO}


def _python(script, ranks: int, cwd, timeout: int = 240) -> subprocess.CompletedProcess:
    """`script` in one plain process (ranks 1: no torch.distributed) or under torchrun."""
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={_free_port()}"]
    return subprocess.run([*launch, str(script)], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)


def _failed(done) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-8000:]}"


# ---------------------------------------------------------------- the pages as a whole

def test_every_fence_names_python_bash_or_text():
    unnamed = [f"{s.where} ({s.lang!r})" for s in snippets() if s.lang not in LANGUAGES]
    assert not unnamed, f"a fence without python, bash or text is run by nothing: {unnamed}"


def test_the_migration_pages_have_examples():
    pages = {s.page for s in snippets() if _kind(s) == "example"}
    assert {"docs/coming-from-fsdp2.md", "docs/coming-from-deepspeed.md", "docs/huggingface.md"} <= pages, pages


def test_every_python_snippet_says_how_it_runs():
    for s in snippets():
        if s.lang != "python":
            continue
        assert _kind(s) != "plain", (
            f"{s.where}: a python snippet starts with `# example: torchrun --nproc-per-node N` (a whole program), "
            f"`# given: <names>` (a fragment, with a prelude in tests/test_docs_examples.py) or "
            f"`# not run: <why>`; it starts with {s.first!r}")
        if _kind(s) == "given":
            assert (s.page, s.first) in PRELUDES, f"{s.where}: no prelude for {s.first!r} in PRELUDES"
    used = {(s.page, s.first) for s in snippets() if s.lang == "python"}
    stale = set(PRELUDES) - used
    assert not stale, f"preludes no snippet uses (its page or given line changed?): {stale}"


def test_a_not_run_marker_has_a_reason():
    for s in snippets():
        if "not run" in s.first:
            assert _NOT_RUN.match(s.first), (
                f"{s.where}: `# not run: <why>`, the why of ten characters or more: {s.first!r}")


# ---------------------------------------------------------------- python: whole programs

@pytest.mark.parametrize("same", _of("python", "example"))
def test_example_runs_and_matches_one_process(tmp_path, same):
    code = same[0].code
    script = tmp_path / "example.py"
    script.write_text(code)
    done = _python(script, int(_EXAMPLE.match(same[0].first).group(1)), tmp_path, timeout=300)
    assert done.returncode == 0, _failed(done)
    assert "the same as one process" in done.stdout, done.stdout


# ---------------------------------------------------------------- python: fragments and their preludes

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


def _free_names(code: str) -> set:
    """Names the code reads and neither assigns, imports nor defines (scopes ignored)."""
    tree = ast.parse(code)
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


@pytest.mark.parametrize("same", _of("python", "given"))
def test_fragment_runs_with_its_prelude(tmp_path, same):
    prelude = PRELUDES[(same[0].page, same[0].first)]
    assert all(PRELUDES.get((s.page, s.first)) is prelude for s in same), "one text, one prelude"
    code = same[0].code
    given = set(re.findall(r"[A-Za-z_]\w*", _GIVEN.match(same[0].first).group(1))) | {"torch", "zero_ext"}
    assert not _free_names(code) - given, (
        f"{same[0].where} uses {sorted(_free_names(code) - given)}, not in its line {same[0].first!r}")
    if prelude.each_statement:
        statements = [ast.get_source_segment(code, node) for node in ast.parse(code).body]
        assert len(statements) > 1, statements
        body = (f"_SETUP, _CHECK = {prelude.setup!r}, {prelude.check!r}\n"
                f"for _statement in {statements!r}:\n"
                f"    exec(_SETUP)\n"
                f"    say('choice:', _statement)\n"
                f"    exec(compile(_statement, 'snippet', 'exec'))\n"
                f"    exec(_CHECK)\n")
    else:
        body = f"{prelude.setup}\n# ---- the snippet, as the page has it\n{code}\n# ---- the check\n{prelude.check}"
    script = tmp_path / "fragment.py"
    script.write_text(COMMON + body)
    done = _python(script, prelude.ranks, tmp_path)
    assert done.returncode == 0, _failed(done)
    for line in prelude.expect:
        assert line in done.stdout, f"{line!r} not in the output:\n{done.stdout[-4000:]}"
    if prelude.each_statement:
        assert done.stdout.count("choice:") == len(statements), done.stdout


# ---------------------------------------------------------------- python: not run

@pytest.mark.parametrize("same", _of("python", "not run"))
def test_not_run_python_compiles(same):
    for s in same:
        compile(s.code, s.where, "exec")


# ---------------------------------------------------------------- bash

@dataclass(frozen=True)
class Run:
    extra: tuple = ()  # arguments appended to shorten the run
    setup: str = ""  # python, in one process in the run's directory first
    expect: tuple = ()  # in its stdout
    check: str = ""  # python, in one process after it; prints `check_expect`
    check_expect: str = ""
    in_repo: bool = False  # run from the checkout (its paths are the repository's), not a scratch directory


@dataclass(frozen=True)
class CheckOnly:
    why: str


_CHECKPOINT_TO_CONVERT = COMMON + '''
model = small_model()
model, optimizer = zero_ext.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2)
zero_ext.save("ckpt/step1000", model, optimizer)
torch.save(zero_ext.full_state_dict(model), "expected.pt")
'''

COMMANDS = {  # each command of the bash snippets not marked `# not run:`, by its text
    "bash scripts/setup.sh": CheckOnly("sets the machine up (pip installs, builds the extension this suite imports)"),
    "torchrun --nproc-per-node 2 examples/train_lm.py --stage 2": Run(
        extra=("--steps", "10"), expect=("zero_ext stage 2 (fp32)", "10/10", "bytes held per rank during a step")),
    "python3 -m pytest -q -n 2 tests": CheckOnly("the whole suite, this file included (15 minutes)"),
    "ZERO_EXT_TIER=jobs python3 -m pytest -q -n 2 tests": Run(
        extra=("--collect-only", "-p", "no:cacheprovider"), in_repo=True,  # which tests the tier holds, not run
        expect=("tests/test_docs_examples.py::", "tests/test_exit.py::", "tests/test_multinode.py::", "deselected")),
    "python -m zero_ext.convert ckpt/step1000 model.pt": Run(
        setup=_CHECKPOINT_TO_CONVERT,
        check='''
import torch
written, expected = torch.load("model.pt", weights_only=True), torch.load("expected.pt", weights_only=True)
assert set(written) == set(expected)
for name, value in expected.items():
    assert written[name].dtype == torch.float32 and torch.equal(written[name], value), name
print("model.pt: the fp32 masters,", len(written), "tensors")
''',
        check_expect="model.pt: the fp32 masters, 4 tensors"),
    "python -m zero_ext.convert --verify ckpt/step1000": Run(expect=("ok",)),
}


def _commands(code: str) -> list:
    """The commands of a bash snippet: lines (continuations joined, comments
    dropped), split at `&&`, whitespace collapsed."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        out += [" ".join(part.split()) for part in line.split("&&") if part.strip()]
    return out


@functools.lru_cache(maxsize=None)
def _help(*program) -> str:
    done = subprocess.run([*program, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO, env=_env())
    assert done.returncode == 0, f"{' '.join(program)} --help: " + _failed(done)
    return done.stdout


def _flags_accepted(args, help_text: str, program: str) -> None:
    for arg in args:
        if arg.startswith("-") and not re.fullmatch(r"-[\d.]+", arg):
            flag = arg.split("=", 1)[0]
            accepted = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text)
            assert accepted, f"{program} has no {flag}:\n{help_text}"


_TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module"}


def _check_statically(command: str) -> list:
    """A command's scripts exist (and, for bash, parse) and its flags are its
    programs'; returns the argv to run it with here."""
    tokens = shlex.split(command)
    brackets = [t for t in tokens if t.startswith("[") or t.endswith("]")]
    assert not brackets, f"{command}: {brackets}: optional arguments go in the prose, not in brackets on the line"
    assigned = []  # leading NAME=value: the environment the command runs in
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        assigned.append(tokens.pop(0))
    for name, value in (a.split("=", 1) for a in assigned):
        if name == "ZERO_EXT_TIER":  # tests/conftest.py's, by path: tests/cuda has a conftest module too
            spec = importlib.util.spec_from_file_location("tests_conftest", os.path.join(REPO, "tests", "conftest.py"))
            tiers = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(tiers)
            assert value in tiers.TIERS, f"{command}: ZERO_EXT_TIER={value!r} is none of {tiers.TIERS}"
    if assigned:
        return ["env", *assigned, *_check_statically(" ".join(shlex.quote(t) for t in tokens))]
    program, args = tokens[0], tokens[1:]
    if program == "bash":
        script = os.path.join(REPO, args[0])
        assert os.path.isfile(script), f"{command}: no {args[0]}"
        done = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert done.returncode == 0, f"{args[0]} does not parse: {done.stderr}"
        return ["bash", script, *args[1:]]
    if program == "torchrun":
        i = 0
        while i < len(args) and args[i].startswith("-"):
            i += 1 if "=" in args[i] or args[i] in _TORCHRUN_SWITCHES else 2
        _flags_accepted(args[:i], _help(sys.executable, "-m", "torch.distributed.run"), "torchrun")
        launch = [sys.executable, "-m", "torch.distributed.run", f"--master-port={_free_port()}", *args[:i]]
        program, args = "python", args[i:]
        assert args, f"{command}: no script"
    else:
        launch = [sys.executable]
    assert program in ("python", "python3"), f"{command}: which program is {program}?"
    if args[0] == "-m":
        _flags_accepted(args[2:], _help(sys.executable, "-m", args[1]), f"python -m {args[1]}")
        return [*launch, *args]
    script = os.path.join(REPO, args[0])
    assert os.path.isfile(script), f"{command}: no {args[0]}"
    _flags_accepted(args[1:], _help(sys.executable, script), args[0])
    return [*launch, script, *args[1:]]


def test_every_bash_command_is_run_or_checked():
    seen = set()
    for s in snippets():
        if s.lang == "bash" and _kind(s) != "not run":
            for command in _commands(s.code):
                assert command in COMMANDS, f"{s.where}: {command!r} is neither run nor checked (COMMANDS)"
                seen.add(command)
    assert not set(COMMANDS) - seen, f"COMMANDS no snippet has: {set(COMMANDS) - seen}"


@pytest.mark.parametrize("same", _of("bash"))
def test_bash_snippet(tmp_path, same):
    code = same[0].code
    commands = _commands(code)
    assert commands, f"{same[0].where}: no command"
    marked = _kind(same[0]) == "not run"
    runs = []
    for command in commands:
        argv = _check_statically(command)
        plan = None if marked else COMMANDS[command]
        if isinstance(plan, Run):
            runs.append((command, argv, plan))
    for command, argv, plan in runs:
        if plan.setup:
            done = subprocess.run([sys.executable, "-c", plan.setup], capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path, env=_env())
            assert done.returncode == 0, f"setup of {command!r}: " + _failed(done)
        done = subprocess.run([*argv, *plan.extra], capture_output=True, text=True, timeout=120,
                              cwd=REPO if plan.in_repo else tmp_path, env=_env())
        assert done.returncode == 0, f"{command!r}: " + _failed(done)
        for part in plan.expect:
            assert part in done.stdout, f"{command!r}: {part!r} not in\n{done.stdout[-4000:]}"
        if plan.check:
            done = subprocess.run([sys.executable, "-c", plan.check], capture_output=True, text=True, timeout=120,
                                  cwd=tmp_path, env=_env())
            assert done.returncode == 0, f"check of {command!r}: " + _failed(done)
            assert plan.check_expect in done.stdout, done.stdout
    if marked:
        assert not runs
