"""The runnable examples of the docs (a ```python block whose first line is
`# example: torchrun --nproc-per-node N`), each run as written under torchrun
on CPU ranks: they check their own result against one process and print
"the same as one process" when it holds."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
_EXAMPLE = re.compile(r"```python\n(# example: torchrun --nproc-per-node (\d+)\n.*?)```", re.S)


def examples():
    found = []
    for page in sorted(os.listdir(DOCS)):
        if page.endswith(".md"):
            with open(os.path.join(DOCS, page)) as f:
                for k, (code, ranks) in enumerate(_EXAMPLE.findall(f.read())):
                    found.append(pytest.param(code, int(ranks), id=f"{page}#{k}"))
    return found


def test_the_migration_pages_have_examples():
    ids = {p.id.split("#")[0] for p in examples()}
    assert {"coming-from-fsdp2.md", "coming-from-deepspeed.md"} <= ids, ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("code, ranks", examples())
def test_example_runs_and_matches_one_process(tmp_path, code, ranks):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                           f"--master-port={_free_port()}", str(script)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "the same as one process" in done.stdout, done.stdout
