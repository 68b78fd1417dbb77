"""Test helpers that let mpsrun be exercised end to end without network access."""
