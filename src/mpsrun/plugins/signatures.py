"""Plugin and optimizer signatures read from source, so `validate` and `plugins` need no torch.

Why: checking a recipe's arguments only needs each callable's signature, type hints
and docstring, but importing the built-in plugins or `torch.optim` costs the whole
torch import (1.5 s on a 2-core CPU, more on a GPU machine). For code whose source
we can read and whose annotations and defaults are plain (literals; names imported
from `typing`; `Tensor` in torch's optimizers), a stand-in function is compiled from
the `def` alone: same parameters, defaults, annotations and docstring, no body.

Faithfulness rules (anything else falls back to importing the real thing):
- only mpsrun's own built-in plugins (never a third-party plugin: its module may
  register things, patch things, or compute defaults at import time), and only
  torch.optim classes listed in its `__init__` that derive from `Optimizer`;
- every default must be a literal (`ast.literal_eval`), every annotation must
  evaluate with only the names the module imports from `typing` (plus `Tensor`, a
  stand-in class of that name, and torch's `ParamsT`), and no decorators;
- if the module is already imported, the real object is used.
`tests/test_startup.py` compares every stand-in with the real callable: signature,
docstring, and the argument checks' verdicts on a set of probe values.
"""

from __future__ import annotations

import __future__
import ast
import copy
import importlib.util
import sys
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

BUILTIN_PREFIX = "mpsrun.plugins.builtin."


class Tensor:
    """Stands for torch.Tensor in optimizer hints: recipe values are never tensors, so only its name matters."""


def builtin_plugin(value: str, distribution: str, listing: bool = False) -> Callable[..., Any] | None:
    """A stand-in for entry point `module:attr` of mpsrun's own built-ins, or None to import the real one.

    `listing`: for `mpsrun plugins`, which shows annotations as written and never evaluates
    them, so a hint naming a class of the module (zoo's `Arch`) is no reason to import it.
    """
    module, _, attr = value.partition(":")
    if distribution != "mpsrun" or not module.startswith(BUILTIN_PREFIX) or "." in attr or module in sys.modules:
        return None
    path = _source_path(module)
    if path is None:
        return None
    tree = _parse(str(path))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == attr), None)
    if node is None:
        return None
    return _stand_in(node, tree, str(path), {}, hints=not listing)


def optimizer_classes() -> dict[str, Callable[..., Any]] | None:
    """torch.optim's optimizers by lower-case name, as stand-ins read from torch's source; None if any cannot be."""
    if "torch.optim" in sys.modules:
        return None
    return _optimizers()


@lru_cache(maxsize=1)
def _optimizers() -> dict[str, Callable[..., Any]] | None:
    spec = importlib.util.find_spec("torch")  # top-level: finds, does not import
    if spec is None or spec.origin is None:
        return None
    optim = Path(spec.origin).parent / "optim"
    exported: list[tuple[str, ast.ClassDef, ast.Module, Path]] = []  # what `torch.optim` re-exports, as written
    for node in _parse(str(optim / "__init__.py")).body:
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.optim.")):
            continue
        src = optim / f"{node.module.rpartition('.')[2]}.py"  # type: ignore[union-attr]
        if not src.is_file():
            continue
        tree = _parse(str(src))
        for alias in node.names:
            cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == alias.name), None)
            if cls is not None and (alias.asname or alias.name) == alias.name:
                exported.append((alias.name, cls, tree, src))
    optimizers = {"Optimizer"}
    for _ in exported:  # subclasses of subclasses (AdamW(Adam)), whatever the order
        optimizers |= {n for n, c, _, _ in exported if any(isinstance(b, ast.Name) and b.id in optimizers for b in c.bases)}
    out: dict[str, Callable[..., Any]] = {}
    for name, cls, tree, src in exported:
        if name not in optimizers or name == "Optimizer":
            continue
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        extra = {"Tensor": Tensor, "ParamsT": Any}
        fn = None if init is None else _stand_in(init, tree, str(src), extra, name=name, method=True)
        if fn is None:
            return None  # one we cannot read faithfully (an inherited __init__, say): import torch for all
        out[name.lower()] = fn
    return out or None


def _source_path(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)  # imports the parent packages only (mpsrun.plugins.builtin: no torch)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


@lru_cache(maxsize=64)
def _parse(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def _typing_names(tree: ast.Module) -> dict[str, Any]:
    """The names a module imports from `typing` (`from typing import X` and `import typing`)."""
    ns: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "typing" and not node.level:
            for a in node.names:
                if a.name == "*" or not hasattr(typing, a.name):
                    return {}
                ns[a.asname or a.name] = getattr(typing, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "typing":
                    ns[a.asname or "typing"] = typing
    return ns


def _stand_in(node: ast.FunctionDef, tree: ast.Module, filename: str, extra: dict[str, Any], name: str | None = None, method: bool = False, hints: bool = True) -> Callable[..., Any] | None:
    """Compile `def node(...)` with the body replaced; None unless defaults are literals and hints evaluate.

    `method`: an `__init__`, whose `self` is dropped, as `inspect.signature` of the class drops it.
    """
    if node.decorator_list:
        return None
    args = node.args
    if method:
        positional = [*args.posonlyargs, *args.args]
        if not positional or positional[0].arg != "self" or len(args.defaults) >= len(positional):
            return None
        args = ast.arguments(
            posonlyargs=args.posonlyargs[1:],
            args=args.args[1:] if not args.posonlyargs else args.args,
            vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults, kwarg=args.kwarg, defaults=args.defaults,
        )
    constants = _constants(tree)
    inline = _Inline(constants)
    defaults = [inline.visit(copy.deepcopy(d)) for d in args.defaults]
    kw_defaults = [None if d is None else inline.visit(copy.deepcopy(d)) for d in args.kw_defaults]
    for d in [*defaults, *(d for d in kw_defaults if d is not None)]:
        try:
            ast.literal_eval(d)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    args = ast.arguments(
        posonlyargs=args.posonlyargs, args=args.args, vararg=args.vararg, kwonlyargs=args.kwonlyargs,
        kw_defaults=kw_defaults, kwarg=args.kwarg, defaults=defaults,
    )
    body: list[ast.stmt] = []
    doc = ast.get_docstring(node, clean=False)
    if doc is not None:
        body.append(node.body[0])
    body.append(ast.Raise(exc=ast.Call(func=ast.Name("NotImplementedError", ast.Load()), args=[], keywords=[]), cause=None))
    fn_node = ast.FunctionDef(name=node.name, args=args, body=body, decorator_list=[], returns=None, type_comment=None, **_type_params())
    module = ast.Module(body=[fn_node], type_ignores=[])
    ast.fix_missing_locations(module)
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names) for n in tree.body)
    flags = __future__.annotations.compiler_flag if future else 0
    ns: dict[str, Any] = {"__builtins__": __builtins__, "__name__": "mpsrun.plugins.signatures._static", **_typing_names(tree), **extra}
    try:
        exec(compile(module, filename, "exec", flags=flags, dont_inherit=True), ns)
        fn = ns[node.name]
        if hints:
            typing.get_type_hints(fn)  # every hint must resolve here, or the checks would differ
    except Exception:
        return None
    fn.__qualname__ = fn.__name__ = name or node.name
    fn.__mpsrun_static__ = True  # type: ignore[attr-defined]
    return fn


def _constants(tree: ast.Module) -> dict[str, Any]:
    """Module-level names bound once, to a literal (`EPS = 1e-7`): defaults may use them."""
    seen: dict[str, int] = {}
    values: dict[str, Any] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name):
                seen[t.id] = seen.get(t.id, 0) + 1
                try:
                    values[t.id] = ast.literal_eval(node.value) if node.value is not None else _NO  # type: ignore[union-attr]
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    values[t.id] = _NO
    return {k: v for k, v in values.items() if seen[k] == 1 and v is not _NO}


_NO = object()


class _Inline(ast.NodeTransformer):
    """Replace names of module constants by their literal values."""

    def __init__(self, constants: dict[str, Any]) -> None:
        self.constants = constants

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.constants:
            return ast.copy_location(ast.Constant(self.constants[node.id]), node)
        return node


def _type_params() -> dict[str, Any]:
    return {"type_params": []} if sys.version_info >= (3, 12) else {}
