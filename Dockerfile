# The image every host of a cluster job runs (README "On a TPU pod"): this repository, installed
# with the extras a job needs (default: tpu and eval; a GPU image: --build-arg EXTRAS=gpu,eval).
# The launcher's command runs in /olmo3 (launch/cluster.py --working_dir=/olmo3).
# .dockerignore keeps the build context to the sources: no virtual environment, runs or caches.
FROM python:3.11-slim
ARG EXTRAS=tpu,eval
WORKDIR /olmo3
COPY . .
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
