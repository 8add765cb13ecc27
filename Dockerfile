# qvl in a container: `docker build -t qvl .`, then
#   docker run -p 8000:8000 -v qvl-cache:/cache qvl                      # serves qwen3-vl:2b
#   docker run -p 8000:8000 -v qvl-cache:/cache -e QVL_MODEL=qwen3.5:2b qvl serve --weights int4
# The cache volume keeps the models, their quantised copies and the kernels built for the host.
FROM python:3.11-slim

# a C compiler (the kernels are compiled for the CPU they run on) and torch's OpenMP runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# torch's CPU wheel first: PyPI's default Linux build is the multi-GB CUDA one
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md /src/
COPY src /src/src
RUN pip install --no-cache-dir /src && rm -rf /src

# kernels compiled now, for the CPU of the machine building the image; a host with another CPU
# compiles its own into the cache volume at its first start (docker/entrypoint.sh)
RUN QVL_CACHE_DIR=/opt/qvl qvl info >/dev/null && rm -rf /opt/qvl/quantized

COPY docker/entrypoint.sh /usr/local/bin/qvl-entrypoint
RUN useradd --create-home --uid 1000 qvl && mkdir -p /cache && chown qvl:qvl /cache
USER qvl
ENV QVL_CACHE_DIR=/cache/qvl HF_HOME=/cache/huggingface QVL_PORT=8000 PYTHONUNBUFFERED=1
VOLUME /cache
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"QVL_PORT\"]}/health', timeout=4)"
ENTRYPOINT ["qvl-entrypoint"]
CMD ["serve"]
