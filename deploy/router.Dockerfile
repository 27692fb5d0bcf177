# vLLM's router for flashserve replicas (deploy/kubernetes/router.yaml):
#   docker build -t flashserve-router -f deploy/router.Dockerfile deploy
FROM python:3.12-slim
# The version the project's replica tests run against (pyproject.toml, dev extra).
RUN pip install --no-cache-dir vllm-router==0.1.17 \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin router
USER 10001
ENTRYPOINT ["vllm-router"]
