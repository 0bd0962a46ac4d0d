"""Rank side of tests/test_checkpoint_publish.py: one training job under
torchrun's elastic agent that dies at every fault point of a save in turn
and is restarted each time, the way examples/train_lm.py resumes.

    torchrun --standalone --nproc-per-node 2 --max-restarts 6 checkpoint_publish_scenarios.py ROOT

Attempt k (its number: the start-* files in ROOT/log) asks
zero_ext.checkpoint_exists before joining the group, loads the save if
there is one and goes on from the step after it, saving ROOT/run/ck after
every step. Its first save must succeed (and leave nothing but ck); its
second dies at ATTEMPTS[k]. Rank 0 of each attempt writes what it saw to
ROOT/log/attempt-<k>.json; every rank writes the checksum of the full state
after each step to ROOT/log/state-<step>-<k>, before saving it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import torch.distributed as dist

import zero_ext
from checkpoint_scenarios import make, train
from zero_ext.files.checkpoint import publish
from zero_ext.tools import faults

# (fault point:rank, publish by exchange); the last attempt finishes the job.
ATTEMPTS = [
    ("after_shards:1", True),
    ("before_publish:0", True),
    ("after_exchange:0", True),
    ("removing_old:0", True),
    ("between_renames:0", False),
    ("after_renames:0", False),
    (None, True),
]
# Points a save dies at after its checkpoint is in place.
PUBLISHED_BEFORE = {"after_exchange", "after_renames", "removing_old"}
STEPS = 2 * len(ATTEMPTS) + 1  # every attempt advances one or two steps


def describe(run: str) -> dict:
    """What is in the checkpoint directory's parent: each entry's kind."""
    out = {}
    for name in sorted(os.listdir(run)):
        full = os.path.join(run, name)
        out[name] = {"dir": os.path.isdir(full),
                     "marker": os.path.isfile(os.path.join(full, publish.STAGING_MARKER)),
                     "metadata": os.path.isfile(os.path.join(full, "metadata.json"))}
    return out


def state_digest(model) -> str:
    full = zero_ext.full_state_dict(model)  # collective
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(name.encode())
        digest.update(full[name].contiguous().view(-1).numpy().tobytes())
    return digest.hexdigest()


def main(root: str) -> None:
    log, run = os.path.join(root, "log"), os.path.join(root, "run")
    ck = os.path.join(run, "ck")
    attempt = len([n for n in os.listdir(log) if n.startswith("start-")])
    fault, exchange = ATTEMPTS[attempt]
    # Not collective: asked before the process group exists.
    seen = {"exists": zero_ext.checkpoint_exists(ck),
            "legacy_exists": os.path.exists(os.path.join(ck, "metadata.json")),  # the old resume test
            "entries": describe(run), "fault": fault, "exchange": exchange}

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has counted the attempts
    if rank == 0:
        open(os.path.join(log, f"start-{attempt}"), "w").close()
    conditions = [] if exchange else [faults.spec("no_exchange")]  # publish as where exchange is missing
    os.environ[faults.VARIABLE] = ",".join(conditions)

    model, opt = make(2)
    first = 1
    if seen["exists"]:
        extra = zero_ext.load(ck, model, opt)
        first = extra["step"] + 1
        seen["loaded_step"] = extra["step"]
        seen["loaded_digest"] = state_digest(model)
    seen["first_step"] = first

    def record() -> None:
        if rank == 0:
            with open(os.path.join(log, f"attempt-{attempt}.json"), "w") as f:
                json.dump(seen, f)

    last = first + 1 if fault else STEPS
    for step in range(first, last + 1):
        train(model, opt, range(step, step + 1), rank, world)
        digest = state_digest(model)
        if rank == 0:
            with open(os.path.join(log, f"state-{step}-{attempt}"), "w") as f:
                f.write(digest)
        if fault and step == last:
            os.environ[faults.VARIABLE] = ",".join(conditions + [fault])
            record()
        zero_ext.save(ck, model, opt, extra={"step": step})
        if step == first:
            seen["after_first_save"] = describe(run)
    if fault:  # the save should have died
        seen["survived"] = True
        record()
        dist.barrier()
        os._exit(3)
    seen["done"] = describe(run)
    record()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
