"""The coordinator of replicas that survive each other's failures
(`python -m zero_ext.coordinator`, a process of its own): it decides, step
by step, which replicas train together (the quorum), and hosts the store
their cross-replica process groups meet through.

[Note: quorums]
Each replica (one torchrun job) asks, from its rank 0, before every
optimizer step: "replica R, at step S, fingerprint F: who steps with me?"
The coordinator answers once every live replica has asked (a replica is
live while its heartbeats arrive: one every HEARTBEAT_S, dead after
`dead_after` seconds without), so the quorum is also the replicas' step
barrier. Its answer: a quorum id (new for every answer), a group id (prefixed by the
coordinator's incarnation: the same as the last quorum's while its members,
the same processes, had no failure, else a new one, so a group a failed or
dead member was part of, or an earlier coordinator's, is never used again),
the members in replica-id order, the
step they take (the highest asked), who contributes a gradient (the
members at that step) and who first takes the state of a member at it (the
replicas behind: restarted ones, or one that missed a commit), from whom.
A replica whose fingerprint (its wrap's options and model) differs from
the quorum's is refused, naming the fields. The wire: one JSON object per
line over TCP, one request per connection; a malformed or unknown request
is answered with an error and never stops the server.
"""
from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
import uuid
from typing import Dict, List, Optional

HEARTBEAT_S = 0.5
MAX_REQUEST_BYTES = 1 << 20  # a fingerprint is a few KiB; nothing legitimate comes near this
MAX_WAIT_S = 3600.0  # the longest a quorum request may wait (replicas ask for 600 s)
LINGER_SECONDS = 2.0  # how long an answered asker may take to end its side before the server closes
LINGER_BYTES = 8 * MAX_REQUEST_BYTES  # past this, an asker that keeps sending is cut off


class _Replica:
    def __init__(self, replica_id: str, incarnation: str) -> None:
        self.id = replica_id
        self.incarnation = incarnation
        self.seen = time.monotonic()
        self.asking: Optional[dict] = None  # its quorum request, while it waits
        self.answer: Optional[dict] = None


class Coordinator:
    """The quorum state; thread-safe (one thread per connection)."""

    def __init__(self, min_replicas: int = 1, dead_after: float = 5.0, store_port: int = 0) -> None:
        self.store_port = store_port  # where the replicas' groups meet (told in every answer)
        self.min_replicas = max(1, int(min_replicas))
        self.dead_after = float(dead_after)
        self.incarnation = uuid.uuid4().hex[:12]
        self.replicas: Dict[str, _Replica] = {}
        self.reference: Optional[Dict[str, str]] = None  # the fingerprint every replica must have
        self.quorums = 0
        self.groups = 0
        self.last_members: List[tuple] = []  # (id, incarnation) of the last quorum, whose group may serve again
        self.formed_once = False
        self.lock = threading.Condition()

    # --- requests ---------------------------------------------------------
    def handle(self, request: dict, gone=lambda: False) -> dict:
        """Answers one request; `gone()`: whether the asker has hung up."""
        op = request.get("op")
        if op == "heartbeat":
            return self._heartbeat(request)
        if op == "quorum":
            return self._quorum(request, gone)
        if op == "status":
            with self.lock:
                return {"ok": True, "incarnation": self.incarnation, "quorums": self.quorums,
                        "live": sorted(r.id for r in self._live())}
        raise ValueError(f"unknown op {op!r} (heartbeat, quorum or status)")

    def _replica(self, request: dict) -> _Replica:
        rid, inc = request.get("replica"), request.get("incarnation")
        if not isinstance(rid, str) or not rid or not isinstance(inc, str) or not inc:
            raise ValueError("a request names its 'replica' and 'incarnation' (non-empty strings)")
        known = self.replicas.get(rid)
        if known is None or known.incarnation != inc:  # new, or started again
            known = self.replicas[rid] = _Replica(rid, inc)
        known.seen = time.monotonic()
        return known

    def _heartbeat(self, request: dict) -> dict:
        with self.lock:
            self._replica(request)
            self.lock.notify_all()
            return {"ok": True}

    def _live(self) -> List[_Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values() if now - r.seen <= self.dead_after]

    def _quorum(self, request: dict, gone) -> dict:
        step = request.get("step")
        fingerprint = request.get("fingerprint")
        if not isinstance(step, int) or step < 0:
            raise ValueError("a quorum request gives its 'step' (an int >= 0)")
        if not isinstance(fingerprint, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in fingerprint.items()):
            raise ValueError("a quorum request gives its 'fingerprint' ({field: text})")
        timeout = request.get("timeout", 600.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_WAIT_S:
            raise ValueError(f"a quorum request's 'timeout' is seconds in (0, {MAX_WAIT_S:g}]")  # NaN too
        deadline = time.monotonic() + timeout
        with self.lock:
            me = self._replica(request)
            refused = self._differs(fingerprint)
            if refused:
                return {"ok": False, "error": refused}
            me.asking, me.answer = {"step": step, "fingerprint": fingerprint, "fresh": bool(request.get("fresh")),
                                    "failed": bool(request.get("failed"))}, None
            self.lock.notify_all()
            while me.answer is None:
                if gone():  # died while waiting: it no longer asks, and its heartbeats stop
                    me.asking = None
                    return {"ok": False, "error": "the asker hung up"}
                me.seen = time.monotonic()  # waiting on an open connection is being alive
                self._form_if_ready()
                if me.answer is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    me.asking = None
                    return {"ok": False, "error": f"no quorum formed within {timeout:g} s"}
                self.lock.wait(min(left, HEARTBEAT_S))
            answer, me.answer = me.answer, None
            return answer

    def _differs(self, fingerprint: Dict[str, str]) -> str:
        if self.reference is None:
            return ""
        fields = sorted(k for k in set(fingerprint) | set(self.reference)
                        if fingerprint.get(k) != self.reference.get(k))
        if not fields:
            return ""
        shown = "; ".join(f"{k}: {fingerprint.get(k, '(none)')!s:.200} here, {self.reference.get(k, '(none)')!s:.200} "
                          "in the quorum" for k in fields[:4])
        return (f"this replica was wrapped differently from the replicas training: {shown}. Start it with the "
                "same model and zero_ext.wrap options.")

    def _form_if_ready(self) -> None:
        live = self._live()
        asking = [r for r in live if r.asking is not None]
        if not asking or len(asking) < len(live):
            return  # a live replica has not asked yet: it will (its heartbeats say it is there)
        if not self.formed_once and len(asking) < self.min_replicas:
            return
        self.formed_once = True
        self.quorums += 1
        members = sorted(asking, key=lambda r: r.id)
        top = max(r.asking["step"] for r in members)
        at_top = [r for r in members if r.asking["step"] == top]
        # The source: a member at the top step that has trained before, else
        # (every one fresh: the first quorum) the first; a fresh replica
        # other than it takes its state too, as DDP's first broadcast. Those
        # taking a state do not contribute this step's gradient (computed
        # from other weights).
        source = next((r for r in at_top if not r.asking["fresh"]), at_top[0])
        recovering = [r.id for r in members if r.asking["step"] < top or (r.asking["fresh"] and r is not source)]
        if self.reference is None:
            self.reference = dict(source.asking["fingerprint"])
        # The same members (the same processes) and no failure since: the
        # last quorum's group serves again; otherwise a new one is made.
        key = [(r.id, r.incarnation) for r in members]
        if key != self.last_members or any(r.asking["failed"] for r in members) or self.groups == 0:
            self.groups += 1
        self.last_members = key
        answer = {"ok": True, "quorum": f"{self.incarnation}-q{self.quorums}", "store_port": self.store_port,
                  "group": f"{self.incarnation}-g{self.groups}", "members": [r.id for r in members],
                  "step": top, "contributors": [r.id for r in at_top if r.id not in recovering],
                  "recovering": recovering, "source": source.id}
        for r in members:
            r.answer, r.asking = dict(answer), None
        self.lock.notify_all()


class _Handler(socketserver.StreamRequestHandler):
    def _gone(self) -> bool:
        """Whether the asker closed its end (a process that died): its socket reads EOF."""
        try:
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def handle(self) -> None:
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
            if len(line) > MAX_REQUEST_BYTES:
                raise ValueError(f"a request is at most {MAX_REQUEST_BYTES} bytes")
            request = json.loads(line.decode("utf-8"))
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
            answer = self.server.coordinator.handle(request, self._gone)
        except Exception as error:  # noqa: BLE001 - any bad input is answered, never fatal
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        try:
            self.wfile.write((json.dumps(answer) + "\n").encode())
            self._linger()
        except OSError:
            pass  # the asker is gone (a replica that died while waiting)

    def _linger(self) -> None:
        """Ends the answer, then reads (bounded) what the asker still sends until it ends its side.
        Closing a socket with unread input makes the kernel reset the connection, and an asker still
        sending (a request over the limit) or not yet done sending then loses the answer: the lingering
        close of HTTP servers."""
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(LINGER_SECONDS)
        left = LINGER_BYTES
        while left > 0:
            chunk = self.connection.recv(min(1 << 16, left))
            if not chunk:
                return
            left -= len(chunk)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(host: str, port: int, store_port: int, min_replicas: int = 1, dead_after: float = 5.0,
          ready=None) -> None:
    """Runs the coordinator until the process ends: the quorum server on
    `port`, the store the cross-replica groups meet through on `store_port`
    (if it is taken, any free port: the answers tell the replicas which)."""
    import datetime

    import torch.distributed as dist
    server = _Server((host, port), _Handler)
    try:
        store = dist.TCPStore(host, store_port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
    except (RuntimeError, OSError):
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    server.coordinator = Coordinator(min_replicas, dead_after, store.port)
    server.store = store  # held for the process's life
    if ready is not None:
        ready(server)
    server.serve_forever(poll_interval=0.2)


def request(address: str, body: dict, timeout: float) -> dict:
    """One request to the coordinator at HOST:PORT; raises OSError when it cannot be reached."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall((json.dumps(body) + "\n").encode())
        sock.settimeout(timeout)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise ConnectionError(f"the coordinator at {address} closed the connection without an answer")
    return json.loads(data.decode("utf-8"))
