"""autotp's own bugs surface: every name imported inside a function exists, and no broad ``except`` turns an
ImportError, NameError or AttributeError of autotp's code into a verdict (a skipped FLOPs count, a refused op,
a "not a checkpoint")."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

from autotp.errors import own_bug

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"autotp": ROOT / "autotp", "autotp.passes": ROOT / "passes", "autotp.cli": ROOT / "cli"}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out.append((".".join([package, *parts]), path))
    return out


def _lazy_imports(module: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import inside a function body of ``path``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, None) for a in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".")[: len(module.split(".")) - child.level + (path.name == "__init__.py")]
                    base = ".".join([*package, *([child.module] if child.module else [])])
                found.extend((child.lineno, base, a.name) for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name.split(".")[0]) is not None


def test_every_lazy_import_resolves() -> None:
    """A name imported inside a function (to keep ``--help`` fast, or torch out of a light module) is imported
    here, so one removed or renamed (as ``check_fsdp_plan`` once was, silently) fails this test, not a run."""
    missing, checked = [], 0
    for module, path in _modules():
        for line, base, name in _lazy_imports(module, path):
            if not base.startswith("autotp") and not _installed(base):
                continue  # an optional package (tensorboard, transformers) the function asks for when used
            checked += 1
            try:
                mod = importlib.import_module(base)
                if name is not None and name != "*" and not hasattr(mod, name):
                    importlib.import_module(f"{base}.{name}")  # `from package import submodule`
            except ImportError as exc:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {base}{'.' + name if name else ''}: {exc}")
    assert checked > 100
    assert not missing, "\n".join(missing)


def _broad(handler: ast.ExceptHandler) -> bool:
    def broad(t: ast.expr) -> bool:
        return isinstance(t, ast.Name) and t.id in ("Exception", "BaseException")
    return handler.type is None or broad(handler.type) or \
        (isinstance(handler.type, ast.Tuple) and any(broad(e) for e in handler.type.elts))


def _guarded(handler: ast.ExceptHandler) -> bool:
    """The handler's first statement re-raises autotp's own bugs (``if own_bug(exc): raise``), or tells apart
    the one failure it means and re-raises the rest first (``if not keyed_by_size(exc): raise``), or it
    re-raises whatever it caught."""
    first = handler.body[0]
    if isinstance(first, ast.If) and [type(s) for s in first.body] == [ast.Raise] and first.body[0].exc is None:
        test = first.test
        if isinstance(test, ast.Call) and getattr(test.func, "id", "") == "own_bug":
            return isinstance(test.args[0], ast.Name) and test.args[0].id == handler.name
        return True
    return any(isinstance(s, ast.Raise) and s.exc is None for s in handler.body)


def test_every_broad_except_reraises_autotp_bugs() -> None:
    """``except Exception`` (bare, BaseException, or in a tuple) anywhere in autotp, cli or passes lets
    autotp's own ImportError/NameError/AttributeError through first (:func:`autotp.errors.own_bug`)."""
    unguarded, broad = [], 0
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and _broad(node):
                broad += 1
                if not _guarded(node):
                    unguarded.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert broad > 10
    assert not unguarded, "broad excepts that may swallow autotp's own bug:\n" + "\n".join(unguarded)


def _raise_in(module_name: str, source: str) -> BaseException:
    """The exception ``source`` raises when run as code of module ``module_name``."""
    scope = {"__name__": module_name}
    try:
        exec(compile(source, f"<{module_name}>", "exec"), scope)
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever it raised
        return exc
    raise AssertionError("no exception")


def test_own_bug_tells_autotp_code_from_the_users() -> None:
    for source in ("from autotp.parallel.fsdp import check_fsdp_plan", "undefined_name + 1",
                   "import torch\ntorch.no_such_function()", "(1).no_such_attribute", "import autotp_gone_module"):
        assert own_bug(_raise_in("autotp.cli.shard", source)), source
        assert not own_bug(_raise_in("_autotp_model_user", source)), source  # the user's model file
    # errors that are verdicts, not code errors, are never autotp's bug wherever raised
    assert not own_bug(_raise_in("autotp.analysis.torch_rules", "raise ValueError('sizes')"))
    assert not own_bug(_raise_in("autotp.analysis.torch_rules", "import torch\ntorch.ones(2) @ torch.ones(3)"))
    # raised in torch's own logic (not a missing name looked up by autotp): torch's, as it was
    assert not own_bug(_raise_in("autotp.x", "import torch\ntorch.nn.utils.clip_grad_norm_([1.0], 1.0)"))


def test_preflight_shows_a_removed_function(monkeypatch, tmp_path: Path) -> None:
    """The FLOPs count before any rank starts: an import of autotp's that fails is raised, not a silent None
    (which dropped MFU from every --fsdp run)."""
    import autotp.analysis.flops
    from autotp.capture.modelfile import load_model_file
    from autotp.cli.shard import preflight

    mf = load_model_file(str(ROOT / "examples" / "nanogpt.py"))
    assert preflight(mf, 2) > 0
    monkeypatch.delattr(autotp.analysis.flops, "node_flops")
    with pytest.raises(ImportError, match="node_flops"):
        preflight(mf, 2)


def test_a_pass_with_a_bug_is_not_a_pass_error(monkeypatch) -> None:
    """The pass runner wraps a failing pass in PassError (which passes ran before it); a NameError of the pass's
    own code stays a NameError."""
    import torch
    import torch.fx as fx

    from autotp.passes import PassError, run_passes

    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    scope = {"__name__": "autotp.passes.broken"}
    exec("def broken(gm, plan):\n    return gm_typo\n", scope)
    with pytest.raises(NameError):
        run_passes(gm, None, [scope["broken"]])
    exec("def refuses(gm, plan):\n    raise RuntimeError('no')\n", scope)
    with pytest.raises(PassError, match="pass refuses failed"):
        run_passes(gm, None, [scope["refuses"]])
