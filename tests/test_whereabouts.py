"""zero_ext/groups/stall_query.py alone: what a rank answers a stalled peer, and
that its answering threads are stopped and joined at interpreter exit (a
daemon thread left inside a store call when Python finalizes aborts the
process: seen in about 1 of 8 two-rank launches before the atexit join).
The answer "blocked in a world barrier" is checked end to end in
tests/test_faults.py (a stage 3 model used on rank 0 only)."""
import time
import types

import torch

from zero_ext.groups import stall_query as whereabouts


class FakeCore:
    """The core's diagnostics handle (zero_ext/tools/core_handles.py), recording answers."""

    def __init__(self):
        self.queries = 0
        self.answers = []

    def stall_queries(self):
        return self.queries

    def post_whereabouts(self, query, blocked, where):
        self.answers.append((query, blocked, where))


def test_answers_a_query_with_where_the_main_thread_is_and_stops_at_exit():
    model = torch.nn.Linear(2, 2)
    core = FakeCore()
    thread = whereabouts.start(model, types.SimpleNamespace(diagnostics=core))
    try:
        core.queries = 1  # a peer stalled and asked
        deadline = time.monotonic() + 5 * whereabouts.POLL_S
        while not core.answers and time.monotonic() < deadline:
            time.sleep(0.05)  # this (main) thread is running Python, not blocked in a collective
        assert core.answers, "no answer within 5 polls"
        query, blocked, where = core.answers[0]
        assert query == 1 and not blocked and where.startswith("running ") and "test_whereabouts.py" in where
        whereabouts._stop_all()  # what atexit runs
        assert not thread.is_alive()
    finally:
        whereabouts._STOP.clear()

