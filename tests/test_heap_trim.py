"""ZERO_EXT_TRIM_HEAP=1 ([Note: reusable host blocks] in csrc/reusable_blocks.h):
at an optimizer step's end, glibc's free heap pages go back to the system;
without it they stay resident, as in DDP's loop. Each case is a fresh
process, so its heap holds what the child put there."""
import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, sys
import torch, torch.distributed as dist
import zero_ext

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = torch.nn.Linear(8, 8)
model, opt = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2)

def step():
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()

step()
# 640 buffers of 100 KB, each under glibc's mmap threshold (128 KiB): 61 MiB
# of heap, touched, then freed below a buffer that stays, so glibc cannot
# give them back from the heap's top: free, yet resident.
holes = [torch.ones(25_000) for _ in range(640)]
pin = torch.ones(25_000)
del holes
freed = rss_mib()
step()
print(json.dumps({"freed": freed, "after_step": rss_mib()}))
"""


@pytest.mark.parametrize("trim", ["1", None])
def test_the_free_heap_goes_back_at_a_steps_end_only_when_asked(trim, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ZERO_EXT_TRIM_HEAP"}
    if trim:
        env["ZERO_EXT_TRIM_HEAP"] = trim
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "rdv")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    given_back = rss["freed"] - rss["after_step"]
    if trim:
        assert given_back > 40, rss  # most of the 61 MiB of holes
    else:
        assert given_back < 10, rss  # the holes stay resident
