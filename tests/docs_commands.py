"""The commands of the docs' ```bash snippets (tests/test_docs_examples.py):
COMMANDS says, by its text, how each is run here (shortened, with its output
checked) or why it is only checked; _check_statically checks a command (its
scripts exist and parse, every flag passed is one its program's --help
lists) and gives the argv to run it with."""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

from docs_preludes import COMMON
from docs_snippets import REPO, _env, _failed, _free_port


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
    "ZERO_EXT_TIER=slow python3 -m pytest -q -n 2 tests": Run(
        extra=("--collect-only", "-p", "no:cacheprovider"), in_repo=True,  # which tests the tier holds, not run
        expect=("tests/test_tolerances.py::", "test_soak_1000_steps_stage3_nothing_accumulates", "deselected")),
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
