"""tests/cuda: a NCCL process group of one rank, for the files that ask for it
(pytest.mark.usefixtures("nccl_world_of_one")). A group of one rank runs its
collectives as local copies; ZERO_EXT_ONE_RANK_COLLECTIVES=1 sends them
through NCCL all the same, unless a test asks for the local way."""
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def nccl_world_of_one():
    os.environ["ZERO_EXT_ONE_RANK_COLLECTIVES"] = "1"  # NCCL's path, unless a test asks for the local one
    if dist.is_initialized():
        yield
        os.environ.pop("ZERO_EXT_ONE_RANK_COLLECTIVES", None)
        return
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120),
                                device_id=torch.device("cuda", 0))
        yield
        dist.destroy_process_group()
    os.environ.pop("ZERO_EXT_ONE_RANK_COLLECTIVES", None)
