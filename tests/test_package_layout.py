"""zero_ext/ reads as rooms (zero_ext/README.md): each concern a subpackage,
no private name imported from another room, the top level only the public
API and the command lines, modes read from the core's layout, one
fault-injection variable."""
import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "zero_ext")
ROOMS = {"wrapping", "runtime", "optim", "groups", "tools", "files", "integrations"}
# The public API and the `python -m` entry points.
TOP_LEVEL = {"__init__.py", "env.py", "selfcheck.py", "convert.py", "coordinator.py"}
SHARED_PRIVATE = {"_C", "__version__"}  # the compiled core and the version: the package's own


def modules():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
                yield rel, path


def room_of(module: str) -> str:
    """'wrapping' for zero_ext.wrapping.units; '' for the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else ""


def dotted(rel: str) -> str:
    parts = ["zero_ext"] + rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cross_room_private_imports(rel: str, source: str):
    """(importer, imported module, private name) for every `from X import _y`
    or import of a private module of another room in one file."""
    module = dotted(rel)
    package = module if rel.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if not target.startswith("zero_ext"):
            continue
        for alias in node.names:
            full = f"{target}.{alias.name}"
            if room_of(full if not node.module or target == package else target) == room_of(module):
                continue
            segments = full.split(".")[1:]
            if any(s.startswith("_") and s not in SHARED_PRIVATE for s in segments):
                found.append((module, target, alias.name))
    return found


def test_the_top_level_holds_only_the_api_and_the_command_lines():
    top = {name for name in os.listdir(PACKAGE) if name.endswith(".py")}
    assert top == TOP_LEVEL, f"modules outside a room: {sorted(top - TOP_LEVEL)}"
    rooms = {name for name in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
    assert rooms == ROOMS
    for room in rooms:
        with open(os.path.join(PACKAGE, room, "__init__.py")) as f:
            assert ast.get_docstring(ast.parse(f.read())), f"zero_ext/{room}/__init__.py says what the room holds"


def test_no_private_name_is_imported_across_rooms():
    found = []
    for rel, path in modules():
        with open(path) as f:
            found += cross_room_private_imports(rel, f.read())
    assert not found, found


def test_the_check_finds_a_private_import_across_rooms():
    """Positive control: the import the move removed (files/ reading the
    wrapped model's state through a private helper) is caught."""
    bad = "from ..runtime.state_dict import _state\nfrom .plan import _private_but_same_room\n"
    assert cross_room_private_imports("files/save.py", bad) == [
        ("zero_ext.files.save", "zero_ext.runtime.state_dict", "_state")]


def _is_stage(node: ast.AST) -> bool:
    """`stage`, `x.stage` or `x["stage"]`."""
    return (isinstance(node, ast.Name) and node.id == "stage"
            or isinstance(node, ast.Attribute) and node.attr == "stage"
            or isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "stage")


def _is_stage_number(node: ast.AST) -> bool:
    """An int literal, or a tuple, list or set of them (`stage in (1, 2)`)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_stage_number(e) for e in node.elts)
    return isinstance(node, ast.Constant) and type(node.value) is int


def stage_number_comparisons(source: str):
    """(line, enclosing function) of every comparison of a stage with a number."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_stage(s) for s in sides) and any(_is_stage_number(s) for s in sides):
                found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "")
    return found


# Comparisons outside wrapping/ that decide no mode of a wrapped model, by
# (module, function): what each does. None today: the optimizer's sharding
# takes whether the stage shards state, and the Lightning strategy checks its
# stage with wrapping's check_stage.
STAGE_NUMBER_EXCEPTIONS: dict = {}


def _callers_outside_wrapping(name: str):
    callers = []
    for rel, path in modules():
        with open(path) as f:
            tree = ast.parse(f.read())
        if not rel.startswith("wrapping/") and any(
                isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name
                for node in ast.walk(tree)):
            callers.append(rel)
    return callers


def test_stage_numbers_are_compared_only_where_wrap_plans():
    """Everywhere else the modes come from the core's layout (ZeroState's
    params_sharded, grads_sharded, replicated, sharded_optimizer)."""
    offenders, excepted = [], set()
    for rel, path in modules():
        if rel.startswith("wrapping/"):
            continue
        with open(path) as f:
            for line, function in stage_number_comparisons(f.read()):
                if (rel, function) in STAGE_NUMBER_EXCEPTIONS:
                    excepted.add((rel, function))
                else:
                    offenders.append(f"{rel}:{line} in {function or 'the module'}")
    assert not offenders, offenders
    assert excepted == set(STAGE_NUMBER_EXCEPTIONS), f"no longer needed: {set(STAGE_NUMBER_EXCEPTIONS) - excepted}"
    assert _callers_outside_wrapping("optimizer_sharding") == []


def test_the_check_finds_stage_numbers_compared():
    """Positive control: each way of comparing a stage with a number is
    reported, other comparisons are not."""
    bad = """
def plan(state, options, stage, kwargs):
    if stage == 3:
        pass
    if state.stage != 0:
        pass
    if 2 <= options.stage:
        pass
    if stage in (1, 2):
        pass
    if kwargs["stage"] == 1:
        pass
    return stage
"""
    assert stage_number_comparisons(bad) == [(3, "plan"), (5, "plan"), (7, "plan"), (9, "plan"), (11, "plan")]
    fine = "def f(state, stage, stages):\n    return state.params_sharded and stage == stages[0] and len(stages) == 4\n"
    assert stage_number_comparisons(fine) == []


@pytest.mark.parametrize("stage,modes", [
    (0, dict(params_sharded=False, grads_sharded=False, replicated=False, sharded_optimizer=False)),
    (1, dict(params_sharded=False, grads_sharded=True, replicated=False, sharded_optimizer=True)),
    (2, dict(params_sharded=False, grads_sharded=True, replicated=False, sharded_optimizer=True)),
    (3, dict(params_sharded=True, grads_sharded=True, replicated=False, sharded_optimizer=True)),
])
def test_the_modes_come_from_the_core(stage, modes):
    model, _ = _wrapped(stage)
    state = model._zero_ext
    assert {k: getattr(state, k) for k in modes} == modes


def _wrapped(stage: int):
    import torch

    import zero_ext

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=stage)


def test_stage_0_with_fp32_masters_is_replicated():
    import torch

    import zero_ext

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, _ = zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=0,
                             mixed_precision=zero_ext.MixedPrecision(torch.bfloat16))
    state = model._zero_ext
    assert (state.replicated, state.grads_sharded, state.sharded_optimizer) == (True, False, True)


def test_one_variable_arms_every_fault_point(monkeypatch):
    from zero_ext.tools import faults
    from zero_ext.tools import build_check

    monkeypatch.setenv(faults.VARIABLE, ",".join([faults.spec("after_shards", 1), faults.spec("no_exchange"),
                                                 faults.spec("grad_hook", 0, 3), "malformed"]))
    assert faults.armed("after_shards", 1) and not faults.armed("after_shards", 0)
    assert faults.armed("no_exchange") and faults.armed("no_exchange", 5)
    assert faults.armed_faults()[2] == faults.Fault("grad_hook", 0, 3)
    assert build_check.FAULT_VARIABLE == faults.VARIABLE
    # The save's exit points end the process as a kill would, only where armed.
    code = ("import os; os.environ['ZERO_EXT_TEST_FAULT'] = 'before_publish:0'; "
            "from zero_ext.tools import faults; faults.exit_if_armed('before_publish', 1); "
            "faults.exit_if_armed('after_shards', 0); faults.exit_if_armed('before_publish', 0); print('alive')")
    import zero_ext  # the copy under test (an installed one in the torch-version venvs), not the checkout

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(zero_ext.__file__))})
    assert done.returncode == faults.EXIT_CODE and "alive" not in done.stdout, done.stderr


def test_every_room_is_packaged():
    """A wheel (the torch-version venvs install one) carries every room and
    every package inside one (files/checkpoint, files/weights)."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        packages = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    on_disk = {os.path.relpath(root, REPO).replace(os.sep, ".") for root, _, files in os.walk(PACKAGE)
               if "__init__.py" in files}
    assert {"zero_ext"} | {f"zero_ext.{room}" for room in ROOMS} <= on_disk
    assert packages == on_disk
