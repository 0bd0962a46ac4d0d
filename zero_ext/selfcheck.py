"""`python zero_ext/selfcheck.py` or `python -m zero_ext.selfcheck`: the build
checks itself (tools/build_check.py). Runs by path, importing nothing from
zero_ext, so it works where the package itself cannot be imported."""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "build_check.py"),
                   run_name="__main__")
