"""Whether a round made progress: the comparison of two failures (what varies between two runs of the same test
does not count, a different failing step does)."""

from __future__ import annotations

import pytest

REPLY = """RESULT: FAIL
EVIDENCE:
- Step 2 (`greet World`) failed at {when}: printed 'Hello World', expected 'Hello, World!' (took {took})
- pytest: 1 failed, 3 passed in {took}
- temp dir {tmp}, server {host}, object at {address}
- Recommended next fix: the format string in greet.py
"""


def failure(when="2026-11-27T17:15:10Z", took="0.52s", tmp="/tmp/pytest-of-u/pytest-12/test0",
            host="127.0.0.1:43211", address="0x7f3a2b10", step="Step 2 (`greet World`)") -> str:
    return REPLY.format(when=when, took=took, tmp=tmp, host=host, address=address).replace(
        "Step 2 (`greet World`)", step)


# --------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------

@pytest.mark.parametrize("other", [
    failure(when="2026-11-28T09:01:02.123+01:00"),                         # another time
    failure(when="17:20:31"),                                              # a clock time
    failure(took="1.9 s"),                                                  # durations, counts of seconds
    failure(took="12 seconds"),
    failure(tmp="/tmp/pytest-of-u/pytest-99/test7"),                        # temporary paths
    failure(tmp="/private/var/folders/x1/abc/T/tmpk2j4h6"),
    failure(host="127.0.0.1:5000"),                                         # addresses
    failure(host="localhost:8080"),
    failure(address="0xdeadbeef"),
    "\n".join(reversed(failure().splitlines())),                            # the order of the findings
    failure().replace("- ", "* ").replace("  ", " "),                       # bullets and spacing
    "\x1b[31m" + failure() + "\x1b[0m",                                     # colours
], ids=["iso-time", "clock-time", "duration", "seconds", "tmp-path", "macos-tmp", "ip-port", "localhost-port",
        "memory-address", "line-order", "bullets-spacing", "colours"])
def test_what_varies_between_runs_of_the_same_test_is_not_progress(orch, other):
    assert orch.failure_signature(other) == orch.failure_signature(failure())


@pytest.mark.parametrize("other", [
    failure(step="Step 3 (`greet --help`)"),                                # another failing step
    failure().replace("printed 'Hello World'", "printed 'Hello,World!'"),   # the same step, other output
    failure() + "- Step 4 also failed: exit code 2\n",                      # a step more
    failure().replace("- Recommended next fix: the format string in greet.py\n", ""),   # a finding less
], ids=["other-step", "other-output", "a-step-more", "a-finding-less"])
def test_a_different_failure_is_progress(orch, other):
    assert orch.failure_signature(other) != orch.failure_signature(failure())


def test_the_failing_step_is_the_first_finding_as_the_tester_wrote_it(orch):
    assert orch.failing_step(failure()) == ("Step 2 (`greet World`) failed at 2026-11-27T17:15:10Z: printed "
                                            "'Hello World', expected 'Hello, World!' (took 0.52s)")
    assert orch.failing_step("RESULT: FAIL\nEVIDENCE:\n") == "(no evidence)"
