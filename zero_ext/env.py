"""`python -m zero_ext.env [--json]`: the environment report for bug reports
(tools/env_report.py)."""
import sys

from .tools import env_report

collect, main = env_report.collect, env_report.main

__all__ = ["collect", "main"]

if __name__ == "__main__":
    sys.exit(main())
