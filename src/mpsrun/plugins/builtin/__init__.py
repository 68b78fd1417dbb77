"""Built-in plugins, registered through the same entry points as anyone else's."""
