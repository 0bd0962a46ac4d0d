"""The incremental build with its precompiled header (setup.py, [Note: the
precompiled header]), checked on this checkout's own build directory.

gcc's dependency files leave out what a source took from the .gch, so ninja
cannot see a changed precompiled header: setup.py removes the objects whenever
it makes a new one. An object older than the .gch it was compiled with would be
a stale object linked into the extension."""
import glob
import os

import pytest

import zero_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(os.path.abspath(zero_ext.__file__))


def _build_dirs():
    if os.path.dirname(PACKAGE) != ROOT:
        return []  # zero_ext comes from elsewhere (a wheel in a venv): no build directory here
    return [d for d in glob.glob(os.path.join(ROOT, "build", "incremental", "*"))
            if os.path.exists(os.path.join(d, "build.ninja"))]


def test_every_object_is_newer_than_the_precompiled_header_it_used():
    dirs = [d for d in _build_dirs() if glob.glob(os.path.join(d, "precompiled", "*.gch"))]
    if not dirs:
        pytest.skip("no build directory with a precompiled header (another compiler, or an installed wheel)")
    for build in dirs:
        gch = glob.glob(os.path.join(build, "precompiled", "*.gch"))[0]
        header = gch[:-len(".gch")]
        ninja = open(os.path.join(build, "build.ninja")).read()
        assert f"-include {header}" in ninja, "the sources are not compiled with the precompiled header"
        objects = glob.glob(os.path.join(build, "csrc", "*.o"))
        assert objects
        stale = [os.path.basename(o) for o in objects if os.path.getmtime(o) < os.path.getmtime(gch)]
        assert not stale, f"objects compiled before {gch} was made: {stale}"


def test_no_debug_info_unless_asked():
    if not _build_dirs():
        pytest.skip("no build directory (an installed wheel)")
    for build in _build_dirs():
        ninja = open(os.path.join(build, "build.ninja")).read()
        post = next(line for line in ninja.splitlines() if line.startswith("post_cflags"))
        if "-O0" not in post:  # ZERO_EXT_DEBUG=1 builds -O0 -g
            assert "-g0" in post.split(), post
