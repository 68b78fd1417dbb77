"""mpsrun-plugin-example: mpsrun plugins. Registered in pyproject.toml; nothing to import by hand."""
