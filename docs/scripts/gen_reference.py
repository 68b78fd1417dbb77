"""Run by mkdocs-gen-files during `mkdocs build`: writes the generated reference pages.

The pages exist only in the build (nothing generated is committed), so they always describe
the code being built. See refgen.py beside this file for how each page is made.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import refgen  # noqa: E402  (beside this script, not an installed module)

for name, text in (("reference/recipe.md", refgen.recipe_page()), ("reference/cli.md", refgen.cli_page())):
    with mkdocs_gen_files.open(name, "w") as f:
        f.write(text)
    mkdocs_gen_files.set_edit_path(name, "scripts/gen_reference.py")
