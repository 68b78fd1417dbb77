"""The tracking wing: everything MLflow (store, run lifecycle, buffered metrics, artifacts)."""
