"""The environment-variable page cannot drift from the code.

* Every variable that code in ``hpc/`` reads — a literal passed to ``environ.get`` /
  ``os.environ.get`` / ``getenv`` / ``env_int(environ, ...)``, ``environ[...]``,
  ``"X" in environ``, or to any helper that forwards its argument to one of those — and
  every launcher-prefixed literal (``SLURM_*``, ``OMPI_*``, ``HPC_*``, ...) in ``hpc/``,
  plus every ``HPC_*`` variable of the scripts (``bin/``, ``slurm/``, ``.ci/``,
  ``bench/``, test helpers, ``docs/conf.py``), is documented: on ``docs/envvars.rst`` or in
  a module docstring that page renders (``.. hpc-docstring::``).
* Vice versa, every variable the page names (above its "read by other tools" part) is
  named somewhere in that code, so the page lists nothing stale.
* The ``HPC_*`` variables ``hpc/`` reads are exactly the table of :mod:`hpc.envvars`,
  which the page renders (``.. hpc-envvars::``); any other ``HPC_*`` name on the page is
  one that only the scripts read.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hpc import envvars

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "envvars.rst"
EXTERNAL_MARKER = ".. test_docs_envvars: the variables below are read by other tools"
SCRIPTS = [*sorted((ROOT / "bin").glob("*")), *sorted((ROOT / "slurm").rglob("*")),
           *sorted((ROOT / ".ci").glob("*")), *sorted((ROOT / "bench").glob("*.py")),
           ROOT / "tests" / "helpers.py", ROOT / "tests" / "conftest.py",
           ROOT / "docs" / "conf.py"]

#: What an environment variable looks like.
SHAPE = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")
#: Literals with these prefixes are launcher variables wherever they appear in hpc/.
PREFIXED = re.compile(
    r"^(SLURM|OMPI|PMIX?|MV2|MPI|HYDI|TORCHELASTIC|HPC|SUBMITIT|CUDA|NCCL|GLOO)_[A-Z0-9_]+$")
ENV_NAMES = {"environ", "env", "environment"}
ENVVARS_DIRECTIVE = ".. hpc-envvars::"


def _is_env(node: ast.AST) -> bool:
    """``environ``, ``env``, ``os.environ``, ``(environ or os.environ)``..."""
    if isinstance(node, ast.Name):
        return node.id in ENV_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    if isinstance(node, ast.BoolOp):
        return any(_is_env(v) for v in node.values)
    return False


def _const(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and SHAPE.match(node.value):
        return node.value
    return None


def _constants(node: ast.AST) -> set[str]:
    """Env-shaped literals in ``node`` (tuples included), not f-string fragments."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.JoinedStr):
            continue
        value = _const(sub)
        if value:
            out.add(value)
    return out


def _key_of_read(node: ast.AST) -> ast.AST | None:
    """The key expression when ``node`` reads an environment mapping, else None."""
    if isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop")
                and _is_env(func.value) and node.args):
            return node.args[0]
        if isinstance(func, (ast.Name, ast.Attribute)) and getattr(
                func, "id", getattr(func, "attr", "")) == "getenv" and node.args:
            return node.args[0]
    if isinstance(node, ast.Subscript) and _is_env(node.value):
        return node.slice
    if (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.In, ast.NotIn)) and _is_env(node.comparators[0])):
        return node.left
    return None


def _forwarding_functions(trees: list[ast.Module]) -> dict[str, set[int | str]]:
    """Functions that read the environment with one of their parameters as the key
    (``env_int(environ, key)``, a local ``pick(step_key, job_key)``): name -> positions
    and keyword names of those parameters."""
    out: dict[str, set[int | str]] = {}
    for tree in trees:
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.args]
            for node in ast.walk(fn):
                key = _key_of_read(node)
                if isinstance(key, ast.Name) and key.id in params:
                    out.setdefault(fn.name, set()).update({params.index(key.id), key.id})
    return out


def _loop_reads(tree: ast.Module) -> set[str]:
    """``for key in ("A", "B"): ... key in env`` reads A and B."""
    out: set[str] = set()
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)):
            continue
        var = loop.target.id
        used = any(isinstance(k, ast.Name) and k.id == var
                   for node in ast.walk(loop) for k in [_key_of_read(node)])
        if used:
            out |= _constants(loop.iter)
    return out


def read_in_code() -> dict[str, set[str]]:
    """Variables read by ``hpc/`` source: name -> files."""
    files = sorted((ROOT / "hpc").rglob("*.py"))
    trees = [ast.parse(f.read_text(encoding="utf-8"), str(f)) for f in files]
    forwarding = _forwarding_functions(trees)
    found: dict[str, set[str]] = {}

    def add(names: set[str], path: Path) -> None:
        for name in names:
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))

    for path, tree in zip(files, trees):
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                        ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            key = _key_of_read(node)
            if key is not None and _const(key):
                add({_const(key)}, path)  # type: ignore[arg-type]
            if isinstance(node, ast.Call):
                args = list(node.args)
                if any(_is_env(a) for a in args):  # helper(environ, "X", ("A", "B"), key="C")
                    add(set().union(*(_constants(a) for a in args if not _is_env(a)),
                                    *(_constants(k.value) for k in node.keywords)), path)
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                for pos in forwarding.get(name or "", ()):
                    if isinstance(pos, int) and pos < len(args) and _const(args[pos]):
                        add({_const(args[pos])}, path)  # type: ignore[arg-type]
                    for kw in node.keywords:
                        if kw.arg == pos and _const(kw.value):
                            add({_const(kw.value)}, path)  # type: ignore[arg-type]
            if (isinstance(node, ast.Constant) and id(node) not in docstrings
                    and isinstance(node.value, str) and PREFIXED.match(node.value)):
                add({node.value}, path)
        add(_loop_reads(tree), path)
    return found


def hpc_vars_in_scripts() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in SCRIPTS:
        if path.is_file():
            for name in re.findall(r"\bHPC_[A-Z0-9_]+\b", path.read_text(errors="replace")):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def all_names_in_code() -> set[str]:
    """Every env-shaped literal in hpc/ and every upper-case word of the scripts."""
    names: set[str] = set()
    for f in (ROOT / "hpc").rglob("*.py"):
        names |= _constants(ast.parse(f.read_text(encoding="utf-8")))
    for path in SCRIPTS:
        if path.is_file():
            names |= set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b",
                                    path.read_text(errors="replace")))
    return names


def literal_names(text: str) -> set[str]:
    """Variables named in ``double backticks``; ``_SIZE`` after ``OMPI_COMM_WORLD_RANK``
    (the docstrings' shorthand) expands to ``OMPI_COMM_WORLD_SIZE``."""
    names: set[str] = set()
    last = ""
    for inner in re.findall(r"``([^`]+)``", text):
        for word in re.findall(r"(?<![\w.])_?[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*(?![\w(])", inner):
            if word.startswith("_") and "_" in last:
                names.add(last.rsplit("_", 1)[0] + word)
            elif "_" in word or word in ("RANK", "NNODES", "PYTHONPATH"):
                names.add(word)
                last = word
    return names


def hpc_docs() -> ModuleType:
    """The Sphinx extension ``docs/_ext/hpc_docs.py``, whose readers the test shares so it
    sees what the build renders (imported on use: it needs Sphinx)."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        return importlib.import_module("hpc_docs")
    finally:
        sys.path.pop(0)


def without_absent_modules(page: str) -> str:
    """The page minus ``.. hpc-ifmodule:: X`` blocks whose module does not exist (yet):
    what the build renders."""
    out: list[str] = []
    skipping: int | None = None
    for line in page.splitlines():
        indent = len(line) - len(line.lstrip())
        if skipping is not None:
            if not line.strip() or indent > skipping:
                continue
            skipping = None
        match = re.match(r"^(\s*)\.\. hpc-ifmodule:: *(\S+)", line)
        if match and not hpc_docs().module_exists(match.group(2)):
            skipping = len(match.group(1))
            continue
        out.append(line)
    return "\n".join(out)


def rendered_docstrings(page: str) -> dict[str, str]:
    """Module -> docstring text for each ``.. hpc-docstring::`` on the page."""
    out: dict[str, str] = {}
    page = without_absent_modules(page)
    for match in re.finditer(r"^( *)\.\. hpc-docstring:: *(\S+)((?:\n\1   :\w+:.*)*)",
                             page, re.M):
        name, options = match.group(2), match.group(3)
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if ":optional:" in options and e.name == name:
                continue
            raise
        text = inspect.cleandoc(module.__doc__ or "")
        out[name] = hpc_docs().docstring_tables(text) if ":tables:" in options else text
    return out


def documented() -> tuple[set[str], set[str]]:
    """(all documented names, names on the page above the external section)."""
    page = without_absent_modules(PAGE.read_text(encoding="utf-8"))
    own, _, external = page.partition(EXTERNAL_MARKER)
    assert external, f"{PAGE.name} lost its marker line {EXTERNAL_MARKER!r}"
    names = literal_names(page)
    for text in rendered_docstrings(page).values():
        names |= literal_names(text)
    table = literal_names(envvars.rst_table()) if ENVVARS_DIRECTIVE in own else set()
    return names | table, literal_names(own) | table


def test_every_variable_read_is_documented() -> None:
    names, _ = documented()
    needed = {**hpc_vars_in_scripts()}
    for name, files in read_in_code().items():
        needed.setdefault(name, set()).update(files)
    missing = {n: sorted(f) for n, f in needed.items() if n not in names}
    assert not missing, (
        "variables read but not documented in docs/envvars.rst (or a module docstring it "
        f"renders with hpc-docstring): {missing}")


def test_every_documented_variable_is_read() -> None:
    _, own = documented()
    stale = sorted(own - all_names_in_code())
    assert not stale, (
        f"docs/envvars.rst names variables that nothing in hpc/ or the scripts uses: {stale} "
        f"(variables of other tools go below the line {EXTERNAL_MARKER!r})")


def test_the_hpc_variables_read_are_the_table() -> None:
    read = {n for n in read_in_code() if n.startswith("HPC_")}
    table = set(envvars.VARIABLES)
    assert read - table == set(), (
        f"hpc/ reads {sorted(read - table)}: add a row to hpc.envvars.VARIABLES and read "
        "it with hpc.envvars.value()")
    assert table - read == set(), f"hpc.envvars.VARIABLES rows nothing reads: {table - read}"


def test_the_page_renders_the_table_and_no_other_hpc_variable_of_the_package() -> None:
    page = without_absent_modules(PAGE.read_text(encoding="utf-8"))
    own = page.partition(EXTERNAL_MARKER)[0]
    assert ENVVARS_DIRECTIVE in own, f"{PAGE.name} lost {ENVVARS_DIRECTIVE!r}"
    scripts_only = set(hpc_vars_in_scripts()) - set(read_in_code())
    named = {n for n in literal_names(own) if n.startswith("HPC_")}
    stray = named - set(envvars.VARIABLES) - scripts_only
    assert not stray, (
        f"{PAGE.name} names {sorted(stray)}, neither in hpc.envvars.VARIABLES nor read by "
        "the scripts")


def test_page_renders_every_launcher_module() -> None:
    from hpc.environments import ORDER

    rendered = rendered_docstrings(PAGE.read_text(encoding="utf-8"))
    modules = {env.__module__ for env in ORDER}
    assert modules <= set(rendered), f"add .. hpc-docstring:: for {modules - set(rendered)}"


@pytest.mark.parametrize("source, expected", [
    ('environ.get("A_B")', {"A_B"}),
    ('os.environ.get("A_B", "1")', {"A_B"}),
    ('os.getenv("A_B")', {"A_B"}),
    ('env["A_B"]', {"A_B"}),
    ('"A_B" in environ', {"A_B"}),
    ('(environ or os.environ).get("A_B")', {"A_B"}),
    ('env_int(environ, "A_B", default=0)', {"A_B"}),
    ('_read(environ, "openmpi", ("A_B", "C_D"), job_key="E_F")', {"A_B", "C_D", "E_F"}),
    ('def f(k):\n    return environ.get(k)\nf("A_B")', {"A_B"}),
    ('for key in ("A_B", "C_D"):\n    if key in env:\n        pass', {"A_B", "C_D"}),
    ('x = "SLURM_SOMETHING"', {"SLURM_SOMETHING"}),
    ('log("A_B")', set()),
])
def test_extractor(source: str, expected: set[str], tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The patterns the scanner recognises (on a throw-away tree)."""
    pkg = tmp_path / "hpc"
    pkg.mkdir()
    (pkg / "m.py").write_text(source + "\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert set(read_in_code()) == expected


def test_blocks_of_absent_modules_are_dropped() -> None:
    page = ("a\n.. hpc-ifmodule:: hpc.no_such_module\n\n   ``X_Y``\n\n   more\nb\n"
            ".. hpc-ifmodule:: hpc.errors\n\n   ``Z_W``\n")
    assert without_absent_modules(page) == "a\nb\n.. hpc-ifmodule:: hpc.errors\n\n   ``Z_W``"


def test_literal_names_shorthand() -> None:
    text = "``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``; ``WORLD_SIZE / NNODES``"
    assert literal_names(text) == {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                   "OMPI_COMM_WORLD_LOCAL_RANK", "WORLD_SIZE", "NNODES"}
