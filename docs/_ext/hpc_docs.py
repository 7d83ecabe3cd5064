"""Sphinx directives that render documentation from the code, so it cannot drift.

``.. hpc-launchers::``
    The detection order: one row per entry of :data:`hpc.environments.ORDER`, with the
    comment written above that entry in ``hpc/environments/__init__.py``.
``.. hpc-docstring:: MODULE``
    A module's docstring (the variable tables of ``hpc.environments.*``), parsed as
    reStructuredText without registering the module a second time (the API reference
    owns the ``py:module`` targets). ``:tables:`` keeps only its tables, ``:optional:``
    renders nothing while the module does not exist. Use it in ``.rst`` pages.
``.. hpc-api:: PACKAGE``
    ``automodule`` for the package and every public submodule found on disk (modules
    landing later appear without editing the docs; ``:optional:`` renders nothing while
    the package does not exist). Re-exported names are documented
    where they are defined, not again in each package that re-exports them.
``.. hpc-api-coverage:: PACKAGE``
    A warning (an error under ``-W``) naming every public module that no ``hpc-api``
    line in ``docs/api/*.rst`` covers: each package folder has its page, none is a
    catch-all.
``.. hpc-reexports:: PACKAGE``
    A table of the names ``PACKAGE.__all__`` re-exports, linking to their definitions.
``.. hpc-toctree::`` / ``.. hpc-ifdoc:: DOC`` / ``.. hpc-ifmodule:: MODULE``
    A toctree, and blocks of content, kept only for documents or modules that exist
    (optional pages and modules, e.g. ``hpc.submit`` without submitit installed).

A ``missing-reference`` handler resolves ``hpc.init_torch``-style references to the
object's defining module (``hpc.bootstrap.distributed.init_torch``) and short names such as
``DistInfo`` written in docstrings of other modules (a fuzzy lookup, as a leading ``.``
would do). Private ``hpc._x`` names (e.g. a private base class) stay plain text; anything
else still unresolved stays a nitpicky warning.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.directives.other import TocTree
from sphinx.util import logging as sphinx_logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

ROOT = Path(__file__).resolve().parents[2]
_BORDER = re.compile(r"^=+( +=+)+\s*$")
logger = sphinx_logging.getLogger(__name__)
_API_LINE = re.compile(r"^\.\. (hpc-api):: *(\S+)", re.MULTILINE)


def order_comments() -> dict[str, str]:
    """``{class name: comment above it}`` for the entries of ``ORDER``, from the source."""
    path = ROOT / "hpc" / "environments" / "__init__.py"
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if not (isinstance(target, ast.Name) and target.id == "ORDER"):
            continue
        value = node.value  # type: ignore[attr-defined]
        for elt in value.elts:
            comment: list[str] = []
            i = elt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                comment.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            out[elt.id if isinstance(elt, ast.Name) else ast.unparse(elt)] = " ".join(comment)
    return out


def _parse_rst(directive: SphinxDirective, text: str, source: str) -> list[nodes.Node]:
    """Parse generated reStructuredText in place (section titles allowed)."""
    container = nodes.section()  # nested_parse_with_titles needs a section-like parent
    lines = StringList(text.splitlines(), source=source)
    nested_parse_with_titles(directive.state, lines, container)
    return list(container.children)


class LaunchersDirective(SphinxDirective):
    """The detection order table."""

    def run(self) -> list[nodes.Node]:
        from hpc.environments import ORDER

        comments = order_comments()
        rows = [".. list-table::", "   :header-rows: 1", "   :widths: 5 15 30 50", "",
                "   * - #", "     - ``launcher``", "     - environment", "     - why here"]
        for i, env in enumerate(ORDER, start=1):
            why = comments.get(env.__name__) or "(same group as the row above)"
            rows += [f"   * - {i}", f"     - ``{env.name}``",
                     f"     - :class:`{env.__module__}.{env.__qualname__}`", f"     - {why}"]
        self.env.note_dependency(str(ROOT / "hpc" / "environments" / "__init__.py"))
        return _parse_rst(self, "\n".join(rows), "<hpc-launchers>")


class EnvvarsDirective(SphinxDirective):
    """The table of the ``HPC_*`` variables, from :data:`hpc.envvars.VARIABLES`."""

    def run(self) -> list[nodes.Node]:
        from hpc import envvars

        self.env.note_dependency(str(ROOT / "hpc" / "envvars.py"))
        return _parse_rst(self, envvars.rst_table(), "<hpc-envvars>")


def docstring_tables(text: str) -> str:
    """Only the simple tables (``====  ====`` borders) of a cleaned docstring."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        if _BORDER.match(lines[i]):
            j = i + 1
            while j < len(lines) and not (
                    _BORDER.match(lines[j]) and (j + 1 == len(lines) or not lines[j + 1].strip())):
                j += 1
            out += lines[i:j + 1] + [""]
            i = j + 1
        else:
            i += 1
    return "\n".join(out)


class DocstringDirective(SphinxDirective):
    """A module's docstring (or with ``:tables:`` only its tables), parsed as RST."""

    required_arguments = 1
    option_spec = {"tables": directives.flag, "optional": directives.flag}

    def run(self) -> list[nodes.Node]:
        try:
            module = importlib.import_module(self.arguments[0])
        except ModuleNotFoundError as e:
            if "optional" in self.options and e.name == self.arguments[0]:
                return []  # not landed yet
            raise
        if module.__file__:
            self.env.note_dependency(module.__file__)
        text = inspect.cleandoc(module.__doc__ or "")
        if "tables" in self.options:
            text = docstring_tables(text)
        return _parse_rst(self, text, f"<docstring of {module.__name__}>")


def public_modules(package: str) -> list[str]:
    """``package`` and its public submodules (no ``_private`` parts), sorted."""
    pkg = importlib.import_module(package)
    names = [package]
    if hasattr(pkg, "__path__"):
        for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return sorted(names)


def reexported(module: Any) -> list[str]:
    """Names in ``module.__all__`` defined elsewhere (documented at their definition)."""
    out = []
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name, None)
        home = getattr(obj, "__module__", None)
        if home and home != module.__name__ and (inspect.isclass(obj) or callable(obj)):
            out.append(name)
    return out


class ApiDirective(SphinxDirective):
    """``automodule`` for a package and its public submodules."""

    required_arguments = 1
    option_spec = {"exclude": directives.unchanged, "optional": directives.flag}

    def run(self) -> list[nodes.Node]:
        skip = set((self.options.get("exclude") or "").split())
        try:
            names = public_modules(self.arguments[0])
        except ModuleNotFoundError as e:
            if "optional" in self.options and e.name == self.arguments[0]:
                return []  # not landed yet
            raise
        lines: list[str] = []
        for name in names:
            if name in skip:
                continue
            module = importlib.import_module(name)
            if module.__file__:
                self.env.note_dependency(module.__file__)
            lines += _automodule_lines(name)
        return _parse_rst(self, "\n".join(lines), f"<hpc-api {self.arguments[0]}>")


def _automodule_lines(name: str) -> list[str]:
    """A section titled ``name`` holding its ``automodule`` (re-exports excluded)."""
    lines = [f"``{name}``", "-" * (len(name) + 4), "", f".. automodule:: {name}",
             "   :undoc-members:"]
    again = reexported(importlib.import_module(name))
    if again:
        lines.append(f"   :exclude-members: {', '.join(again)}")
    return lines + [""]


def module_exists(name: str) -> bool:
    """True when ``name`` imports; False only when that very module is missing (a
    missing dependency of an existing module still raises)."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return False
        raise
    return True


class ApiCoverageDirective(SphinxDirective):
    """Fail the build when a public module of PACKAGE is on no API page.

    Every page of ``docs/api/`` documents one package folder with ``hpc-api``; there is
    no catch-all page, so a module outside every folder (or a new top-level module) must
    be given a place. The pages are scanned as text, not through the build, so the
    result does not depend on the order in which Sphinx reads documents. Renders
    nothing.
    """

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        here = Path(self.env.doc2path(self.env.docname)).parent
        covered: set[str] = set()
        for page in here.glob("*.rst"):
            self.env.note_dependency(str(page))
            for match in _API_LINE.finditer(page.read_text(encoding="utf-8")):
                if module_exists(match.group(2)):
                    covered.update(public_modules(match.group(2)))
        package = self.arguments[0]
        missing = [m for m in public_modules(package) if m not in covered and m != package]
        if missing:
            logger.warning("public modules on no API page: %s (add an hpc-api line to the "
                           "page of their package in docs/api/)", ", ".join(missing),
                           location=self.get_location())
        return []


class ReexportsDirective(SphinxDirective):
    """Table of re-exported names with links to their definitions."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module = importlib.import_module(self.arguments[0])
        rows = [".. list-table::", "   :header-rows: 1", "", "   * - name",
                "     - defined in", "     - summary"]
        for name in reexported(module):
            obj = getattr(module, name)
            doc = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
            rows += [f"   * - ``{module.__name__}.{name}``",
                     f"     - :py:obj:`{obj.__module__}.{obj.__qualname__}`",
                     f"     - {doc or ' '}"]
        return _parse_rst(self, "\n".join(rows), f"<hpc-reexports {module.__name__}>")


class OptionalTocTree(TocTree):
    """A toctree whose entries that are not (yet) documents are dropped."""

    def run(self) -> list[nodes.Node]:
        found = self.env.found_docs
        self.content = StringList(
            [line for line in self.content if not line.strip() or line.strip() in found],
            parent=self.content.parent if hasattr(self.content, "parent") else None)
        return super().run()


class IfDocDirective(SphinxDirective):
    """Content kept only when the document named in the argument exists."""

    required_arguments = 1
    has_content = True

    def run(self) -> list[nodes.Node]:
        if self.arguments[0] not in self.env.found_docs:
            return []
        container = nodes.container()
        self.state.nested_parse(self.content, self.content_offset, container)
        return list(container.children)


class IfModuleDirective(SphinxDirective):
    """Content kept only when the module named in the argument can be imported."""

    required_arguments = 1
    has_content = True

    def run(self) -> list[nodes.Node]:
        if not module_exists(self.arguments[0]):
            return []
        container = nodes.container()
        self.state.nested_parse(self.content, self.content_offset, container)
        return list(container.children)


def _canonical(target: str) -> str | None:
    """``hpc.init_torch`` -> ``hpc.bootstrap.distributed.init_torch`` (importing the object)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        if inspect.ismodule(obj):
            return obj.__name__ if obj.__name__ != target else None
        home = getattr(obj, "__module__", None)
        qual = getattr(obj, "__qualname__", None)
        if home and qual and f"{home}.{qual}" != target:
            return f"{home}.{qual}"
        return None
    return None


def _copy(node: Any, **attrs: Any) -> Any:
    """A copy of the pending reference ``node`` with ``attrs`` set."""
    copy = node.deepcopy()
    for key, value in attrs.items():
        copy[key] = value
    return copy


def resolve_missing(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    """Retry unresolved ``py`` references: canonical name, then a fuzzy lookup."""
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target = node["reftarget"]

    def resolve(name: str, **attrs: Any) -> Any:
        return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], name,
                                   _copy(node, **attrs), contnode)

    if target.startswith("hpc.") and any(p.startswith("_") for p in target.split(".")):
        return contnode  # private (a base class shown by show-inheritance): not documented
    if target.startswith("hpc."):
        canonical = _canonical(target)
        found = resolve(canonical, reftarget=canonical) if canonical else None
        if found is not None:
            return found
    if "." not in target and not node.get("refspecific"):
        found = resolve(target, refspecific=True)
        if found is not None:
            return found
        # A name imported into the docstring's module, e.g. DistributedSampler.
        module = node.get("py:module")
        canonical = _canonical(f"{module}.{target}") if module else None
        if canonical and not canonical.startswith("hpc."):
            if app.config.intersphinx_mapping:
                from sphinx.ext.intersphinx import missing_reference

                return missing_reference(app, env, _copy(node, reftarget=canonical), contnode)
            return contnode  # offline: external names stay plain text (see conf.py)
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("hpc-launchers", LaunchersDirective)
    app.add_directive("hpc-envvars", EnvvarsDirective)
    app.add_directive("hpc-docstring", DocstringDirective)
    app.add_directive("hpc-api", ApiDirective)
    app.add_directive("hpc-api-coverage", ApiCoverageDirective)
    app.add_directive("hpc-reexports", ReexportsDirective)
    app.add_directive("hpc-toctree", OptionalTocTree)
    app.add_directive("hpc-ifdoc", IfDocDirective)
    app.add_directive("hpc-ifmodule", IfModuleDirective)
    app.connect("missing-reference", resolve_missing)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
