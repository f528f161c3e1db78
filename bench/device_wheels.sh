#!/usr/bin/env bash
# The Python packages the lent GPU machine lacks, as wheels in .whl/ (git-ignored), which bench/gpu_session.sh
# installs there into /tmp/site.  Run here, from the repo root, where pip reaches PyPI:
#   bash bench/device_wheels.sh            # hydra-core, omegaconf, antlr4 (the CLI needs them)
#   WANDB=1 bash bench/device_wheels.sh    # and the wandb client (about 26 MB more), for the grid's t0w / t3w
# The device runs Python 3.12 on x86_64 (torch 2.11); its image has click, protobuf, pyyaml, requests, httpx,
# typing-extensions and xxhash, not wandb, pydantic or opentelemetry.  A wandb that fails to import there only
# turns the mirror off (the run logs why and records wandb: false), never the run.
set -eu
mkdir -p .whl
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps -d .whl hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
if [ -f .whl/antlr4-python3-runtime-4.9.3.tar.gz ]; then  # antlr4 4.9.3 is a source release: built here (pure Python)
  (cd .whl && python3 -m pip wheel -q --no-deps antlr4-python3-runtime-4.9.3.tar.gz -w . \
     && rm antlr4-python3-runtime-4.9.3.tar.gz)
fi
if [ "${WANDB:-0}" = 1 ]; then
  # wandb 0.31.0 and what it needs that the image lacks (or has older than it needs); one version of each
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: $PLAT -d .whl wandb==0.31.0 cwevals==0.0.1b1 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-http-transport==0.66b2 \
    opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 platformdirs==4.14.9 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 protobuf==7.36.2 click==8.5.1 distro==1.9.0 sniffio==1.3.1
fi
ls .whl
