"""Sphinx configuration of the torch-hpc documentation.

Build (warnings are errors, as in CI)::

    sphinx-build -W --keep-going -n -b html docs docs/_build/html
    sphinx-build -W --keep-going -n -b doctest docs docs/_build/doctest

Intersphinx and offline builds
------------------------------
The build machines have no internet, so the Python and PyTorch inventories cannot be
fetched. Shipping copies of them would go stale silently, so intersphinx is opt-in:

* default (offline): no ``intersphinx_mapping``. References to objects *outside*
  torch-hpc (``torch.nn.Module`` in a signature, ``datetime.timedelta``...) cannot
  resolve, so they are listed in ``nitpick_ignore_regex`` by top-level package. References
  to ``hpc.*`` stay nitpicky: a broken internal link fails the build.
* ``HPC_DOCS_INTERSPHINX=1`` (a machine with internet): the mapping to docs.python.org
  and pytorch.org is set and the external ignores are dropped, so external links become
  real links. ``intersphinx_timeout`` keeps a flaky network from hanging the build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # the checkout's `hpc`, even when not installed

project = "torch-hpc"
author = "torch-hpc contributors"
copyright = "torch-hpc contributors"  # noqa: A001 - Sphinx's name
try:
    from hpc import __version__ as release
except ImportError:  # pragma: no cover - hpc is in sys.path above
    release = "0"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "myst_parser",
    "hpc_docs",  # docs/_ext/hpc_docs.py: tables generated from the code
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "Thumbs.db", ".DS_Store"]
nitpicky = True

# -- MyST --------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # `launching.md#master-port` style links

# -- autodoc / napoleon ------------------------------------------------------------------
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: dataclass fields are not described twice

# -- intersphinx (see the module docstring) ----------------------------------------------
ONLINE = os.environ.get("HPC_DOCS_INTERSPHINX") == "1"
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "torch": ("https://pytorch.org/docs/stable", None),
} if ONLINE else {}
intersphinx_timeout = 10
# Names that are in no inventory (TypeVars of decorators); ignored in both modes.
nitpick_ignore_regex = [("py:class", r"(hpc\.[\w.]+\.)?(F|T)")]
if not ONLINE:
    # Offline, every reference outside ``hpc`` (``torch.nn.Module``, ``typing.Optional``,
    # builtins) is unresolvable; ``hpc.*`` references stay checked.
    nitpick_ignore_regex += [
        (r"py:.*", r"(?!hpc\.)[A-Za-z_]\w*\.[\w.\[\], ]+"),
        (r"py:.*", r"(int|float|complex|str|bool|bytes|dict|list|tuple|set|frozenset|"
                   r"object|type|None|Ellipsis|\.\.\.)"),
    ]


def _no_prose_types(app, what, name, obj, options, lines):  # noqa: ANN001
    """Keep napoleon from reading prose before a colon as a type.

    Napoleon parses the first line of an attribute/data docstring as ``type: text``, so
    ``#: Derived ports live in [a, b): below ...`` would render "Derived ... b)" as a
    type. A leading ``: `` (empty type) stops that when the "type" is prose (has spaces).
    """
    if what in ("attribute", "data", "property") and lines:
        head, colon, _ = lines[0].partition(": ")
        if colon and " " in head.strip() and "`" not in head:
            lines[0] = ": " + lines[0]


def setup(app):  # noqa: ANN001, ANN201
    app.connect("autodoc-process-docstring", _no_prose_types, priority=400)


# -- doctest -----------------------------------------------------------------------------
doctest_global_setup = "import hpc"

# -- HTML --------------------------------------------------------------------------------
try:
    import sphinx_rtd_theme  # noqa: F401

    html_theme = "sphinx_rtd_theme"
except ImportError:  # the docs extra lists it; alabaster ships with Sphinx
    html_theme = "alabaster"
html_title = f"torch-hpc {release}"
html_static_path: list[str] = []
