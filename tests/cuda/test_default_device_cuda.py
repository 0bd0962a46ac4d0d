"""On a GPU: torch.set_default_device("cuda") (and a float64 default dtype)
around save, load and full_state_dict change nothing, the case that ended
checkpoint round trips on an H100 without an error before zero_ext named its
host buffers' device. Two gloo ranks share the GPU with CUDA tensors."""
import pytest
import torch

import test_default_settings as cpu_version

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
root = cpu_version.root


@pytest.mark.parametrize("stage,precision,offload", cpu_version.CASES)
def test_user_defaults_change_nothing_on_cuda(root, stage, precision, offload):
    cpu_version.test_user_defaults_change_nothing(root, stage, precision, offload, device="cuda")
