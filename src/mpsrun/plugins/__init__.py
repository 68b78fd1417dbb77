"""The plugin wing: entry-point registry, argument checks, the plugin contract, `new`, builtin/.

`resolve` is a recipe resolved with its plugin arguments checked too: the recipe
wing knows nothing of plugins, so the two checks are joined here, one level up.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpsrun.recipe.load import Resolved


def resolve(path: str | Path, overrides: list[str] | None = None) -> Resolved:
    """Load, override and validate a recipe, plugin arguments included (every problem at once)."""
    from mpsrun.plugins.components import check_all
    from mpsrun.recipe.load import resolve as resolve_recipe

    return resolve_recipe(path, overrides, check=check_all)
