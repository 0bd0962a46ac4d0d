#!/usr/bin/env bash
# The exit soak of issue 32 (see scripts/exit_soak.py): 50 torchrun runs of the
# demo and 50 saves whose peer dies mid-save; prints a table, exits 1 if any
# run ended otherwise than required (an abort at exit, above all).
#   scripts/exit_soak.sh [--demo N] [--dead-peer N] [--keep DIR --cores] [--verbose]
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" scripts/exit_soak.py "$@"
