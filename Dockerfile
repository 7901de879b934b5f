# packrat-mq image: one image for the dispatcher and the worker pool.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY packrat_mq ./packrat_mq
COPY dispatcher ./dispatcher
COPY workers ./workers
COPY optimizer ./optimizer
COPY profiles ./profiles
# CPU-only torch wheels keep the image small; the versions are the pinned ones.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        "torch==$(grep -i '^torch==' constraints.txt | cut -d= -f3)+cpu" \
        "torchvision==$(grep -i '^torchvision==' constraints.txt | cut -d= -f3)+cpu" \
    && grep -viE '^(torch|torchvision|nvidia-|triton|cuda-)' constraints.txt > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt '.[vision,nlp]'
ENTRYPOINT ["packrat-mq"]
CMD ["--help"]
