"""The "nvme" offload file (csrc/swap_file.h, zero_ext/tools/offload_file.py):
what is written reads back exactly, regions never overlap (O_DIRECT pads
each to 4 KiB), nothing is left on disk during or after the process however
it ends, and a disk without room, an unusable path or a failing write is an
error that names the file."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_ext
from zero_ext.tools.offload_file import ALIGN, OffloadFile, check_offload_path, plan_regions

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))  # the zero_ext under test


def test_regions_start_aligned_and_never_share_a_block():
    offsets, total = plan_regions({"a": 1, "b": ALIGN, "c": ALIGN + 1, "d": 0, "e": 10})
    assert offsets == {"a": 0, "b": ALIGN, "c": 2 * ALIGN, "d": 4 * ALIGN, "e": 5 * ALIGN}
    assert total == 6 * ALIGN


@pytest.mark.parametrize("chunk", [ALIGN, 3 * ALIGN, 8 << 20])
def test_what_is_written_reads_back_exactly_and_neighbours_stay(tmp_path, chunk):
    g = torch.Generator().manual_seed(0)
    # Odd sizes (O_DIRECT pads each region's last chunk), one spanning many
    # chunks (split over the threads), several dtypes.
    tensors = {"odd": torch.randn(1001, generator=g), "big": torch.randn(70_000, generator=g),
               "bf16": torch.randn(3, 333, generator=g).bfloat16(), "ints": torch.arange(17, dtype=torch.int64)}
    f = OffloadFile(str(tmp_path), 0, {k: t.numel() * t.element_size() for k, t in tensors.items()},
                    threads=3, chunk_bytes=chunk)
    writes = [f.write(k, t) for k, t in tensors.items()]
    for w in writes:
        w.wait()
    reads = {k: f.read(k, like=t) for k, t in tensors.items()}
    for k, t in tensors.items():
        assert torch.equal(reads[k].wait(), t), k
    # Rewrite one region; the others are untouched by its padding.
    f.write("odd", tensors["odd"] * 2).wait()
    assert torch.equal(f.read("odd", like=tensors["odd"]).wait(), tensors["odd"] * 2)
    assert torch.equal(f.read("big", like=tensors["big"]).wait(), tensors["big"])
    written, read = f.bytes_moved()
    assert written == sum(t.numel() * t.element_size() for t in tensors.values()) + 1001 * 4
    assert read > 0


def test_a_region_never_written_reads_as_zeros(tmp_path):
    f = OffloadFile(str(tmp_path), 0, {"x": 4 * 5000})
    assert torch.equal(f.read("x", like=torch.ones(5000)).wait(), torch.zeros(5000))


def test_nothing_is_left_on_disk_while_open(tmp_path):
    f = OffloadFile(str(tmp_path), 3, {"x": 1 << 20})
    f.write("x", torch.ones(1 << 18)).wait()
    assert os.listdir(tmp_path) == [], "the file is unlinked once open"
    assert "rank3" in f.path and f.path.startswith(str(tmp_path))


@pytest.mark.parametrize("how", ["exit", "exception", "sigterm", "sigkill"])
def test_nothing_is_left_after_the_process_ends_however_it_ends(tmp_path, how):
    script = textwrap.dedent(f"""
        import os, signal, sys, time, torch
        from zero_ext.tools.offload_file import OffloadFile
        f = OffloadFile({str(tmp_path)!r}, 0, {{"x": 8 << 20}})
        f.write("x", torch.ones(2 << 20)).wait()
        print("ready", flush=True)
        if {how!r} == "exception":
            raise RuntimeError("a training step failed")
        if {how!r} in ("sigterm", "sigkill"):
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    if how in ("sigterm", "sigkill"):
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    proc.wait(timeout=60)
    assert os.listdir(tmp_path) == []


def test_an_unusable_offload_path_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="offload_path .*a_file.* cannot be created|is not a directory"):
        check_offload_path(str(blocker / "sub"))
    with pytest.raises(ValueError, match="is not a directory"):
        check_offload_path(str(blocker))
    with pytest.raises(TypeError, match="offload_path must be a directory path"):
        check_offload_path(None)
    made = tmp_path / "made" / "for" / "ranks"
    assert check_offload_path(made) == str(made) and made.is_dir()


def test_a_disk_without_room_is_an_error_before_anything_is_written(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: reserving the file fails at
    creation, naming the file and the bytes, and leaves nothing behind."""
    script = textwrap.dedent(f"""
        import resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from zero_ext.tools.offload_file import OffloadFile
        try:
            OffloadFile({str(tmp_path)!r}, 0, {{"state": 64 << 20}})
        except RuntimeError as e:
            print(str(e).splitlines()[0])
        else:
            print("no error")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "cannot reserve 64.0 MiB for the offload file" in line and str(tmp_path) in line, line
    assert "point offload_path at one with room" in line
    assert os.listdir(tmp_path) == []


def test_a_write_that_fails_raises_at_its_wait_naming_the_file(tmp_path):
    """A sparse file (the path of file systems that cannot reserve) on a
    disk that fills: the write's wait raises, naming the file and region;
    the I/O threads go on serving the next transfer."""
    script = textwrap.dedent(f"""
        import resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from zero_ext.tools.offload_file import OffloadFile
        f = OffloadFile({str(tmp_path)!r}, 0, {{"a": 1 << 20, "b": 4 << 20}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))  # the reserved file now exceeds it
        try:
            f.write("b", torch.ones(1 << 20)).wait()
        except RuntimeError as e:
            print(str(e).splitlines()[0])
        else:
            print("no error")
        print(f.read("a", like=torch.ones(10)).wait().sum().item())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    # A chunk past the 2 MiB limit (CHUNK_BYTES per system call) fails; the I/O threads write
    # several such chunks at once, and the error names the first to fail, whichever it was.
    failed_at = re.match(r"zero_ext: writing 1\.0 MiB at offset (\d+) of the offload file", first)
    assert failed_at and int(failed_at.group(1)) >= 2 << 20 and int(failed_at.group(1)) % (1 << 20) == 0, first
    assert str(tmp_path) in first and "File too large" in first, first
    assert second == "0.0"
