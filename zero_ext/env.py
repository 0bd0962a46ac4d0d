"""`python -m zero_ext.env [--json]`: the environment report for bug reports
(tools/env_report.py)."""
import sys

from .tools.env_report import collect, main

__all__ = ["collect", "main"]

if __name__ == "__main__":
    sys.exit(main())
