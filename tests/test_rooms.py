"""The rooms of zero_ext/ are boundaries (docs/design.md, "Rooms"): every
import between rooms points down the declared order, so the room graph has
no cycle; a room offers what its `__init__` lists in `__all__` and other
rooms import only that, from the room itself; the state zero_ext attaches to
a model or optimizer is read through one accessor (tools/module_state.py);
the C++ core is named only where it is built and bound into handles
(CORE_HOLDERS), so nothing else holds it, aliased or not.
Each rule has a positive control: a small source that breaks it is caught."""
import ast
import os
from typing import Dict, List, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "zero_ext")
# Bottom first. An arrow may point only to a room before it; the package
# root (the public API and the command lines) sits above them all, and the
# compiled core (zero_ext._C) below them all.
ORDER = ["tools", "groups", "optim", "runtime", "files", "wrapping", "integrations"]
ROOT, CORE = "<root>", "<core>"
STATE_ACCESSOR = "tools/module_state.py"
# What the accessor attaches: a model's or optimizer's state, and an
# optimizer's member token in its model's step round.
STATE_ATTRIBUTES = {"_zero_ext", "_zero_ext_member"}
# Where the C++ core's bound views may be named and called: its handles.
# (wrapping/core_build.py builds the model from its CoreConfig and hands it
# straight to CoreHandles.of; the model itself offers no methods.)
CORE_HOLDERS = {"tools/core_handles.py"}


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["zero_ext", "_C"]:
        return CORE
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else ROOT


def rank_of(room: str) -> int:
    return -1 if room == CORE else len(ORDER) if room == ROOT else ORDER.index(room)


def dotted(rel: str) -> str:
    parts = ["zero_ext"] + rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(rel: str, source: str) -> List[Tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every zero_ext import
    in one file, function-level ones included; relative imports resolved."""
    module = dotted(rel)
    package = module if rel.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "zero_ext"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "zero_ext":
                found += [(target, a.name, node.lineno) for a in node.names]
    return found


def sources() -> Dict[str, str]:
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    out[os.path.relpath(path, PACKAGE).replace(os.sep, "/")] = f.read()
    return out


def offered(init_source: str) -> Set[str]:
    """The names a room's __init__ lists in __all__ (a list, or sorted() of a
    lazy door's _OFFERED mapping)."""
    tree = ast.parse(init_source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, ast.List):
                return {e.value for e in node.value.elts}
            return lazily_offered(tree)
    return set()


def lazily_offered(tree: ast.Module) -> Set[str]:
    """The keys of a door's _OFFERED mapping: names it imports on first use (PEP 562)."""
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == "_OFFERED" for t in targets):
            return {k.value for k in node.value.keys}
    return set()


def room_edges(files: Dict[str, str]) -> Dict[Tuple[str, str], List[str]]:
    """(from room, to room) -> the imports that make the arrow."""
    edges: Dict[Tuple[str, str], List[str]] = {}
    for rel, source in files.items():
        here = room_of(dotted(rel))
        for target, name, line in imports_of(rel, source):
            full = f"{target}.{name}" if name and target == "zero_ext" else target
            there = room_of(full)
            if there != here:
                edges.setdefault((here, there), []).append(f"{rel}:{line} imports {target} {name}".strip())
    return edges


def upward_arrows(edges) -> List[str]:
    return [f"{a} -> {b}: {where[0]}" for (a, b), where in sorted(edges.items()) if rank_of(b) >= rank_of(a)]


def cycles(edges) -> List[List[str]]:
    """The strongly connected components of more than one room (Tarjan)."""
    graph: Dict[str, Set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def imports_past_the_door(files: Dict[str, str]) -> List[str]:
    """Imports from another room that do not take a name its __init__ offers
    from the room itself (`from ..runtime.state import X` instead of
    `from ..runtime import X`)."""
    offers = {room: offered(files.get(f"{room}/__init__.py", "")) for room in ORDER}
    found = []
    for rel, source in files.items():
        here = room_of(dotted(rel))
        for target, name, line in imports_of(rel, source):
            there = room_of(f"{target}.{name}" if name and target == "zero_ext" else target)
            if there in (here, CORE, ROOT):
                continue
            if target != f"zero_ext.{there}" or name not in offers[there]:
                found.append(f"{rel}:{line}: {target} import {name or '*'}")
    return found


def state_read_directly(files: Dict[str, str]) -> List[str]:
    """Reads or writes of the STATE_ATTRIBUTES outside the accessor."""
    found = []
    for rel, source in files.items():
        if rel == STATE_ACCESSOR:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr in STATE_ATTRIBUTES:
                found.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Constant) and node.value in STATE_ATTRIBUTES:
                found.append(f"{rel}:{node.lineno}")
    return found


# The attribute names under which the core is held (ZeroState.core; `_core`
# for a private copy): outside CORE_HOLDERS nothing reads them at all, so no
# alias of the core (`c = state.core`, an argument, a tuple, getattr) can
# exist there to be called. The state's `handles` is the way in.
CORE_ATTRIBUTES = {"core", "_core"}
# Calls that name an attribute by a string: getattr(x, "core") and the like.
BY_NAME = {"getattr", "hasattr", "setattr", "delattr", "attrgetter", "__getattribute__"}
# Expressions outside CORE_HOLDERS that read an attribute named `core` of
# something that is not zero_ext's core, with why.
NOT_THE_CORE = {
    ("integrations/_lightning_strategy.py", "pl.core"),  # Lightning's package lightning.pytorch.core
}


def _names_the_core(node: ast.AST) -> bool:
    """`X.core`, getattr(X, "core") (hasattr, setattr, attrgetter...),
    vars(X)["core"] / X.__dict__["core"], or `case C(core=...)`."""
    if isinstance(node, ast.Attribute):
        return node.attr in CORE_ATTRIBUTES
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return name in BY_NAME and any(
            isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.split(".")[0] in CORE_ATTRIBUTES
            for a in node.args)
    if isinstance(node, ast.Subscript):
        key = node.slice
        holder = node.value
        by_dict = (isinstance(holder, ast.Call) and isinstance(holder.func, ast.Name) and holder.func.id == "vars") \
            or (isinstance(holder, ast.Attribute) and holder.attr == "__dict__")
        return by_dict and isinstance(key, ast.Constant) and key.value in CORE_ATTRIBUTES
    if isinstance(node, ast.MatchClass):
        return bool(set(node.kwd_attrs) & CORE_ATTRIBUTES)
    return False


def core_called_directly(files: Dict[str, str]) -> List[str]:
    """Outside CORE_HOLDERS: any expression that names the core held by an
    object (`X.core`, `X._core`, getattr(X, "core"), ...: read, written or
    aliased), and calls on a name `core` (`core.X(...)`)."""
    found = []
    for rel, source in files.items():
        if rel in CORE_HOLDERS:
            continue
        for node in ast.walk(ast.parse(source)):
            if _names_the_core(node) and (rel, ast.unparse(node)) not in NOT_THE_CORE:
                found.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "core":
                found.append(f"{rel}:{node.lineno}")
    return sorted(set(found), key=lambda where: (where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1])))


# --- the package -----------------------------------------------------------

def test_every_arrow_between_rooms_points_down_and_no_cycle():
    edges = room_edges(sources())
    assert not upward_arrows(edges), upward_arrows(edges)
    assert cycles(edges) == []
    assert {a for a, _ in edges} - {ROOT} <= set(ORDER)


def test_other_rooms_import_only_what_a_room_offers():
    assert imports_past_the_door(sources()) == []


def test_every_room_declares_what_it_offers():
    files = sources()
    for room in ORDER:
        names = offered(files[f"{room}/__init__.py"])
        assert names or room == "integrations", f"zero_ext/{room}/__init__.py lists no __all__"
        tree = ast.parse(files[f"{room}/__init__.py"])
        bound = {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        bound |= lazily_offered(tree)
        submodules = {rel.split("/")[1][:-3] for rel in files if rel.startswith(f"{room}/")}
        assert names <= bound | submodules, f"{room} lists names it neither imports nor holds: {names - bound - submodules}"


def test_inside_files_weights_never_import_checkpoints():
    """files/ is two parts over one plan: checkpoint/ may write safetensors
    through weights/ (convert), weights/ never reads zero_ext's own format."""
    found = [f"{rel}:{line}" for rel, source in sources().items() if rel.startswith("files/weights/")
             for target, _, line in imports_of(rel, source) if target.startswith("zero_ext.files.checkpoint")]
    assert found == []


def test_module_state_is_read_through_one_accessor():
    assert state_read_directly(sources()) == []


def test_the_core_is_reached_through_its_handles():
    assert core_called_directly(sources()) == []


# --- positive controls -------------------------------------------------------

def test_the_checks_catch_an_upward_arrow_and_a_cycle():
    files = {
        "optim/step_round.py": "from ..runtime.state import ZeroState\n",  # up: optim -> runtime
        "runtime/state.py": "from ..optim import StepRound\n",
        "tools/version.py": "from .. import __version__\n",  # up: tools -> the root
    }
    edges = room_edges(files)
    assert upward_arrows(edges) == [
        "optim -> runtime: optim/step_round.py:1 imports zero_ext.runtime.state ZeroState",
        "tools -> <root>: tools/version.py:1 imports zero_ext __version__"]
    assert cycles(edges) == [["optim", "runtime"]]
    assert cycles(room_edges({"runtime/state.py": "from ..optim import StepRound\n"})) == []


def test_the_check_catches_an_import_past_a_rooms_door():
    files = {
        "optim/__init__.py": '__all__ = ["StepRound"]\nfrom .step_round import StepRound\n',
        "runtime/__init__.py": '__all__ = []\n',
        "runtime/state.py": "from ..optim import StepRound\nfrom ..optim.step_round import StepRound\n"
                            "from ..optim import as_one\n",
    }
    assert imports_past_the_door(files) == [
        "runtime/state.py:2: zero_ext.optim.step_round import StepRound",
        "runtime/state.py:3: zero_ext.optim import as_one"]


def test_the_check_catches_module_state_read_directly():
    files = {"files/save.py": 'state = model._zero_ext\nother = getattr(opt, "_zero_ext", None)\n',
             "optim/step_round.py": 'opt._zero_ext_member = 0\nx = opt._zero_ext_member\nopt._zero_ext_owner\n',
             STATE_ACCESSOR: 'x = getattr(obj, "_zero_ext", None)\nsetattr(obj, "_zero_ext_member", 0)\n'}
    assert state_read_directly(files) == ["files/save.py:1", "files/save.py:2",
                                          "optim/step_round.py:1", "optim/step_round.py:2"]


def test_the_check_catches_the_core_called_directly():
    files = {"runtime/module.py": "state.core.release_all()\ncore.sync()\nstate.handles.units.release_all()\n",
             "wrapping/wrap.py": "core.set_skip_nonfinite(True)\n",
             "tools/core_handles.py": "f = core.zero_grad\n"}
    assert core_called_directly(files) == ["runtime/module.py:1", "runtime/module.py:2", "wrapping/wrap.py:1"]


def test_the_check_catches_the_core_through_an_alias():
    aliases = [  # (source, the line caught)
        ("c = state.core\nc.zero_grad()\n", 1),                  # an alias, called on the next line
        ("core = self.state.core\n", 1),                          # an alias of a deeper holder
        ("c = getattr(state, 'core')\n", 1),                      # by name
        ("c = getattr(state, 'core', None)\n", 1),
        ("f = operator.attrgetter('core.zero_grad')\n", 1),
        ("handles, c = state.handles, state.core\n", 1),          # tuple unpacking
        ("run(state.core)\n", 1),                                 # an argument
        ("run(x=state._core)\n", 1),                              # the private name too
        ("c = vars(state)['core']\n", 1),
        ("c = state.__dict__['core']\n", 1),
        ("c = [s.core for s in states]\n", 1),
        ("match state:\n    case ZeroState(core=c):\n        pass\n", 2),
        ("state.core = other\n", 1),                              # written
        ("if state.core is None:\n    pass\n", 1),                # even only tested
    ]
    for source, line in aliases:
        assert core_called_directly({"runtime/module.py": source}) == [f"runtime/module.py:{line}"], source
    allowed = {"runtime/module.py": "state.handles.reduction.zero_grad(True)\ncores = 4\nscore = x.score\n"
                                    "getattr(state, 'handles')\n",
               "integrations/_lightning_strategy.py": "x = pl.core.optimizer.LightningOptimizer\n",
               "tools/core_handles.py": "f = core.zero_grad\nc = self._core\nstate = ZeroState(core=core)\n"}
    assert core_called_directly(allowed) == []
    # Only the named expression is exempt in the named file.
    assert core_called_directly({"integrations/_lightning_strategy.py": "c = state.core\n",
                                 "runtime/module.py": "x = pl.core.optimizer\n"}) == \
        ["integrations/_lightning_strategy.py:1", "runtime/module.py:1"]
