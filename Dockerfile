# pdserve on the CPU: the README's steps (torch 2.13.0, then pdserve; the default model
# optionally at build time), with `pdserve serve` as the entrypoint, as vLLM's image has
# `vllm serve`. Build and run (details: docs/operations.md, "Containers"):
#
#   docker build -t pdserve:cpu --build-arg PDSERVE_DOWNLOAD=default .
#   docker run --rm -p 8000:8000 --shm-size 2g pdserve:cpu
#   docker run --rm -p 8000:8000 --shm-size 2g -v ~/.cache/huggingface:/data/huggingface \
#       pdserve:cpu Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096
#
# --shm-size: on the CPU the prefill node writes KV into the decode node's buffer in /dev/shm,
# 1 GiB per node by default; Docker's default /dev/shm holds 64 MiB.

FROM python:3.11-slim AS wheel
COPY . /src
RUN pip wheel --no-cache-dir --no-deps -w /wheels /src

FROM python:3.11-slim
# torch's CPU build from its own index: the PyPI wheel carries CUDA's libraries too.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0
# PDSERVE_EXTRAS: the wheel's extras; the default, mooncake, is the KV transport between
# hosts (`--kv-transport mooncake`), whose engine needs the system library libibverbs.
ARG PDSERVE_EXTRAS=mooncake
RUN case ",$PDSERVE_EXTRAS," in *,mooncake,*) apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/* ;; esac
COPY --from=wheel /wheels /wheels
# Its dependencies at the versions CI tested (requirements.lock, `make lock`).
COPY requirements.lock /wheels/
RUN pip install --no-cache-dir -c /wheels/requirements.lock \
    "$(ls /wheels/*.whl)${PDSERVE_EXTRAS:+[$PDSERVE_EXTRAS]}" && rm -rf /wheels

RUN useradd --create-home --uid 1000 pdserve && mkdir /data && chown pdserve /data
USER pdserve
ENV PDSERVE_HOME=/data/pdserve HF_HOME=/data/huggingface PYTHONUNBUFFERED=1
# "default": the default model (pdserve download); a Hub id: that model; empty: neither, and
# the model is fetched when the container first needs it.
ARG PDSERVE_DOWNLOAD=""
RUN if [ "$PDSERVE_DOWNLOAD" = default ]; then pdserve download; \
    elif [ -n "$PDSERVE_DOWNLOAD" ]; then pdserve download "$PDSERVE_DOWNLOAD"; fi

EXPOSE 8000
ENTRYPOINT ["pdserve", "serve", "--host", "0.0.0.0"]
