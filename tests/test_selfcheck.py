"""The build's self-check: a C++ error must reach Python as RuntimeError, and
a build that crashes instead is caught in a child process, named, and refused."""
import os
import signal
import subprocess
import sys

import pytest

import zero_ext
from zero_ext.tools import build_check as selfcheck

SCRIPT = os.path.join(os.path.dirname(zero_ext.__file__), "selfcheck.py")


def test_this_build_raises_runtime_error_for_a_bad_operand():
    result = selfcheck.run_check()
    assert result.ok, result.output
    assert "raised: zero_ext.adam_step_: grad has 3 elements, param has 4" in result.output
    assert selfcheck.exit_code(result) == 0


def test_a_child_that_dies_by_a_signal_is_reported_with_the_compiler_and_the_fix(monkeypatch):
    monkeypatch.setenv(selfcheck.FAULT_VARIABLE, selfcheck.crash_fault(int(signal.SIGSEGV)))
    result = selfcheck.run_check()
    assert result.returncode == -signal.SIGSEGV and result.signal_name == "SIGSEGV"
    message = result.explain()
    assert "crashed (SIGSEGV)" in message
    assert str(selfcheck.build_info()["cxx"]) in message
    assert "CXX=/usr/bin/g++" in message


@pytest.mark.parametrize("built_with,expected", [("/opt/gcc/bin/g++", 2), (selfcheck.SYSTEM_CXX, 1)])
def test_a_crash_asks_for_a_rebuild_only_when_the_system_compiler_differs(built_with, expected):
    if not os.path.exists(selfcheck.SYSTEM_CXX):
        pytest.skip("no system compiler at /usr/bin/g++")
    crashed = selfcheck.CheckResult(-signal.SIGSEGV, "", {"cxx": built_with, "cxx_realpath": built_with})
    assert selfcheck.exit_code(crashed) == expected
    assert selfcheck.exit_code(selfcheck.CheckResult(3, "no error raised", {})) == 1


def test_the_command_line_exits_2_and_names_the_fix_when_the_child_crashes():
    env = dict(os.environ, **{selfcheck.FAULT_VARIABLE: selfcheck.crash_fault(int(signal.SIGABRT))})
    done = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    info = selfcheck.build_info()
    differs = os.path.realpath(info.get("cxx_realpath", "?")) != os.path.realpath(selfcheck.SYSTEM_CXX)
    assert done.returncode == (2 if differs else 1), done.stdout + done.stderr
    assert "crashed (SIGABRT)" in done.stderr


def test_import_refuses_a_crashing_build_once_and_remembers_a_good_one(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(selfcheck.SKIP_VARIABLE, raising=False)
    monkeypatch.setenv(selfcheck.FAULT_VARIABLE, selfcheck.crash_fault(int(signal.SIGSEGV)))
    with pytest.raises(ImportError, match=r"crashed \(SIGSEGV\).*CXX=/usr/bin/g\+\+"):
        selfcheck.ensure_checked()
    monkeypatch.delenv(selfcheck.FAULT_VARIABLE)
    selfcheck.ensure_checked()  # a good build: checked, and remembered
    monkeypatch.setattr(selfcheck, "run_check", lambda *a, **k: pytest.fail("checked twice"))
    selfcheck.ensure_checked()
