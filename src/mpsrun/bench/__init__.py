"""The bench wing: matrix runs as child runs of one MLflow run, and the compare table."""
