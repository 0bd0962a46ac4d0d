"""The ```python and ```bash snippets of docs/*.md and the README, as
tests/test_docs_examples.py reads them: each with its page, line, language
and text, its kind (from its first line: `# example: torchrun
--nproc-per-node N`, `# given: <names>`, `# not run: <why>`), one test
param per distinct text; and how a snippet's program is launched (one plain
process or torchrun on gloo ranks) and its failure reported."""
from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import textwrap
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
