"""Where runs live: the MLflow client, the store's lock, the offline spool and its sync, remote checks, liveness, run listings."""
