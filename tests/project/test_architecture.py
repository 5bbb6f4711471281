"""The stages import one way, and state lives in one place (read from the source, nothing is imported)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"autotp": ROOT / "autotp", "autotp.passes": ROOT / "passes", "autotp.cli": ROOT / "cli"}

# Lowest first: a module may import its own layer and the layers before it, never a later one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("autotp.errors", "autotp.shard_spec"),  # the vocabulary: typed errors, how a tensor is cut
    ("autotp.combinations",),  # which sizes and options run together: the one rule every caller asks
    ("autotp.plan.plan", "autotp.plan.context"),  # the Plan's types: the contract analysis writes, passes read
    ("autotp.distributed",),  # the rank grid, process groups, the launcher
    ("autotp.operators",),  # operators the rewritten graph runs; they know no graph, plan or model
    ("autotp.capture",),  # the user's call as an exported graph
    ("autotp.analysis",),  # facts found in the graph
    ("autotp.plan",),  # the Plan (the contract) and the planner that writes it from the facts
    ("autotp.reports",),  # what a plan costs each rank for a batch: memory, communication, time
    ("autotp.options",),  # what parallelize is asked for, validated once
    ("autotp.passes",),  # graph rewrites that execute a Plan
    ("autotp.state",),  # what a parallelized model carries (TPState), and its one accessor
    ("autotp.io",),  # weights and checkpoints in and out of a model, read through the accessor
    ("autotp.parallel",),  # orchestration: parallelize() runs every stage and binds the result to a rank
    ("autotp.search",),  # the layout search over tp × dp × pp, and the hardware profiles it prices with
    ("autotp",),  # the public names
    ("autotp.cli",),  # the command line
)
# passes read the Plan and the graph: they never rediscover facts by running analysis or capture
FORBIDDEN = {"autotp.passes": ("autotp.analysis", "autotp.capture")}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every autotp module ``module`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*package, *([node.module] if node.module else [])])
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}  # `from autotp.x import y` may import module x.y
    return {n for n in names if n == "autotp" or n.startswith("autotp.")}


def import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for m, path in mods.items():
        g.add_edges_from((m, t) for t in _imports(m, path) if t in mods and t != m)
    return g


def layer(module: str) -> int:
    """The layer of ``module``: the longest prefix listed."""
    best = max((len(p), i) for i, names in enumerate(LAYERS) for p in names
               if module == p or module.startswith(p + "."))
    return best[1]


def test_every_module_has_a_layer() -> None:
    for m in _modules():
        assert LAYERS[layer(m)], m


def test_the_plan_contract_loads_no_stage() -> None:
    """Importing the Plan's module, with all it imports in turn, loads no capture, analysis, pass or runtime
    module: the contract stands alone."""
    reached = nx.descendants(import_graph(), "autotp.plan.plan")
    assert reached <= {"autotp.shard_spec", "autotp.errors", "autotp.plan.context"}, sorted(reached)


def test_no_stage_imports_a_later_stage() -> None:
    bad = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
           for a, b in import_graph().edges if layer(b) > layer(a)]
    assert not bad, "\n".join(bad)


def test_passes_read_facts_only() -> None:
    bad = [f"{a} imports {b}" for a, b in import_graph().edges
           for src, banned in FORBIDDEN.items() if a.startswith(src) and b.startswith(banned)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, cycles


def test_state_is_reached_through_its_accessor() -> None:
    where = [f"{path}:{node.lineno}" for m, path in _modules().items() if m != "autotp.state"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value == "_autotp"]
    assert not where, where


_MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove",
             "discard", "__setitem__"}


def _module_caches(path: Path) -> list[str]:
    """Module-level containers that code in the module changes (a cache or registry that outlives a call),
    and module-level functions wrapped in a memoising decorator."""
    tree = ast.parse(path.read_text())
    names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    target = t.value.id
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and isinstance(node.func.value, ast.Name):
            target = node.func.value.id
        elif isinstance(node, ast.Global):
            found += [f"{path}:{node.lineno}: global {', '.join(node.names)}"]
        if target in names:
            found.append(f"{path}:{node.lineno}: {target}")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                text = ast.unparse(d)
                if "cache" in text:
                    found.append(f"{path}:{node.lineno}: @{text} {node.name}")
    return found


def test_no_module_level_mutable_caches() -> None:
    found = [f for path in _modules().values() for f in _module_caches(path)]
    assert not found, found


@pytest.mark.parametrize("source, expected", [
    ("_SEEN = {}\ndef f(k):\n    _SEEN[k] = 1\n", 1),
    ("_SEEN = set()\ndef f(k):\n    _SEEN.add(k)\n", 1),
    ("import functools\n@functools.lru_cache\ndef f(k):\n    return k\n", 1),
    ("TABLE = {'a': 1}\ndef f(k):\n    d = {}\n    d[k] = TABLE[k]\n    return d\n", 0),
])
def test_cache_check_sees_caches(tmp_path: Path, source: str, expected: int) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert len(_module_caches(path)) == expected


# The one capture-then-plan function (autotp.parallel.planning.capture_and_plan): outside the capture stage
# nothing exports a model or calls capture's entry points, and outside the plan stage nothing calls the
# planner's; only the orchestration's planning module does, for everything that plans.
PLANNING = "autotp.parallel.planning"
ENTRIES = {
    "autotp.capture": ("autotp.capture.tracer", {"capture", "capture_blocks"}),
    "autotp.plan": ("autotp.plan.planner", {"make_plan", "plan_from_facts", "plan_from_analysis", "fused_segments"}),
}
CONTEXT_PLANNER = ("autotp.plan.context_planner", {"context_plan"})


def _is_torch_export(node: ast.AST) -> bool:
    """``torch.export`` (``torch.export.export(...)`` reaches it)."""
    return isinstance(node, ast.Attribute) and node.attr == "export" and isinstance(node.value, ast.Name) \
        and node.value.id == "torch"


def _captures_or_plans(module: str, tree: ast.AST) -> list[str]:
    """Where ``module`` (outside the capture stage, the plan stage and the planning module) exports a model or
    reaches capture's or the planner's entry points: ``torch.export``, an entry point imported by name, or
    the module that defines them imported whole."""
    if module == PLANNING:
        return []
    stages = [(defining, names) for stage, (defining, names) in (*ENTRIES.items(), ("autotp.plan", CONTEXT_PLANNER))
              if module != stage and not module.startswith(stage + ".")]
    exports = not module.startswith("autotp.capture")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if exports and node.module == "torch.export":
                found += [f"{module}:{node.lineno}: from torch.export import {a.name}" for a in node.names]
            for defining, names in stages:
                package, _, leaf = defining.rpartition(".")
                found += [f"{module}:{node.lineno}: {defining}.{a.name}" for a in node.names
                          if (node.module == defining and a.name in names) or (node.module == package and a.name == leaf)]
        elif isinstance(node, ast.Import):
            found += [f"{module}:{node.lineno}: import {a.name}" for a in node.names
                      for defining, _ in stages if a.name == defining]
        elif exports and _is_torch_export(node):
            found.append(f"{module}:{node.lineno}: torch.export")
    return found


@pytest.fixture(scope="module")
def trees() -> dict[str, ast.AST]:
    """Every module's syntax tree, parsed once for the tests below."""
    return {m: ast.parse(path.read_text()) for m, path in _modules().items()}


def test_only_capture_and_plan_captures_and_plans(trees: dict[str, ast.AST]) -> None:
    found = [f for m, tree in trees.items() for f in _captures_or_plans(m, tree)]
    assert not found, found


def test_capture_and_plan_is_written_once(trees: dict[str, ast.AST]) -> None:
    """One function captures then plans, and the plan cache's key is made in one place."""
    defined = {n.name for n in trees[PLANNING].body if isinstance(n, ast.FunctionDef)}
    assert "capture_and_plan" in defined and "plan_model" not in defined and "context_file" not in defined
    keyed = [f"{m}:{n.lineno}" for m, tree in trees.items() for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
             and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) == "plan_key"]
    assert [k.split(":")[0] for k in keyed] == [PLANNING], keyed


@pytest.mark.parametrize("module, source, expected", [
    ("autotp.cli.x", "from autotp.capture.tracer import capture\n", 1),
    ("autotp.cli.x", "from autotp.capture.tracer import stand_ins, meta_call\n", 0),
    ("autotp.cli.x", "from autotp.capture import tracer\n", 1),
    ("autotp.parallel.x", "import autotp.plan.planner\n", 1),
    ("autotp.parallel.x", "from autotp.plan.planner import make_plan, group_seq_grads\n", 1),
    ("autotp.search.x", "from autotp.plan.context_planner import context_plan\n", 1),
    ("autotp.plan.x", "from autotp.plan.planner import make_plan\n", 0),
    ("autotp.plan.x", "from autotp.capture.tracer import capture_blocks\n", 1),
    ("autotp.cli.x", "import torch\nep = torch.export.export(m, (x,))\n", 1),
    ("autotp.cli.x", "from torch.export import export\n", 1),
    ("autotp.capture.x", "import torch\nep = torch.export.export(m, (x,))\n", 0),
    (PLANNING, "from autotp.plan.planner import make_plan\n", 0),
])
def test_capture_check_sees_captures(module: str, source: str, expected: int) -> None:
    assert len(_captures_or_plans(module, ast.parse(source))) == expected


# what each refusal of a combination of sizes or options says: autotp/combinations.py alone says it, and the
# library, the launcher, the command line and the layout search ask it (issue: one validation of combinations)
_COMBINATION_REFUSALS = ("needs fsdp", "goes with fsdp", "to pipeline stages, and pp is",
                         "replica groups do not divide", "there is one: dp", "runs no pipeline stages",
                         "weight-gradient pass runs", "cannot hold to 1e-5", "does not run with fsdp",
                         "stages asked for")


def test_combinations_are_refused_in_one_place() -> None:
    texts = {m: path.read_text() for m, path in _modules().items()}
    assert [t for t in _COMBINATION_REFUSALS if t not in texts["autotp.combinations"]] == []
    where = [f"{m}: {t!r}" for m, text in texts.items() if m != "autotp.combinations"
             for t in _COMBINATION_REFUSALS if t in text]
    assert not where, where


def _layout_items() -> list[str]:
    """The README's "How the code is laid out": one text per numbered stage."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## How the code is laid out"):]
    section = section[:section.index("\nTests come in tiers")]
    return re.split(r"\n(?=\d+\. )", section)[1:]


def _readme_mismatch(items: list[str], tree: set[str], root: Path | None = ROOT) -> tuple[list[str], list[str]]:
    """Modules of ``tree`` (paths from the repository root) the items never name, and names they give that
    ``tree`` lacks. A bare ``x.py`` names a module of the packages its item names (``autotp/io/``, ``cli/``); a
    path names itself (or a file under ``root``: a test the text points to). A package's ``__init__.py`` is
    its item's heading, not a module to name."""
    named: set[str] = set()
    absent: list[str] = []
    for item in items:
        folders = re.findall(r"`((?:autotp/\w+|passes|cli)/)`", item)
        for name in re.findall(r"`([\w/]+\.py)`", item):
            found = {name} if "/" in name else {f + name for f in folders}
            hits = found & tree
            named |= hits
            if not hits and not ("/" in name and root is not None and (root / name).is_file()):
                absent.append(name)
    unnamed = sorted(m for m in tree - named
                     if not (m.endswith("/__init__.py") and m != "autotp/__init__.py"))
    return unnamed, absent


def test_readme_layout_matches_the_tree() -> None:
    tree = {path.relative_to(ROOT).as_posix() for path in _modules().values()}
    unnamed, absent = _readme_mismatch(_layout_items(), tree)
    assert (unnamed, absent) == ([], []), f"not in the README's code layout: {unnamed}; named, not in the tree: {absent}"


def test_readme_check_sees_a_mismatch() -> None:
    items = ["1. `autotp/io/`: weights (`weights.py`), gone (`old.py`); `autotp/errors.py`"]
    tree = {"autotp/io/weights.py", "autotp/io/export.py", "autotp/io/__init__.py", "autotp/errors.py"}
    assert _readme_mismatch(items, tree, root=None) == (["autotp/io/export.py"], ["old.py"])
