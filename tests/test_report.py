"""report.html, the page of a run: self-contained, rewritten after every turn, and checked in a real browser.

The browser checks load the page of a FAIL -> PASS run in headless Chromium (Debian
package `chromium`, which CI installs; one browser for all pages, each in a tab of its
own) and look at what it rendered: the DOM once loaded (five lanes, a bar per turn, each turn's prompt and reply, the
heading, times, files, scenario test and last evidence), what a script finds
visible, a screenshot (bars in the FAIL and PASS colours really painted), and the
requests of a page served over HTTP (a page of a run still going reloads itself, a
finished one does not).
"""

from __future__ import annotations

import base64
import fcntl
import html
import http.server
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager, suppress
from datetime import datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import TASK_PROMPT, run_main
from fake_cao import FAIL_REPLY, PASS_REPLY, PROGRAMMER_REPLY
from test_loop import QUICK, QUICK_ROUND, interrupt, state_of

FAIL_THEN_PASS = QUICK_ROUND + ["programmer", "peer_programmer", "tester"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def running_in_ci() -> bool:
    import os
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def need_chromium() -> str:
    """The browser's command; without one, the test fails where CI is set and is skipped elsewhere."""
    if CHROMIUM is None:
        if running_in_ci():
            pytest.fail("chromium is not installed; CI is set, so the browser tests fail instead of being skipped "
                        "(.ci/run installs Debian's chromium)", pytrace=False)
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return CHROMIUM


CHROMIUM_OPTIONS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--no-first-run", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage")


class Browser:
    """One headless Chromium kept open for the tests that look at pages, driven over the DevTools protocol
    on a pipe (--remote-debugging-pipe: commands in on its fd 3, answers out on its fd 4, each a JSON
    message ended by a NUL): each page is opened in a tab of its own, which is closed after."""

    def __init__(self, command: str, timeout: float = 120):
        self.timeout, self.next_id, self.pending, self.unread = timeout, 0, [], b""
        self.profile = tempfile.TemporaryDirectory(prefix="report-chromium-", ignore_cleanup_errors=True)
        commands_in, self.commands = os.pipe()
        self.answers, answers_out = os.pipe()

        def onto_3_and_4():              # in the child: its ends of the pipes where Chromium looks for them
            ends = [fcntl.fcntl(end, fcntl.F_DUPFD, 5) for end in (commands_in, answers_out)]
            os.dup2(ends[0], 3)
            os.dup2(ends[1], 4)

        self.process = subprocess.Popen(
            [command, *CHROMIUM_OPTIONS, f"--user-data-dir={self.profile.name}", "--remote-debugging-pipe",
             "about:blank"], preexec_fn=onto_3_and_4, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True)
        os.close(commands_in)
        os.close(answers_out)

    def close(self) -> None:
        """Ask Chromium to end, end what is left of it, and remove its profile."""
        with suppress(OSError):
            os.write(self.commands, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.communicate()
        os.close(self.commands)
        os.close(self.answers)
        shutil.rmtree(self.profile.name, ignore_errors=True)

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self.unread:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.answers], [], [], left)[0]:
                pytest.fail(f"chromium did not answer within {self.timeout} s", pytrace=False)
            chunk = os.read(self.answers, 1 << 20)
            if not chunk:
                pytest.fail("chromium ended: " + self.process.stderr.read().decode(errors="replace")[-2000:],
                            pytrace=False)
            self.unread += chunk
        message, self.unread = self.unread.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command and return its result (events that arrive meanwhile are kept for `event`)."""
        self.next_id += 1
        command = {"id": self.next_id, "method": method, "params": params}
        if session:
            command["sessionId"] = session
        os.write(self.commands, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._message(deadline)
            if message.get("id") == self.next_id:
                assert "error" not in message, (method, message["error"])
                return message["result"]
            self.pending.append(message)

    def event(self, method: str, session: str, timeout: float | None = None) -> dict:
        """Wait for an event of a tab."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for message in self.pending:
                if message.get("method") == method and message.get("sessionId") == session:
                    self.pending.remove(message)
                    return message["params"]
            self.pending.append(self._message(deadline))

    @contextmanager
    def page(self, url: str, width: int, height: int):
        """A new tab of the given size that has loaded `url` (its load event fired); closed after."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        try:
            self.call("Page.enable", session)
            self.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height,
                      deviceScaleFactor=1, mobile=False)
            self.call("Emulation.setScrollbarsHidden", session, hidden=True)
            self.call("Page.navigate", session, url=url)
            self.event("Page.loadEventFired", session)
            yield session
        finally:
            self.call("Target.closeTarget", targetId=target)
            self.pending = [m for m in self.pending if m.get("sessionId") != session]

    def dom(self, url: str, width: int = 800, height: int = 600) -> str:
        """The page's markup once it has loaded and run its scripts, as `chromium --dump-dom` prints it."""
        with self.page(url, width, height) as session:
            return self.markup(session)

    def markup(self, session: str) -> str:
        return self.call("Runtime.evaluate", session, expression="document.documentElement.outerHTML",
                         returnByValue=True)["result"]["value"]

    def dom_after(self, url: str, milliseconds: int) -> str:
        """The markup of the page a tab shows once `milliseconds` have passed on its clock from opening `url`
        (virtual time, as --virtual-time-budget gives it: it runs on while nothing is being fetched, so a
        page's timers -- a reload -- come in well under a real second)."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        try:
            self.call("Emulation.setVirtualTimePolicy", session, policy="pause")
            self.call("Page.navigate", session, url=url)
            self.call("Emulation.setVirtualTimePolicy", session, policy="pauseIfNetworkFetchesPending",
                      budget=milliseconds)
            self.event("Emulation.virtualTimeBudgetExpired", session, timeout=60)   # a page that kept
            #                                                         reloading would never let it expire
            return self.markup(session)
        finally:
            self.call("Target.closeTarget", targetId=target)
            self.pending = [m for m in self.pending if m.get("sessionId") != session]

    def screenshot(self, url: str, path: Path, width: int, height: int) -> None:
        """What the tab of that size shows of the loaded page, as a PNG file (scroll bars hidden)."""
        with self.page(url, width, height) as session:
            shot = self.call("Page.captureScreenshot", session, format="png")["data"]
        path.write_bytes(base64.b64decode(shot))


@pytest.fixture(scope="session")
def browser():
    """The Chromium the page tests share (per process of the run: one start, not one per page)."""
    shared = Browser(need_chromium())
    yield shared
    shared.close()


def dump_dom(browser: Browser, target: str, width: int = 800, height: int = 600) -> "Dom":
    return Dom(browser.dom(target, width, height))


# The page tests only read the runs they look at, so each run is made once per process, in a folder of its own.
_RUNS_MADE: dict[str, tuple[Path, object]] = {}


def made_once(name: str, load_orch, fake_cao, tmp_path_factory, make) -> tuple:
    """The module loaded on the run `name` and what `make(m)` gave when it made that run: the first test of
    this process that asks for it makes it, the others load the module on its folder."""
    name = f"{name}-{time.tzname[0]}"               # a run's page shows its times in the zone it was made in
    if name not in _RUNS_MADE:
        wd = tmp_path_factory.mktemp(name)
        (wd / "task.md").write_text(TASK_PROMPT, encoding="utf-8")
        (wd / "project").mkdir()
        _RUNS_MADE[name] = (wd, make(load_orch(PROMPT_FILE=str(wd / "task.md"), WD=str(wd / "project"), **QUICK)))
    wd, made = _RUNS_MADE[name]
    m = load_orch(PROMPT_FILE=str(wd / "task.md"), WD=str(wd / "project"), **QUICK)
    m.load_state()                                  # its globals as the run left them (its folder, ...)
    return m, made


def fail_then_pass(fake_cao):
    """Make a run that fails its test in round 1 and passes in round 2, keeping its page as it was while the
    tester worked on round 1: its folder, and that page."""
    def make(m):
        snapshots: list[str] = []
        fake_cao.script["tester"] = [snapshot_then_answer(FAIL_REPLY, snapshots), PASS_REPLY]
        assert run_main(m) == 0
        return Path(state_of(m)["run_dir"]), snapshots[0]
    return make


@pytest.fixture
def passed(load_orch, fake_cao, tmp_path_factory):
    """A run that fails its test in round 1 and passes in round 2: its module and its folder."""
    m, (folder, _) = made_once("fail-then-pass", load_orch, fake_cao, tmp_path_factory, fail_then_pass(fake_cao))
    return m, folder


@pytest.fixture
def passed_run(passed):
    return passed[1]


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


def unfilter(kind: int, line: bytearray, previous: bytes, size: int) -> bytes:
    """One PNG scanline with its filter undone (PNG spec, section 9), each filter type as one tight loop."""
    stride = len(line)
    if kind == 1:                                           # Sub
        for x in range(size, stride):
            line[x] = (line[x] + line[x - size]) & 255
    elif kind == 2:                                         # Up
        line = bytearray(map(lambda a, b: (a + b) & 255, line, previous))
    elif kind == 3:                                         # Average
        for x in range(stride):
            line[x] = (line[x] + ((line[x - size] if x >= size else 0) + previous[x]) // 2) & 255
    elif kind == 4:                                         # Paeth
        for x in range(stride):
            left, up = (line[x - size], previous[x]) if x >= size else (0, previous[x])
            corner = previous[x - size] if x >= size else 0
            guess = left + up - corner
            near_left, near_up, near_corner = abs(guess - left), abs(guess - up), abs(guess - corner)
            if near_left <= near_up and near_left <= near_corner:
                line[x] = (line[x] + left) & 255
            elif near_up <= near_corner:
                line[x] = (line[x] + up) & 255
            else:
                line[x] = (line[x] + corner) & 255
    return bytes(line)


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
    stride, rows, previous = width * size, [], bytes(width * size)
    for y in range(height):
        start = y * (stride + 1)
        previous = unfilter(raw[start], bytearray(raw[start + 1:start + 1 + stride]), previous, size)
        rows.append(previous)
    return width, size, rows


TRACK = "#f1f1f1"      # the background of a lane's track in the timeline


def counts_in_timeline(path: Path, *hex_colours: str) -> list[int]:
    """Pixels of each colour in the rows of the timeline's lanes (rows that also show a track's background),
    so the legend below it, with the same colours, does not count. The picture is decoded once for all."""
    targets, track = [bytes.fromhex(c.lstrip("#")) for c in hex_colours], bytes.fromhex(TRACK.lstrip("#"))
    width, size, rows = png_pixels(path)
    counts = [0] * len(targets)
    for row in rows:
        pixels = [row[x:x + 3] for x in range(0, width * size, size)]
        if track in pixels:
            counts = [count + pixels.count(target) for count, target in zip(counts, targets)]
    return counts


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


def test_headless_chromium_renders_the_lanes_turns_prompts_and_replies(browser, passed_run):
    report = passed_run / "report.html"
    page = Page(browser.dom(report.as_uri()))
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


def test_headless_chromium_paints_the_fail_and_pass_bars_in_their_colours(browser, passed_run, orch):
    shot = passed_run / "report.png"
    browser.screenshot((passed_run / "report.html").as_uri(), shot, 1200, 900)
    # The run's 8 turns share the timeline's width: the tester's two bars, FAIL and PASS, are wide.
    fail, passed, approved, revise = counts_in_timeline(shot, *(orch.REPORT_COLOURS[verdict] for verdict in
                                                                ("FAIL", "PASS", "APPROVED", "REVISE")))
    assert fail > 500 and passed > 500 and approved > 500
    assert revise == 0                                  # no review asked for changes


# -- what a page says, and what a browser makes of it -----------------------------------------------

SCENARIO = "Run `greet World` and expect `Hello, World!` on stdout."      # the scenario test of conftest's task
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
CET = "CET-1CEST,M3.5.0,M10.5.0/3"          # Central European time, without the zone database


class Element:
    def __init__(self, tag: str, attrs: dict, parent: Element | None):
        self.tag, self.attrs, self.parent, self.children = tag, attrs, parent, []

    @property
    def text(self) -> str:
        return "".join(child if isinstance(child, str) else child.text for child in self.children)

    def walk(self):
        for child in self.children:
            if isinstance(child, Element):
                yield child
                yield from child.walk()

    def find_all(self, tag: str | None = None, **attrs: str) -> list[Element]:
        """Elements below this one of a tag and with attributes (`class_` names one of their classes)."""
        def matches(element: Element) -> bool:
            for name, value in attrs.items():
                if name == "class_":
                    if value not in (element.attrs.get("class") or "").split():
                        return False
                elif element.attrs.get(name.replace("_", "-")) != value:
                    return False
            return tag is None or element.tag == tag
        return [element for element in self.walk() if matches(element)]

    def one(self, tag: str | None = None, **attrs: str) -> Element:
        found = self.find_all(tag, **attrs)
        assert len(found) == 1, f"{len(found)} elements <{tag} {attrs}>"
        return found[0]

    def ancestors(self) -> list[str]:
        element, tags = self.parent, []
        while element is not None:
            tags.append(element.tag)
            element = element.parent
        return tags


class Dom(Element):
    """A page's markup as a tree of elements (html.parser only)."""

    def __init__(self, markup: str):
        super().__init__("#document", {}, None)
        self._open: Element = self
        parser = HTMLParser(convert_charrefs=True)
        parser.handle_starttag = self._start
        parser.handle_startendtag = lambda tag, attrs: self._start(tag, attrs, void=True)
        parser.handle_endtag = self._end
        parser.handle_data = lambda data: self._open.children.append(data)
        parser.feed(markup)
        parser.close()

    def _start(self, tag, attrs, void=False):
        element = Element(tag, {name: value or "" for name, value in attrs}, self._open)
        self._open.children.append(element)
        if not void and tag not in VOID_TAGS:
            self._open = element

    def _end(self, tag):
        element = self._open
        while element is not self and element.tag != tag:
            element = element.parent
        if element is not self:
            self._open = element.parent

    def figures(self) -> dict[str, Element]:
        """The run's facts: each <dt> name with its <dd>."""
        items = [child for child in self.one("dl", id="figures").children if isinstance(child, Element)]
        return {dt.text: dd for dt, dd in zip(items[::2], items[1::2])}

    def by_id(self, element_id: str) -> Element:
        return self.one(id=element_id)


def with_probe(markup: str, script: str) -> str:
    """The page with a script of the test's at its end, which writes what it finds into attributes."""
    return markup.replace("</body>", f"<script>{script}</script>\n</body>")


VISIBILITY_PROBE = """
for (const selector of %s) {
  const element = document.querySelector(selector);
  const box = element ? element.getBoundingClientRect() : null;
  const shown = !!element && element.checkVisibility() && box.width > 0 && box.height > 0;
  document.body.insertAdjacentHTML("beforeend", "<i class='probe'></i>");
  const mark = document.body.lastElementChild;
  mark.setAttribute("data-selector", selector);
  mark.setAttribute("data-visible", String(shown));
  mark.setAttribute("data-text", element ? element.innerText : "");
}
"""


def visibility(browser: Browser, folder: Path, markup: str, *selectors: str) -> dict[str, tuple[bool, str]]:
    """selector -> (whether Chromium shows that element, the text it renders there)."""
    probe = folder / "probe.html"
    probe.write_text(with_probe(markup, VISIBILITY_PROBE % json.dumps(selectors)), encoding="utf-8")
    dom = dump_dom(browser, probe.as_uri(), 1200, 900)
    return {mark.attrs["data-selector"]: (mark.attrs["data-visible"] == "true", mark.attrs["data-text"])
            for mark in dom.find_all("i", class_="probe")}


def snapshot_then_answer(reply: str, snapshots: list[str]) -> dict:
    """A tester step that keeps the run's page as it is while the tester works, then answers."""
    def call(fake, terminal):
        response = Path(terminal.response_path)
        snapshots.append((response.parent.parent / "latest" / "report.html").read_text(encoding="utf-8"))
        response.write_text(reply, encoding="utf-8")
        terminal.status = "completed"
    return {"action": "call", "call": call}


@pytest.fixture
def mid_run(load_orch, fake_cao, tmp_path_factory):
    """A FAIL -> PASS run, and its page as it was while the tester worked on round 1 (the run still going)."""
    return made_once("fail-then-pass", load_orch, fake_cao, tmp_path_factory, fail_then_pass(fake_cao))[1]


@pytest.fixture
def interrupted_run(load_orch, fake_cao, tmp_path_factory):
    """A run stopped by Ctrl-C while the programmer works (exit 130, still RUNNING in its state)."""
    def make(m):
        fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt())]
        assert run_main(m) == 130
        return Path(state_of(m)["run_dir"])
    return made_once("interrupted", load_orch, fake_cao, tmp_path_factory, make)[1]


@pytest.fixture
def cet(monkeypatch):
    """This machine's clock in Central European time."""
    monkeypatch.setenv("TZ", CET)
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def render(m, folder: Path, summary: dict, name: str = "page.html") -> Path:
    path = folder / name
    path.write_text(m.report_html(summary), encoding="utf-8")
    return path


def summary_of(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text(encoding="utf-8"))


# -- the heading -------------------------------------------------------------------------------------

LONG_LINE = ("Let anyone greet from the shell: `greet NAME` prints `Hello, NAME!`, and `greet --shout NAME` "
             "prints it in capitals, for any NAME given on the command line")


@pytest.mark.parametrize("explore, heading", [
    ("Business goal:\n\nLet people greet each other.", "Let people greet each other."),
    ("# Task\nBuild a greeting CLI.", "Build a greeting CLI."),
    ("=== ORIGINAL REQUEST ===\n## Overview\n**Goal:**\n- Build `greet`.", "Build `greet`."),
    ("---\nSummary\n\n> Add a --shout flag to greet", "Add a --shout flag to greet"),
    ("```\n\n```\nTask description:\n1. Add tests for greet", "Add tests for greet"),
    (LONG_LINE, LONG_LINE),
    ("# Greeting CLI for the team", "Greeting CLI for the team"),
    ("Цель:\nПриветствие для всех", "Приветствие для всех"),
    ("Build `greet`: `greet NAME` prints\n`Hello, NAME!`, exit 0.\nMore detail.", "Build `greet`: `greet NAME` prints "
     "`Hello, NAME!`, exit 0."),                              # a first sentence wrapped in the file: to its end
    ("Goal:\n1. Add tests for greet\n2. Add a --shout flag", "Add tests for greet"),
])
def test_the_heading_is_the_tasks_first_meaningful_line_whole(orch, explore, heading):
    orch.set_task(f"{orch.EXPLORE_HEADER}\n{explore}\n{orch.SCENARIO_HEADER}\nRun greet World.\n")
    assert orch.task_heading() == heading


def test_commit_subjects_and_notification_titles_keep_their_cut_first_line(orch):
    orch.set_task(f"{orch.EXPLORE_HEADER}\n{LONG_LINE}\n{orch.SCENARIO_HEADER}\nRun greet World.\n")
    assert orch.task_title() == LONG_LINE[:69].rstrip() + "..."


def test_the_page_heads_with_the_first_meaningful_line_and_shows_its_code_as_code(browser, load_orch, fake_cao, tmp_path):
    task = tmp_path / "labelled-task.md"
    task.write_text(f"*** ORIGINAL EXPLORE SUMMARY ***\nBusiness goal:\n\n# Task\n{LONG_LINE}\n\nMore detail.\n"
                    f"*** SCENARIO TEST ***\n{SCENARIO}\n", encoding="utf-8")
    m = load_orch(PROMPT_FILE=str(task), **QUICK)
    assert run_main(m) == 0
    dom = dump_dom(browser, (Path(m.run_dir) / "report.html").as_uri())
    heading = dom.by_id("task")
    assert heading.tag == "h1"
    assert heading.text == LONG_LINE.replace("`", "")
    assert [code.text for code in heading.find_all("code")] == ["greet NAME", "Hello, NAME!", "greet --shout NAME"]
    assert dom.one("title").text == "PASS: " + LONG_LINE.replace("`", "")


WRAPPED_TASK = ("*** ORIGINAL EXPLORE SUMMARY ***\nBuild a tiny greeting CLI in an empty Python project: `python "
                "greet.py NAME` prints\n`Hello, NAME!` and exits 0; without NAME it prints the usage on stderr\nand "
                f"exits 2. Add tests for both cases.\n*** SCENARIO TEST ***\n{SCENARIO}\n")
WRAPPED_HEADING = ("Build a tiny greeting CLI in an empty Python project: python greet.py NAME prints Hello, NAME! and "
                   "exits 0; without NAME it prints the usage on stderr and exits 2. Add tests for both cases.")
GEOMETRY_PROBE = """
document.body.style.letterSpacing = ".15em";        // a wider font than this machine's: longer role names
const gaps = [...document.querySelectorAll(".lane")].map(lane => {
  const words = document.createRange();
  words.selectNodeContents(lane.querySelector(".lane-label"));
  return lane.querySelector(".track").getBoundingClientRect().left - words.getBoundingClientRect().right;
});
const heading = document.getElementById("task");
document.body.setAttribute("data-gaps", JSON.stringify(gaps));
document.body.setAttribute("data-heading-overflows", String(heading.scrollWidth > heading.clientWidth));
"""


def test_a_run_of_scripted_agents_says_so_at_its_start_its_pass_in_its_summary_and_on_its_page(
        browser, load_orch, fake_cao, tmp_path, capsys):
    """PROVIDER=mock_cli on a task of the user's own: the start says the agents are scripted and that a PASS
    means nothing, and so do the PASS line, summary.json and the page, whose heading is the task's first
    sentence whole, wrapped (two lines of the file), and whose lane labels keep clear of their bars."""
    task = tmp_path / "own-task.md"
    task.write_text(WRAPPED_TASK, encoding="utf-8")
    m = load_orch(PROMPT_FILE=str(task), PROVIDER="mock_cli", **QUICK)
    assert run_main(m) == 0
    out = capsys.readouterr().out
    words = "scripted agents: nothing was built or tested by an AI"
    assert f"{words}; warning: this task is not the demo's" in out and "a PASS here means nothing" in out
    assert re.search(rf"PASS in round 1; {words}; state in ", out), out[-2000:]
    summary = summary_of(Path(m.run_dir))
    assert (summary["scripted_agents"], summary["scripted_note"]) == (True, words)
    markup = (Path(m.run_dir) / "report.html").read_text(encoding="utf-8")
    shown = visibility(browser, tmp_path, markup, "#scripted-agents", "#task")
    assert shown["#scripted-agents"] == (True, f"-- {words}")
    assert shown["#task"] == (True, WRAPPED_HEADING)
    probe = tmp_path / "geometry.html"
    probe.write_text(with_probe(markup, GEOMETRY_PROBE), encoding="utf-8")
    body = dump_dom(browser, probe.as_uri(), 800, 600).one("body")
    assert body.attrs["data-heading-overflows"] == "false"           # wrapped within the page, not cut
    gaps = json.loads(body.attrs["data-gaps"])
    assert len(gaps) == 5 and min(gaps) >= 6, gaps    # each role's name clear of its bars, in any font


def test_the_demos_task_on_scripted_agents_is_not_warned_of_and_a_real_cli_says_nothing(orch, capsys):
    from orchestrator_scripted_agent import DEMO_TASK
    orch.set_task(DEMO_TASK)
    orch.PROVIDER = "mock_cli"
    orch.say_scripted_agents()
    assert capsys.readouterr().out.rstrip().endswith("scripted agents: nothing was built or tested by an AI")
    orch.PROVIDER = "codex"
    orch.say_scripted_agents()
    assert capsys.readouterr().out == ""
    assert orch.run_summary(None)["scripted_agents"] is False


# -- times, durations, exit code, session and the run's files ----------------------------------------

def test_start_and_end_are_shown_in_local_time_with_the_zone(browser, cet, passed):
    m, folder = passed
    summary = summary_of(folder)
    shown = dump_dom(browser, (folder / "report.html").as_uri()).figures()
    for name, key in (("started", "started_at"), ("ended", "ended_at")):
        local = datetime.fromisoformat(summary[key].replace("Z", "+00:00")).astimezone()
        assert local.tzname() in ("CET", "CEST")
        assert shown[name].text == local.strftime("%Y-%m-%d %H:%M:%S %Z")

    winter = dict(summary, started_at="2026-11-25T08:13:29.123Z", ended_at="2026-11-25T08:16:24.500Z",
                  wall_seconds=175.377)
    summer = dict(summary, started_at="2026-07-01T10:00:00.000Z", ended_at="2026-07-01T11:02:03.000Z",
                  wall_seconds=3723.0)
    shown = dump_dom(browser, render(m, folder, winter).as_uri()).figures()
    assert (shown["started"].text, shown["ended"].text) == ("2026-11-25 09:13:29 CET", "2026-11-25 09:16:24 CET")
    assert "last updated" not in shown
    shown = dump_dom(browser, render(m, folder, summer).as_uri()).figures()
    assert (shown["started"].text, shown["ended"].text) == ("2026-07-01 12:00:00 CEST", "2026-07-01 13:02:03 CEST")


def test_a_page_of_a_run_still_going_says_when_it_was_last_updated_and_has_no_end_or_exit_code(cet, mid_run):
    _, snapshot = mid_run
    shown = Dom(snapshot).figures()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d CES?T", shown["last updated"].text)
    assert "ended" not in shown and "exit code" not in shown
    assert Dom(snapshot).one("p", class_="result").attrs["data-result"] == "RUNNING"


DURATION = re.compile(r"^(?:\d\.\ds|[1-5]?\ds|\d+m [1-5]?\ds|\d+h [1-5]?\dm)$")   # 4.3s, 45s, 2m 55s, 1h 2m


def test_every_duration_on_the_page_is_written_one_way(browser, passed):
    m, folder = passed
    summary = summary_of(folder)
    summary.update(wall_seconds=175.4, agent_seconds=175.0)
    summary["turn_list"][0]["seconds"] = 12.3
    summary["turn_list"][1]["seconds"] = 4.26
    summary["turn_list"][2]["seconds"] = 3725.0
    dom = dump_dom(browser, render(m, folder, summary).as_uri())
    shown = dom.figures()
    assert shown["wall time"].text == "2m 55s, from the agents' start (their start-up not counted)"
    assert shown["agent time"].text == "2m 55s"
    labels = [details.one("summary").text for details in dom.find_all("details")]
    assert [label.split("; ")[1] for label in labels[:3]] == ["12s", "4.3s", "1h 2m"]
    took = [label.split("; ")[1] for label in labels]
    assert all(DURATION.match(text) for text in took), took
    span = dom.by_id("time-axis").text
    assert DURATION.match(span.removeprefix("0 (the run's start) to ").split(";")[0]), span
    assert not re.search(r"\d s\b", dom.one("body").text)         # no "175 s", "12.3 s" beside "2m 55s"


def test_a_start_up_that_takes_a_good_part_of_the_timeline_is_labelled(passed):
    m, folder = passed
    summary = summary_of(folder)
    first = datetime.fromisoformat(summary["turn_list"][0]["sent_at"].replace("Z", "+00:00")).timestamp()
    # a start-up of no length (the real one here is as long as the machine is slow: a busy one makes it a good part)
    summary["started_at"] = m.utc_iso(first, precise=True)
    assert "the first prompt went out" not in Dom(m.report_html(summary)).by_id("time-axis").text
    summary["started_at"] = m.utc_iso(first - 300)          # five minutes of start-up before the first prompt
    axis = Dom(m.report_html(summary)).by_id("time-axis").text
    assert "; the first prompt went out 5m 0s in: before it, the agents were started" in axis, axis


def test_the_exit_code_session_state_file_and_links_to_the_runs_files_are_shown(browser, passed):
    m, folder = passed
    summary = summary_of(folder)
    markup = (folder / "report.html").read_text(encoding="utf-8")
    probe = with_probe(markup, 'document.querySelectorAll("#figures a").forEach('
                               'a => a.setAttribute("data-resolved", a.href));')
    (folder / "probe.html").write_text(probe, encoding="utf-8")
    shown = dump_dom(browser, (folder / "probe.html").as_uri()).figures()
    assert shown["exit code"].text.startswith("0 (the tester reported RESULT: PASS")
    assert shown["session"].text == summary["session_name"] == state_of(m)["session_name"] != ""
    assert shown["state file"].text == m.STATE_FILE
    links = shown["run files"].find_all("a")
    assert [a.attrs["href"] for a in links] == ["run.log", "summary.json"]        # relative: beside the page
    for a in links:
        assert a.attrs["data-resolved"] == (folder / a.attrs["href"]).as_uri()
        assert (folder / a.attrs["href"]).is_file()


def test_a_stopped_run_shows_its_exit_code_and_a_run_still_going_links_only_what_is_there(mid_run, interrupted_run):
    folder, snapshot = mid_run
    assert [a.attrs["href"] for a in Dom(snapshot).figures()["run files"].find_all("a")] == ["run.log"]
    shown = Dom((interrupted_run / "report.html").read_text(encoding="utf-8")).figures()
    assert shown["exit code"].text.startswith("130 (interrupted by SIGINT")
    assert [a.attrs["href"] for a in shown["run files"].find_all("a")] == ["run.log", "summary.json"]


# -- the scenario test and the final evidence ---------------------------------------------------------

def test_the_scenario_test_and_the_last_evidence_are_visible_without_a_click(browser, passed_run):
    markup = (passed_run / "report.html").read_text(encoding="utf-8")
    seen = visibility(browser, passed_run, markup, "#scenario-test", "#final-evidence", "#turn-8 pre.reply")
    assert seen["#scenario-test"] == (True, SCENARIO.replace("`", ""))      # its code spans shown as code
    assert seen["#final-evidence"] == (True, PASS_REPLY.strip())
    assert seen["#turn-8 pre.reply"][0] is False            # the probe tells a closed turn from an open block
    dom = Dom(markup)
    for element_id in ("scenario-test", "final-evidence"):
        assert "details" not in dom.by_id(element_id).ancestors()


def test_a_page_before_the_first_test_result_says_the_tester_has_not_answered(browser, mid_run):
    folder, snapshot = mid_run
    seen = visibility(browser, folder, snapshot, "#scenario-test", "#final-evidence")
    assert seen["#scenario-test"] == (True, SCENARIO.replace("`", ""))
    assert seen["#final-evidence"] == (True, "The tester has not answered yet.")


@pytest.mark.parametrize("reply, shown", [
    ("I ran it.\nRESULT: FAIL\nNotes\nEVIDENCE:\n- wrong", "RESULT: FAIL\nEVIDENCE:\n- wrong"),
    ("RESULT: FAIL\nEVIDENCE:\n" + "\n".join(f"- line {n}" for n in range(200)),
     "RESULT: FAIL\nEVIDENCE:\n" + "\n".join(f"- line {n}" for n in range(200))),
    ("Looked at it.\n**EVIDENCE:**\n- fine\nRESULT: PASS", "**EVIDENCE:**\n- fine\nRESULT: PASS"),
    ("RESULT: PASS\nall good", "RESULT: PASS\nall good"),
    ("  no markers at all\n", "no markers at all"),
])
def test_the_evidence_shown_is_the_replys_result_and_evidence(orch, reply, shown):
    """What the programmer is told of a failed test (extract_test_evidence), uncapped: the page shows it all."""
    assert orch.extract_test_evidence(reply, uncapped=True) == shown


# -- the legend ----------------------------------------------------------------------------------------

def test_the_legend_lists_only_the_verdicts_that_occur(browser, passed_run, interrupted_run):
    def legend(folder: Path) -> list[tuple[str, str]]:
        dom = dump_dom(browser, (folder / "report.html").as_uri())
        return [(span.attrs["data-verdict"], span.text) for span in dom.one("p", class_="legend").find_all("span")]
    assert legend(passed_run) == [("PASS", "PASS"), ("FAIL", "FAIL"), ("APPROVED", "APPROVED"), ("", "author turn")]
    assert legend(interrupted_run) == [("APPROVED", "APPROVED"), ("unanswered", "unanswered"), ("", "author turn")]


# -- reloading -----------------------------------------------------------------------------------------

class PageServer:
    """report.html over HTTP on 127.0.0.1: the given versions, one per request (the last one repeats)."""

    def __init__(self, versions: list[str]):
        self.versions, self.requests = versions, 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/report.html":
                    self.send_error(404)
                    return
                body = server.versions[min(server.requests, len(server.versions) - 1)].encode("utf-8")
                server.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/report.html"

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def load_in_virtual_time(browser: Browser, versions: list[str], seconds: int = 60) -> tuple[int, Dom]:
    """Open the page in Chromium and let `seconds` pass on the page's clock (in well under a real second):
    how many times it was loaded, and the page it ended on."""
    server = PageServer(versions)
    try:
        markup = browser.dom_after(server.url, seconds * 1000)
    finally:
        server.close()
    return server.requests, Dom(markup)


READER = """
document.getElementById("turn-2").open = true;      // a reader opens a turn while the run goes on
"""


def test_a_page_of_a_run_still_going_reloads_itself_until_the_run_has_ended(browser, orch, mid_run):
    folder, snapshot = mid_run
    assert Dom(snapshot).one("body").attrs["data-reload-seconds"] == str(orch.REPORT_RELOAD_SECONDS)
    final = (folder / "report.html").read_text(encoding="utf-8")
    # The page as the run went on: still going, still going, then ended.
    loads, dom = load_in_virtual_time(browser, [with_probe(snapshot, READER), snapshot, final])
    assert loads == 3
    assert dom.one("p", class_="result").attrs["data-result"] == "PASS"
    assert [d.attrs["id"] for d in dom.find_all("details") if "open" in d.attrs] == ["turn-2"]   # kept open


def test_a_finished_or_stopped_page_does_not_reload(browser, passed_run, interrupted_run):
    for folder in (passed_run, interrupted_run):
        page = (folder / "report.html").read_text(encoding="utf-8")
        loads, dom = load_in_virtual_time(browser, [page, page.replace("<body", "<body data-reloaded")])
        assert loads == 1, folder
        assert "data-reloaded" not in dom.one("body").attrs


# -- escaping ------------------------------------------------------------------------------------------

EVIL = '<script>document.documentElement.setAttribute("data-injected", "yes")</script>'


def test_every_value_on_the_page_is_escaped(browser, passed):
    m, folder = passed
    summary = summary_of(folder)
    summary.update(task_heading=f"Fix `{EVIL}` and {EVIL}", scenario_test=EVIL, session_name=EVIL, wd=EVIL,
                   state_file=EVIL, providers={"tester": EVIL}, result=f"RUNNING{EVIL}",
                   agent_events=[{"role": EVIL, "terminal": EVIL, "at": EVIL, "what": 'x" onclick="alert(1)',
                                  "detail": EVIL}],
                   verifications=[{"round": EVIL, "exit_code": EVIL, "result": "failed"}], verified=False)
    turns = summary["turn_list"]
    turns[0]["role"], turns[1]["phase"], turns[2]["outcome"], turns[3]["sent_at"] = EVIL, EVIL, EVIL, EVIL
    turns[4]["reply_file"] = "evil-reply.md"                                      # the tester's reply itself
    (folder / "evil-reply.md").write_text(EVIL, encoding="utf-8")
    page = render(m, folder, summary)
    assert page.read_text(encoding="utf-8").count("<script") == 1                # the page's own script only
    dom = dump_dom(browser, page.as_uri())
    assert "data-injected" not in dom.one("html").attrs
    assert [len(s.children) for s in dom.find_all("script")] == [1]
    assert dom.by_id("task").text == f"Fix {EVIL} and {EVIL}"
    assert dom.by_id("task").one("code").text == EVIL
    assert dom.by_id("scenario-test").text == EVIL
    event = dom.by_id("agent-events").one("li")
    assert event.attrs["data-what"] == 'x" onclick="alert(1)' and "onclick" not in event.attrs
    assert EVIL in event.text
    shown = dom.figures()
    assert shown["session"].text == shown["project"].text == shown["state file"].text == EVIL
    assert EVIL in shown["verified"].text and shown["providers"].text == EVIL
    labels = [d.one("summary").text for d in dom.find_all("details")]
    assert labels[0].startswith(f"001 {EVIL}:") and EVIL in labels[1] and EVIL in labels[2]
    assert EVIL in dom.by_id("turn-4").text
    assert dom.by_id("turn-5").one("pre", class_="reply").text == EVIL
    assert dom.one("p", class_="result").attrs["data-result"] == f"RUNNING{EVIL}"


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed")])
def test_a_page_that_cannot_be_written_never_stops_the_run(load_orch, fake_cao, prompt_file, monkeypatch, failure):
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)

    def cannot_write(summary):
        raise failure
    monkeypatch.setattr(m, "report_html", cannot_write)
    assert run_main(m) == 0
    folder = Path(m.run_dir)
    assert (folder / "summary.json").is_file()
    assert not (folder / "report.html").exists() and not list(folder.glob(".report.html.*"))


def test_the_report_reads_a_kept_file_again_only_when_it_has_changed(orch, tmp_path, monkeypatch):
    """The page is written after every prompt and reply: a kept prompt or reply is read from disk once,
    and again only when it changed (a resend appended to a prompt file)."""
    orch.update_run(run_dir=str(tmp_path))
    kept = tmp_path / "001-analyst.prompt.md"
    kept.write_text("the prompt", encoding="utf-8")
    reads = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self.name) or read_text(self, *a, **k))
    assert [orch._kept_text(kept.name) for _ in range(3)] == ["the prompt"] * 3
    assert reads == [kept.name]
    kept.write_text("the prompt\n\n--- sent again ---\nthe prompt", encoding="utf-8")
    assert orch._kept_text(kept.name).endswith("--- sent again ---\nthe prompt")
    assert reads == [kept.name, kept.name]


def cut_bars(markup: str) -> dict[str, str]:
    """turn number -> the words of its cut marks, for the bars the page marks as cut by an interruption."""
    bars = re.findall(r'<a class="turn" [^>]*data-turn="(\d+)"[^>]*data-cut="1"[^>]*>(.*?)</a>', markup)
    return {number: " | ".join(re.findall(r'<span class="cut" [^>]*title="([^"]*)"', inner)) for number, inner in bars}


def turn_label(markup: str, number: int) -> str:
    """The heading of a turn in the list of turns, as a reader sees it."""
    return html.unescape(re.search(rf'<details id="turn-{number}" [^>]*><summary>(.*?)</summary>', markup).group(1))


def test_a_turn_an_interruption_cut_is_marked_where_it_stopped_and_where_the_run_went_on(
        load_orch, fake_cao, prompt_file):
    """Ctrl-C while the programmer works, then the same command: the programmer's turn is one turn from its
    first send to its reply, and the page marks it -- on its bar (hatched from the stop to the resume) and in
    its heading -- as cut by that stop (its exit code) and where the run went on; no other turn is marked.
    A killed invocation, which says nothing, is marked by the resume alone."""
    fake_cao.script["programmer"] = [interrupt(KeyboardInterrupt()), PROGRAMMER_REPLY]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 130
    page = Path(m.run_dir) / "report.html"
    stopped = page.read_text(encoding="utf-8")
    assert list(cut_bars(stopped)) == ["3"]                       # the programmer's turn, still unanswered
    assert "(exit 130: interrupted by SIGINT (Ctrl-C)); not taken up yet" in cut_bars(stopped)["3"]
    m = load_orch(PROMPT_FILE=str(prompt_file), **QUICK)
    assert run_main(m) == 0
    events = [e for e in m.read_events(Path(m.run_dir) / m.EVENTS_FILE) if e["event"].startswith("run_")]
    stop, resume = (next(e for e in events if e["event"] == kind) for kind in ("run_stopped", "run_resumed"))
    markup = page.read_text(encoding="utf-8")
    cuts = cut_bars(markup)
    assert list(cuts) == ["3"]
    said = (f"cut by a stop at {m.local_time(stop['at'])} (exit 130: interrupted by SIGINT (Ctrl-C)); went on at "
            f"{m.local_time(resume['at'])}")
    assert cuts["3"] == said
    assert turn_label(markup, 3).startswith("003 programmer: round 1, programmer phase") and said in turn_label(markup, 3)
    assert all("cut" not in turn_label(markup, number) for number in (1, 2, 4, 5))
    summary = m.run_summary(0)
    assert summary["interruptions"] == [{"stopped_at": stop["at"], "exit_code": 130, "resumed_at": resume["at"]}]
    # The same run, had its first invocation been killed: no run_stopped, the resume alone marks the cut.
    path = Path(m.run_dir) / m.EVENTS_FILE
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if '"seq": %d,' % stop["seq"]
                            not in line), encoding="utf-8")
    killed = m.report_html(m.run_summary(0))
    assert cut_bars(killed) == {"3": f"cut: its invocation was killed (no word from it); went on at "
                                     f"{m.local_time(resume['at'])}"}
