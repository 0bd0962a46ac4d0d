"""The build checks itself: a C++ error must reach Python as a RuntimeError.

An extension built with a compiler whose C++ runtime or unwinder differs from
the one torch was built with (a wrapper compiler, a conda or module-system
toolchain) can lose C++ exception handling: every TORCH_CHECK then ends the
process with SIGSEGV or SIGABRT instead of raising. zero_ext checks this in a
child process, where a crash is harmless:

- right after building (`scripts/setup.sh`, `scripts/gpu_check.sh`,
  `scripts/test_torch_versions.sh`), as `python zero_ext/selfcheck.py`;
- once per build at the first `import zero_ext` (the result is remembered in
  ~/.cache/zero_ext, keyed by the compiled file), so an unchecked build never
  trains. ZERO_EXT_SELFCHECK=0 skips it.

This file imports nothing from zero_ext, so it runs by path even when the
package itself cannot be imported.

Exit codes of the command line: 0 the build raises as it should; 2 the child
died by a signal and the build's compiler is not the system one, so a rebuild
with /usr/bin/g++ may cure it (scripts/setup.sh then does that); 1 anything
else (a crash with the system compiler already, the package did not import,
or the bad operand raised nothing).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from typing import Optional

SKIP_VARIABLE = "ZERO_EXT_SELFCHECK"
# Tests: ZERO_EXT_TEST_FAULT=build_check_signal:*:N makes the child kill itself
# with signal N before doing anything, standing in for a build that crashes
# (tools/faults.py; parsed in the child, since this file imports no zero_ext).
FAULT_VARIABLE, FAULT_POINT = "ZERO_EXT_TEST_FAULT", "build_check_signal"
SYSTEM_CXX, SYSTEM_CC = "/usr/bin/g++", "/usr/bin/gcc"

# Runs in the child: a fused Adam step whose gradient has the wrong size.
_CHILD = r"""
import os, signal, sys
for entry in os.environ.get("%(variable)s", "").split(","):
    parts = entry.strip().split(":")
    if len(parts) == 3 and parts[0] == "%(point)s" and parts[2].isdigit():
        os.kill(os.getpid(), int(parts[2]))
import torch
import zero_ext.tools.core_loader  # noqa: F401  registers torch.ops.zero_ext
p, g = torch.zeros(4, dtype=torch.float32, device="cpu"), torch.zeros(3, dtype=torch.float32, device="cpu")
m, v = torch.zeros_like(p), torch.zeros_like(p)
try:
    torch.ops.zero_ext.adam_step_(p, g, m, v, None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1,
                                  True, False, False)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
    sys.exit(0)
print("no error raised for a gradient of the wrong size")
sys.exit(3)
""" % {"variable": FAULT_VARIABLE, "point": FAULT_POINT}


def crash_fault(signal_number: int) -> str:
    """ZERO_EXT_TEST_FAULT's value that makes the check's child die by this signal."""
    return f"{FAULT_POINT}:*:{signal_number}"


@dataclasses.dataclass
class CheckResult:
    returncode: int
    output: str
    build: dict

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def signal_name(self) -> Optional[str]:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def explain(self) -> str:
        if self.ok:
            return f"zero_ext build check passed ({describe_build(self.build)})."
        cxx = self.build.get("cxx", "an unknown compiler")
        if self.signal_name:
            return (
                f"zero_ext's compiled core crashed ({self.signal_name}) where a C++ error should have "
                f"reached Python as a RuntimeError. It was built with {cxx} "
                f"({self.build.get('cxx_version', 'version unknown')}): an extension built with a "
                f"compiler whose C++ runtime differs from torch's loses exception handling, so every "
                f"error would end training with a crash instead of a message. Rebuild with the "
                f"system compiler: CXX={SYSTEM_CXX} CC={SYSTEM_CC} pip install --no-build-isolation "
                f"--force-reinstall --no-deps . (bash scripts/setup.sh does this by itself).")
        return (f"zero_ext build check failed (exit code {self.returncode}, {describe_build(self.build)}):\n"
                f"{self.output.strip()}\nRebuild against the installed torch: "
                f"pip install --no-build-isolation --force-reinstall --no-deps .")


def package_dir() -> str:
    """zero_ext/, where the compiled core and _build_info.json are (this file is in zero_ext/tools/)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled_core() -> Optional[str]:
    found = sorted(glob.glob(os.path.join(package_dir(), "_C*.so")) +
                   glob.glob(os.path.join(package_dir(), "_C*.pyd")))
    return found[0] if found else None


def build_info() -> dict:
    """What setup.py recorded: the compiler and the torch it built against."""
    try:
        with open(os.path.join(package_dir(), "_build_info.json")) as f:
            info = json.load(f)
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def describe_build(info: dict) -> str:
    return (f"built with {info.get('cxx', 'an unknown compiler')} against torch "
            f"{info.get('torch', 'unknown')}")


def run_check(python: str = sys.executable, timeout: float = 300.0) -> CheckResult:
    """Calls an op with a bad operand in a child process."""
    env = dict(os.environ)
    env[SKIP_VARIABLE] = "0"  # the child must not check itself again
    # The child finds this very package first, whichever way it was installed,
    # then what this process can import (paths added at run time included).
    parent = os.path.dirname(package_dir())
    env["PYTHONPATH"] = os.pathsep.join([parent] + [p for p in sys.path if p])
    try:
        done = subprocess.run([python, "-c", _CHILD], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=parent)
    except subprocess.TimeoutExpired as error:
        return CheckResult(1, f"the check did not finish within {timeout:.0f} s: {error}", build_info())
    except OSError as error:  # no usable interpreter (an embedded or frozen one)
        return CheckResult(1, f"the check could not start {python!r}: {error}", build_info())
    return CheckResult(done.returncode, done.stdout + done.stderr, build_info())


def _stamp_path(core: str) -> Optional[str]:
    try:
        st = os.stat(core)
    except OSError:
        return None
    key = hashlib.sha256(f"{os.path.realpath(core)}|{st.st_size}|{st.st_mtime_ns}|{sys.executable}"
                         .encode()).hexdigest()[:24]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zero_ext", "selfcheck", key)


def ensure_checked() -> None:
    """At import: checks this build once (remembered per compiled file) and
    raises ImportError naming the compiler and the fix if it crashes."""
    if os.environ.get(SKIP_VARIABLE) == "0":
        return
    core = compiled_core()
    stamp = _stamp_path(core) if core else None
    if stamp and os.path.exists(stamp):
        return
    if not sys.executable:
        return  # an embedded interpreter: no child to run the check in
    result = run_check()
    if result.signal_name or result.returncode == 3:  # crashed, or raised nothing: a broken build
        raise ImportError(result.explain() + f"\n(Set {SKIP_VARIABLE}=0 to skip this check.)")
    if not result.ok:  # the check itself could not run (timeout, no interpreter): not the build's fault
        warnings.warn(f"zero_ext could not run its build check: {result.output.strip()[-500:]}", stacklevel=3)
        return
    if stamp:
        try:
            os.makedirs(os.path.dirname(stamp), exist_ok=True)
            with open(stamp, "w") as f:
                f.write(result.output)
        except OSError:
            pass  # an unwritable cache only means checking again next time


def system_compiler_would_differ(result: CheckResult) -> bool:
    """Whether a crash might be cured by rebuilding with the system compiler:
    the build used another one (or an unknown one) and the system one exists."""
    if not result.signal_name or not os.path.exists(SYSTEM_CXX):
        return False
    built = result.build.get("cxx_realpath")
    return built is None or os.path.realpath(built) != os.path.realpath(SYSTEM_CXX)


def exit_code(result: CheckResult) -> int:
    if result.ok:
        return 0
    return 2 if system_compiler_would_differ(result) else 1


def main() -> int:
    result = run_check()
    print(result.explain(), file=sys.stdout if result.ok else sys.stderr)
    return exit_code(result)


if __name__ == "__main__":
    sys.exit(main())
