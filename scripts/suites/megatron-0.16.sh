#!/usr/bin/env bash
# Suite: the megatron engine on megatron-core 0.16.1 (CPU, gloo) in .venvs/megatron-0.16.
# Run by bin/test (`bin/test megatron-0.16`); the venv is created on first use and reused after.
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/megatron_suite.sh" 0.16.1 "$@"
