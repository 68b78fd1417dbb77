"""The recipe's JSON Schema, generated from the Pydantic `Recipe` model, for editors.

The model stays the one source of truth: `mpsrun schema` prints what it describes,
`docs/recipe.schema.json` is that output committed (a test keeps them equal), and
shipped recipes name it on their first line so YAML editors complete keys and flag
unknown ones as you type. Plugin sections stay open (any keyword besides `name`),
because which keywords are valid depends on the plugins installed; `mpsrun
validate` checks those against the plugin's signature.
"""

from __future__ import annotations

import json
from typing import Any

DIALECT = "https://json-schema.org/draft/2020-12/schema"
MODELINE = "# yaml-language-server: $schema={path}"


def recipe_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a recipe file, independent of installed plugins."""
    from mpsrun.recipe.model import Recipe

    schema = Recipe.model_json_schema()
    schema = {"$schema": DIALECT, "title": "mpsrun recipe", **{k: v for k, v in schema.items() if k != "title"}}
    _loosen_where_coerced(schema)
    plugin = schema.get("$defs", {}).get("PluginSection")
    if plugin is not None:
        plugin["additionalProperties"] = True  # plugin keyword arguments vary by plugin
        plugin["description"] = (
            "`name:` plus that plugin's keyword arguments, flat beside it. "
            "Arguments are checked against the plugin's signature by `mpsrun validate`; "
            "`mpsrun plugins` lists each plugin's parameters."
        )
        name = plugin.get("properties", {}).get("name")
        if name is not None:
            name["description"] = "plugin name, or distribution:name when two distributions register it (optimizers: a torch.optim class name in lower case)"
    return schema


def _loosen_where_coerced(schema: dict[str, Any]) -> None:
    """Accept what the model's before-validators accept, so the schema never rejects a recipe that runs."""
    props = schema.get("properties", {})
    fallback = props.get("device_fallback")
    if fallback is not None and fallback.get("type") == "array":
        # `device_fallback: cpu` is read as [cpu]
        keep = {k: v for k, v in fallback.items() if k in ("title", "description", "default")}
        from mpsrun.recipe.model import DEVICE_PATTERN

        items = {"type": "string", "pattern": DEVICE_PATTERN}
        fallback.clear()
        fallback.update(keep, anyOf=[items, {"type": "array", "items": items}])
    tracking = schema.get("$defs", {}).get("TrackingSection", {})
    tags = tracking.get("properties", {}).get("tags")
    if tags is not None:
        # YAML reads `seed: 1` as a number; tags are stored as strings either way.
        tags["additionalProperties"] = {"type": ["string", "number", "boolean"]}


def render() -> str:
    """The schema as `mpsrun schema` prints it and docs/recipe.schema.json holds it."""
    return json.dumps(recipe_schema(), indent=2) + "\n"
