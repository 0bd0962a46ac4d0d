"""python -m zero_ext.coordinator on its own (no training ranks): quorums
form when every live replica asked, a replica that stops beating is left
out, a replica wrapped differently is refused naming what differs, bad
input is answered and never stops the server, and a coordinator started
again is a new incarnation."""
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from zero_ext.groups import coordinator_request as request

from dist_harness import free_port_pair


@pytest.fixture
def coordinator():
    started = []

    def start(*extra, port=None):
        port = port or free_port_pair()
        proc = subprocess.Popen([sys.executable, "-m", "zero_ext.coordinator", "--host", "127.0.0.1", "--port",
                                 str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        line = proc.stdout.readline()
        assert "zero_ext coordinator" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        return f"127.0.0.1:{port}", proc
    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _ask(address, replica, step, fingerprint=None, incarnation="i1", timeout=30.0):
    return request(address, {"op": "quorum", "replica": replica, "incarnation": incarnation, "step": step,
                             "fingerprint": fingerprint or {"stage": "2"}, "timeout": timeout}, timeout=timeout + 5)


def _beat(address, replica, incarnation="i1"):
    return request(address, {"op": "heartbeat", "replica": replica, "incarnation": incarnation}, timeout=5)


def _together(*calls):
    out = [None] * len(calls)

    def run(k, call):
        out[k] = call()
    threads = [threading.Thread(target=run, args=(k, c)) for k, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_quorum_waits_for_every_live_replica_and_names_who_is_behind(coordinator):
    address, _ = coordinator("--min-replicas", "2", "--dead-after", "2")
    a, b = _together(lambda: _ask(address, "a", 5), lambda: (time.sleep(0.5), _ask(address, "b", 3))[1])
    assert a["ok"] and a == b, (a, b)
    assert a["members"] == ["a", "b"] and a["step"] == 5 and a["contributors"] == ["a"]
    assert a["recovering"] == ["b"] and a["source"] == "a"
    again = _together(lambda: _ask(address, "a", 6), lambda: _ask(address, "b", 6))
    assert again[0]["quorum"] != a["quorum"] and again[0]["recovering"] == [] and again[0]["contributors"] == ["a", "b"]


def test_a_replica_that_stops_beating_is_left_out(coordinator):
    address, _ = coordinator("--dead-after", "1.5", "--min-replicas", "2")
    first = _together(lambda: _ask(address, "a", 0), lambda: _ask(address, "b", 0))
    assert first[0]["members"] == ["a", "b"], first
    started = time.monotonic()
    alone = _ask(address, "a", 1)  # b neither asks nor beats: dead after 1.5 s
    assert alone.get("members") == ["a"] and time.monotonic() - started < 10, alone


def test_a_replica_wrapped_differently_is_refused_naming_the_field(coordinator):
    address, _ = coordinator("--dead-after", "2")
    assert _ask(address, "a", 0, {"stage": "stage=2", "parameters": "p1"})["ok"]
    refused = _ask(address, "b", 0, {"stage": "stage=3", "parameters": "p1"})
    assert not refused["ok"] and "stage" in refused["error"] and "parameters" not in refused["error"], refused


BAD_INPUT = {
    "not-json": b"not json\n",
    "array": b"[1, 2]\n",
    "unknown-op": b'{"op": "launch"}\n',
    "empty-replica": b'{"op": "quorum", "replica": "", "incarnation": "x", "step": 0}\n',
    "negative-step": b'{"op": "quorum", "replica": "a", "incarnation": "x", "step": -1, "fingerprint": {}}\n',
    "nan-timeout": b'{"op": "quorum", "replica": "a", "incarnation": "x", "step": 0, "fingerprint": {}, '
                   b'"timeout": NaN}\n',
    "too-long": b"x" * (2 << 20) + b"\n",
    "nothing": b"",
}


@pytest.mark.parametrize("line", list(BAD_INPUT.values()), ids=list(BAD_INPUT))
def test_bad_input_is_answered_and_the_server_goes_on(coordinator, line):
    address, proc = coordinator()
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(line)
            time.sleep(0.3)  # a slow asker: the server's answer must not depend on when the asker ends its request
            sock.shutdown(socket.SHUT_WR)
            answer = sock.makefile().readline()
        except OSError:
            answer = ""
    if line.strip():
        assert json.loads(answer)["ok"] is False, answer
    assert proc.poll() is None
    assert request(address, {"op": "status"}, timeout=5)["ok"]


def test_a_coordinator_started_again_is_a_new_incarnation(coordinator):
    address, proc = coordinator()
    before = request(address, {"op": "status"}, timeout=5)["incarnation"]
    proc.kill()
    proc.wait()
    port = int(address.rpartition(":")[2])
    coordinator(port=port)
    after = _ask(address, "a", 0)
    assert after["ok"] and not after["quorum"].startswith(before)


def test_a_taken_store_port_falls_back_to_a_free_one_that_the_answers_name(coordinator):
    import datetime

    import torch.distributed as dist
    port = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        address, _ = coordinator(port=port)
        answer = _ask(address, "a", 0)
    assert answer["ok"] and answer["store_port"] != port + 1, answer
    store = dist.TCPStore("127.0.0.1", answer["store_port"], is_master=False, timeout=datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
