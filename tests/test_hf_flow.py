"""The Hugging Face flow (README): a transformers Llama built under
zero_ext.empty_init(), wrapped at stage 3 on two ranks, its weights streamed
from a save_pretrained directory, trained a few steps (matching the model
trained in one process over the global batch), written by save_weights and
read back by from_pretrained with the same logits."""
import pytest

pytest.importorskip("transformers")

from dist_harness import run_on_ranks  # noqa: E402
from hf_flow_scenarios import write_pretrained  # noqa: E402


def test_empty_init_load_train_save_from_pretrained(tmp_path):
    pretrained = str(tmp_path / "pretrained")
    write_pretrained(pretrained)
    problems = run_on_ranks(2, "hf_flow_scenarios:train_and_save", (pretrained, str(tmp_path / "trained")),
                            deadline_s=300)
    assert problems == [None, None]
