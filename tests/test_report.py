"""report.html, the page of a run: self-contained, rewritten after every turn, and checked in a real browser.

The browser checks load the page of a FAIL -> PASS run in headless Chromium (Debian
package `chromium`, which CI installs) and look at what it rendered: the DOM it
dumps after loading (five lanes, a bar per turn, each turn's prompt and reply) and
a screenshot (bars in the FAIL and PASS colours really painted).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import run_main
from fake_cao import FAIL_REPLY, PASS_REPLY
from test_loop import QUICK, QUICK_ROUND, interrupt, state_of

FAIL_THEN_PASS = QUICK_ROUND + ["programmer", "peer_programmer", "tester"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def running_in_ci() -> bool:
    import os
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def chromium(*args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        if running_in_ci():
            pytest.fail("chromium is not installed; CI is set, so the browser tests fail instead of being skipped "
                        "(.ci/run installs Debian's chromium)", pytrace=False)
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-dev-shm-usage", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def passed_run(load_orch, fake_cao, prompt_file):
    fake_cao.script["tester"] = [FAIL_REPLY, PASS_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    return Path(state_of(m)["run_dir"])


class Page(HTMLParser):
    """What the tests look for in a page: lanes, turn bars, turn details with their prompt and reply."""

    def __init__(self, markup: str):
        super().__init__()
        self.lanes: list[str] = []
        self.bars: list[dict] = []          # {"lane", "turn", "verdict", "href"}
        self.details: dict[str, dict] = {}  # id -> {"prompt": text, "reply": text}
        self.external: list[str] = []
        self._lane = self._detail = self._pre = None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if attrs.get(name, "").startswith(("http:", "https:", "//")):
                self.external.append(attrs[name])
        classes = (attrs.get("class") or "").split()
        if "lane" in classes:
            self._lane = attrs["data-role"]
            self.lanes.append(self._lane)
        elif tag == "a" and "turn" in classes:
            self.bars.append({"lane": self._lane, "turn": attrs["data-turn"], "verdict": attrs["data-verdict"],
                              "href": attrs["href"]})
        elif tag == "details":
            self._detail = attrs["id"]
            self.details[self._detail] = {"prompt": "", "reply": ""}
        elif tag == "pre" and self._detail:
            self._pre = classes[0]

    def handle_endtag(self, tag):
        if tag == "pre":
            self._pre = None
        elif tag == "details":
            self._detail = None

    def handle_data(self, data):
        if self._pre and self._detail:
            self.details[self._detail][self._pre] += data


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, bytes per pixel, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG, with the stdlib only."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks = 8, {}
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        chunks.setdefault(kind, []).append(data[position + 8:position + 8 + length])
        position += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and colour in (2, 6) and interlace == 0
    size = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    stride, rows, previous = width * size, [], bytearray(width * size)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - size] if x >= size else 0
            up, corner = previous[x], previous[x - size] if x >= size else 0
            if kind == 1:
                line[x] = (line[x] + left) & 255
            elif kind == 2:
                line[x] = (line[x] + up) & 255
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - corner
                best = min((abs(guess - left), 0, left), (abs(guess - up), 1, up), (abs(guess - corner), 2, corner))
                line[x] = (line[x] + best[2]) & 255
        rows.append(bytes(line))
        previous = line
    return width, size, rows


TRACK = "#f1f1f1"      # the background of a lane's track in the timeline


def count_in_timeline(path: Path, hex_colour: str) -> int:
    """Pixels of a colour in the rows of the timeline's lanes (rows that also show a track's background),
    so the legend below it, with the same colours, does not count."""
    target, track = bytes.fromhex(hex_colour.lstrip("#")), bytes.fromhex(TRACK.lstrip("#"))
    width, size, rows = png_pixels(path)
    count = 0
    for row in rows:
        pixels = [row[x:x + 3] for x in range(0, width * size, size)]
        if track in pixels:
            count += pixels.count(target)
    return count


def test_the_report_is_one_file_that_needs_nothing_from_the_network(passed_run):
    markup = (passed_run / "report.html").read_text(encoding="utf-8")
    page = Page(markup)
    assert page.external == []
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", markup)
    assert page.lanes == ["analyst", "peer_analyst", "programmer", "peer_programmer", "tester"]
    assert [bar["turn"] for bar in sorted(page.bars, key=lambda b: int(b["turn"]))] == \
        [str(n) for n in range(1, 9)]
    assert 'data-result="PASS"' in markup


def test_a_page_opened_mid_run_shows_the_turn_under_way(load_orch, fake_cao, prompt_file):
    fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt())]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    page = Page((Path(state_of(m)["run_dir"]) / "report.html").read_text(encoding="utf-8"))
    assert [(bar["lane"], bar["verdict"]) for bar in page.bars] == [
        ("analyst", ""), ("peer_analyst", "APPROVED"), ("programmer", "unanswered")]
    assert "Write your complete answer to this file:" in page.details["turn-3"]["prompt"]
    assert page.details["turn-3"]["reply"] == ""


def test_headless_chromium_renders_the_lanes_turns_prompts_and_replies(passed_run):
    report = passed_run / "report.html"
    dumped = chromium("--dump-dom", report.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    page = Page(dumped.stdout)
    assert page.lanes == ["analyst", "peer_analyst", "programmer", "peer_programmer", "tester"]
    lanes = {bar["turn"]: bar["lane"] for bar in page.bars}
    assert [lanes[str(n)] for n in range(1, 9)] == FAIL_THEN_PASS
    assert [bar["verdict"] for bar in page.bars if bar["lane"] == "tester"] == ["FAIL", "PASS"]
    for bar in page.bars:                                    # a click on a bar leads to its turn
        detail = page.details[bar["href"].lstrip("#")]
        assert "Write your complete answer to this file:" in detail["prompt"]
        assert detail["reply"].strip()
    assert page.details["turn-5"]["reply"].strip() == FAIL_REPLY.strip()
    assert page.details["turn-8"]["reply"].strip() == PASS_REPLY.strip()


def test_headless_chromium_paints_the_fail_and_pass_bars_in_their_colours(passed_run, orch):
    shot = passed_run / "report.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1200,900", "--hide-scrollbars",
                     (passed_run / "report.html").as_uri())
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    # The run's 8 turns share the timeline's width: the tester's two bars, FAIL and PASS, are wide.
    assert count_in_timeline(shot, orch.REPORT_COLOURS["FAIL"]) > 500
    assert count_in_timeline(shot, orch.REPORT_COLOURS["PASS"]) > 500
    assert count_in_timeline(shot, orch.REPORT_COLOURS["APPROVED"]) > 500
    assert count_in_timeline(shot, orch.REPORT_COLOURS["REVISE"]) == 0        # no review asked for changes
