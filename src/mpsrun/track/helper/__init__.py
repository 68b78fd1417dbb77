"""The helper process that owns MLflow beside training: the process, its pipe, the background writer that feeds it."""
