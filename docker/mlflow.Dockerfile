# The MLflow tracking server for docker/compose.yaml: MLflow's own image plus the
# PostgreSQL driver (psycopg 3, for postgresql+psycopg:// URIs) and boto3 (for the
# s3:// artifact destination). The same two packages the test stack uses
# (tests/servers.py).
ARG MLFLOW_VERSION=3.17.2
FROM ghcr.io/mlflow/mlflow:v${MLFLOW_VERSION}
RUN pip install --no-cache-dir "psycopg[binary]>=3.1" "boto3>=1.34"
