# tokenmill on CPU: the OpenAI-compatible server, as a non-root user, with a health check.
#   docker build -t tokenmill .
#   docker run -p 8000:8000 -v $HOME/models:/models tokenmill /models/my-llama --api-key $KEY
# With no model argument it serves the built-in demo model. The C++ CPU kernels are compiled
# for the CPU the container runs on, at first start (a minute or two), into /home/tokenmill/.cache:
# mount a volume there to keep them across restarts on the same host.
FROM python:3.11-slim

# a compiler and ninja for the CPU kernels (torch.utils.cpp_extension builds them at first use)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# CPU torch first, from PyTorch's CPU index: PyPI's default wheel would pull CUDA
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY tokenmill ./tokenmill
RUN pip install --no-cache-dir ".[structured]"

RUN useradd --create-home --uid 10001 tokenmill
USER tokenmill

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"
ENTRYPOINT ["tokenmill", "serve", "--host", "0.0.0.0", "--port", "8000"]
