"""The training wing: runner (recipe -> finished run), engine (the loop), data, progress."""
