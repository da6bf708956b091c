# The pinned image for container work pools (Kubernetes, Docker, ECS, Modal): the same constraints
# as ./scripts/setup, so that a restarted pod has exactly the packages the tests ran with.
#   docker build -t shardline:cpu .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t shardline:gpu .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
WORKDIR /opt/shardline
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml constraints.txt README.md prefect.yaml ./
COPY shardline shardline
COPY configs configs
RUN pip install -e . -c constraints.txt
