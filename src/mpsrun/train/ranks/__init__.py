"""Several processes, one job: distributed set-up, the launcher, teardown, the job's run in MLflow."""
