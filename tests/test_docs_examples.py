"""Every ```python and ```bash snippet of docs/*.md and the README, run by a
test on CPU (gloo ranks), or, where it cannot run here, checked. A python
snippet's first line says which:

- `# example: torchrun --nproc-per-node N`: a whole program, run as written
  under torchrun; it checks its own result against one process and prints
  "the same as one process".
- `# given: <names>`: a fragment using names defined elsewhere (model,
  optimizer, loader...). PRELUDES (docs_preludes.py), keyed by the page and
  that line, defines them (small models, few steps) before the fragment and
  checks what it did after it; the fragment's text runs unchanged in
  between, under torchrun or in one plain process as the prelude says. The names the
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

How the snippets are read and launched: docs_snippets.py; the preludes:
docs_preludes.py; the bash commands' plans and static checks:
docs_commands.py.
"""
from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys

import pytest

from docs_commands import COMMANDS, Run, _check_statically, _commands
from docs_preludes import COMMON, PRELUDES
from docs_snippets import LANGUAGES, REPO, _EXAMPLE, _GIVEN, _NOT_RUN, _env, _failed, _kind, _of, _python, snippets


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
            f"`# given: <names>` (a fragment, with a prelude in tests/docs_preludes.py) or "
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
