"""What a run leaves in MLflow beyond metrics: the logged model, figures, datasets, system metrics, standard tags, and the hooks that write them."""
