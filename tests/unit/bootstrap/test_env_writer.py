"""One writer of ``os.environ`` in hpc.bootstrap (issue 24): the phases return the
variables they want set, ``hpc.bootstrap.distributed._export`` applies them.

The check reads the source with :mod:`ast`, so a new ``os.environ[...] = ...`` anywhere
else in the package fails here rather than in review. It counts as a write:

* assigning, augmenting or deleting an item of ``os.environ`` (or ``from os import
  environ``), and calling ``update``/``setdefault``/``pop``/``popitem``/``clear``/
  ``__setitem__``/``__delitem__`` on it, or ``|=`` to it;
* the same through a local name bound to it (``env = os.environ if e is None else e``)
  or through a parameter annotated ``MutableMapping`` (a caller may hand it
  ``os.environ``, as ``init_torch`` once did to the network phase);
* ``os.putenv``/``os.unsetenv``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import hpc.bootstrap

PACKAGE = Path(hpc.bootstrap.__file__).parent
#: The one module that writes the environment, and its one function that does.
WRITER, WRITER_FUNCTION = "distributed", "_export"

MUTATORS = frozenset({"update", "setdefault", "pop", "popitem", "clear", "__setitem__",
                      "__delitem__"})
PROCESS_CALLS = frozenset({"putenv", "unsetenv"})


@dataclass
class _OsNames:
    """How a module spells ``os``, ``os.environ`` and ``os.putenv``/``unsetenv``."""

    modules: set[str] = field(default_factory=set)
    environs: set[str] = field(default_factory=set)
    calls: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, tree: ast.Module) -> _OsNames:
        names = cls()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.modules |= {a.asname or a.name for a in node.names if a.name == "os"}
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                for a in node.names:
                    if a.name == "environ":
                        names.environs.add(a.asname or a.name)
                    elif a.name in PROCESS_CALLS:
                        names.calls.add(a.asname or a.name)
        return names


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``, not those of the functions and lambdas nested in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _may_be_environ(node: ast.AST, aliases: set[str], os_names: _OsNames) -> bool:
    """Whether ``node`` may evaluate to ``os.environ`` itself (not a copy, not a value)."""
    if isinstance(node, ast.Attribute):
        return (node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id in os_names.modules)
    if isinstance(node, ast.Name):
        return node.id in aliases or node.id in os_names.environs
    if isinstance(node, ast.IfExp):
        return any(_may_be_environ(n, aliases, os_names) for n in (node.body, node.orelse))
    if isinstance(node, ast.BoolOp):
        return any(_may_be_environ(n, aliases, os_names) for n in node.values)
    if isinstance(node, ast.NamedExpr):
        return _may_be_environ(node.value, aliases, os_names)
    return False


def _params(scope: ast.AST) -> list[ast.arg]:
    """The parameters of a function or lambda (none for the module)."""
    if not isinstance(scope, _SCOPES):
        return []
    a = scope.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]


def _mutable_params(scope: ast.AST) -> set[str]:
    """Parameters annotated ``MutableMapping``: a caller may hand them ``os.environ``."""
    return {p.arg for p in _params(scope)
            if p.annotation is not None and "MutableMapping" in ast.unparse(p.annotation)}


def _aliases(nodes: list[ast.AST], start: set[str], os_names: _OsNames) -> set[str]:
    """``start`` and the names of ``nodes`` bound to what may be ``os.environ``."""
    aliases = set(start)
    while True:
        found = set(aliases)
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                if node.value is None or not _may_be_environ(node.value, aliases, os_names):
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {t.id for t in targets if isinstance(t, ast.Name)}
        if found == aliases:
            return aliases
        aliases = found


def _is_write(node: ast.AST, aliases: set[str], os_names: _OsNames) -> bool:
    """Whether the statement or call ``node`` writes ``os.environ`` (see the module
    docstring); ``aliases``: the names that may hold it here."""
    def env(n: ast.AST) -> bool:
        return _may_be_environ(n, aliases, os_names)

    if isinstance(node, (ast.Assign, ast.Delete)):
        return any(isinstance(t, ast.Subscript) and env(t.value) for t in node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        t = node.target
        return (isinstance(t, ast.Subscript) and env(t.value)) or (
            isinstance(node, ast.AugAssign) and env(t))
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute):
            if f.attr in MUTATORS and env(f.value):
                return True
            return (f.attr in PROCESS_CALLS and isinstance(f.value, ast.Name)
                    and f.value.id in os_names.modules)
        return isinstance(f, ast.Name) and f.id in os_names.calls
    return False


def _scope_writes(scope: ast.AST, name: str, inherited: set[str], os_names: _OsNames
                  ) -> Iterator[tuple[str, int, str]]:
    """The writes of ``scope`` and of the functions nested in it; ``inherited``: the
    enclosing scope's names for ``os.environ`` (a parameter of the same name hides one)."""
    nodes = list(_own_nodes(scope))
    shadowed = {p.arg for p in _params(scope)}
    aliases = _aliases(nodes, (inherited - shadowed) | _mutable_params(scope), os_names)
    for node in nodes:
        if _is_write(node, aliases, os_names):
            yield name, node.lineno, ast.unparse(node).splitlines()[0]
    for node in nodes:
        if isinstance(node, _SCOPES):
            inner = node.name if not isinstance(node, ast.Lambda) else "<lambda>"
            yield from _scope_writes(node, f"{name}.{inner}" if name else inner, aliases,
                                     os_names)


def environ_writes(source: str) -> list[tuple[str, int, str]]:
    """``(function, line, statement)`` of each write of ``os.environ`` in ``source``
    (function ``""``: module level)."""
    tree = ast.parse(source)
    return sorted(_scope_writes(tree, "", set(), _OsNames.of(tree)))


def _modules() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(PACKAGE.glob("*.py"))}


def test_only_the_writer_module_writes_os_environ() -> None:
    writers = {name: writes for name, source in _modules().items()
               if (writes := environ_writes(source))}
    others = {name: writes for name, writes in writers.items() if name != WRITER}
    assert not others, (
        f"only hpc.bootstrap.{WRITER} writes os.environ, but these modules do: {others}.\n"
        "HINT: return the variables from the phase (as flight_recorder_env does) and "
        f"let init_torch hand them to {WRITER}.{WRITER_FUNCTION}.")
    assert WRITER in writers, f"hpc.bootstrap.{WRITER} no longer writes: move WRITER"


def test_the_writer_writes_in_one_function() -> None:
    writes = environ_writes(_modules()[WRITER])
    assert {function for function, _, _ in writes} == {WRITER_FUNCTION}, writes


@pytest.mark.parametrize("source", [
    "import os\nos.environ['A'] = '1'",
    "import os\nos.environ.update({'A': '1'})",
    "import os\nos.environ.setdefault('A', '1')",
    "import os\nos.environ.pop('A', None)",
    "import os\ndel os.environ['A']",
    "import os\nos.environ |= {'A': '1'}",
    "import os\nos.putenv('A', '1')",
    "from os import environ as e\ne['A'] = '1'",
    "from os import unsetenv\nunsetenv('A')",
    # the shapes of the writes that threads, network and export_env made before
    "import os\ndef f(export=None):\n    (os.environ if export is None else export)['A'] = '1'",
    ("from collections.abc import MutableMapping\n"
     "def pin(environ: MutableMapping[str, str]) -> None:\n    environ.update({'A': '1'})"),
    ("import os\ndef f(environ=None):\n    env = os.environ if environ is None else environ\n"
     "    for k in 'ab':\n        env[k] = '1'"),
    "import os\ndef f():\n    env = os.environ\n    g = lambda: env.pop('A')",
    "import os\nclass C:\n    def m(self):\n        os.environ.clear()",
])
def test_the_check_sees_each_kind_of_write(source: str) -> None:
    assert environ_writes(source), source


@pytest.mark.parametrize("source", [
    "import os\nx = os.environ.get('A')\nd = dict(os.environ)\nd['A'] = '1'",
    ("import os\ndef f(environ=None):\n    env = os.environ if environ is None else environ\n"
     "    return {'A': '1'} if env.get('B') else {}"),
    ("from collections.abc import Mapping\ndef f(environ: Mapping[str, str]) -> dict:\n"
     "    out = {}\n    out.update(environ)\n    return out"),
    "import os\ndef f():\n    env = os.environ\n    def g(env: dict):\n        env['A'] = '1'",
])
def test_the_check_lets_reads_and_copies_pass(source: str) -> None:
    assert environ_writes(source) == [], source
