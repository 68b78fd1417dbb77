"""The recipe wing: what a user writes, validated before anything heavy starts.

problems (bottom: Problem, RecipeError, YAML loading) <- model (Pydantic) <- overrides
<- load (resolve) <- matrix, schema. Nothing here imports plugins, training or MLflow.
"""

from mpsrun.recipe.load import Resolved, flatten, load_source, resolve, validate_source
from mpsrun.recipe.overrides import apply_overrides, parse_override
from mpsrun.recipe.problems import (
    Problem,
    RecipeError,
    RecipeSource,
    did_you_mean,
    yaml_load,
)

__all__ = [
    "Problem", "RecipeError", "RecipeSource", "Resolved", "apply_overrides", "did_you_mean",
    "flatten", "load_source", "parse_override", "resolve", "validate_source", "yaml_load",
]
