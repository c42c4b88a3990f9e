"""When is an agent's turn over? The completion rules of wait_for_reply(), one at a time.

CAO's status is a hint: it lags, sticks at `processing` when it misreads a
CLI's screen (Codex 0.169 under CAO 2.5.4), and reads `unknown` after a
server restart. The response file leads; a ready status or a screen that has
stopped changing confirms it. Each test plays one terminal on a fake clock:
its status, its screen and the agent's file writes follow a timeline, and the
real wait loop runs against it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

POLL = 2.0
GRACE = 30.0
QUIET = 5.0
SETTLE = 0.2
FINAL = "RESULT: PASS\nEVIDENCE:\n- final\n"
DRAFT = "RESULT: FAIL\nEVIDENCE:\n- draft, still working\n"


class SimTerminal:
    """One CAO terminal and its agent on a fake clock.

    `status` and `screen` hold what the server reports; while the clock is
    before `busy_screen_until` the screen changes every second (a working
    CLI repaints its spinner). Timeline events run when the clock passes them.
    Its CLI is one whose ready status CAO reads right, unless a test says
    which (`runs`).
    """

    def __init__(self, orch, monkeypatch, path: Path):
        self.orch, self.path = orch, path
        self.now = 0.0
        self.status = "processing"
        self.still_screen = "› idle composer"
        self.busy_screen_until = 0.0
        self.busy_mark = ""               # what a CLI that marks its turn's state prints as it starts working
        self.reply = "previous reply"
        self.events: list[tuple[float, object]] = []
        self.sent: list[str] = []
        self.status_reads: list[float] = []
        self.screen_reads: list[float] = []
        self.file_written_at: float | None = None
        monkeypatch.setattr(orch.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(orch.time, "time", lambda: 1_700_000_000.0 + self.now)
        monkeypatch.setattr(orch.time, "sleep", self.sleep)
        monkeypatch.setattr(orch, "api", self)
        monkeypatch.setattr(orch, "save_state", lambda: None)
        monkeypatch.setattr(orch, "session_name", "cao-sim")
        self.monkeypatch = monkeypatch
        self.runs("claude_code")
        self.echo = ""                    # the prompt as the agent's transcript shows it ("" if it never arrived)
        self.shows_prompt = True
        for name, value in (("POLL_SECONDS", POLL), ("IDLE_GRACE_SECONDS", GRACE), ("QUIET_SCREEN_SECONDS", QUIET),
                            ("FILE_SETTLE_SECONDS", SETTLE), ("RESPONSE_TIMEOUT", 1800.0),
                            ("MAX_FILE_REMINDERS", 1)):
            monkeypatch.setattr(orch, name, value)

    def runs(self, provider: str) -> None:
        """The agent CLI the terminal runs, as CAO's provider names it."""
        self.monkeypatch.setattr(self.orch, "PROVIDER", provider)

    # -- the timeline --------------------------------------------------------
    def at(self, t: float, **changes) -> None:
        self.events.append((t, lambda: self.__dict__.update(changes)))

    def write_at(self, t: float, text: str) -> None:
        def write():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(text)
            self.file_written_at = self.now
        self.events.append((t, write))

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += max(seconds, 1e-6)
        for event in sorted((e for e in self.events if e[0] <= self.now), key=lambda e: e[0]):
            self.events.remove(event)
            event[1]()

    # -- the CAO API the loop calls --------------------------------------------
    def get_status(self, terminal_id: str) -> str:
        self.status_reads.append(self.now)
        return self.status

    def get_screen(self, terminal_id: str) -> str:
        self.screen_reads.append(self.now)
        if self.now < self.busy_screen_until:
            return f"{self.echo}{self.busy_mark}• Working ({int(self.now)}s • esc to interrupt)"
        return self.echo + self.still_screen

    def session_terminals(self, session: str) -> list[str]:
        return ["t1"]

    def get_last_output(self, terminal_id: str, retry: bool = True) -> str:
        return self.reply

    def send_input(self, terminal_id: str, message: str) -> None:
        self.sent.append(message)
        if self.shows_prompt:
            self.echo = f"> {message.splitlines()[0]}\n"
        if message.startswith("Reminder:"):
            self.reminder_at = self.now

    # -- running a turn --------------------------------------------------------
    def wait(self, message: str = "the prompt") -> tuple[str, float]:
        """Run the real wait loop; return the reply and the clock when it was taken."""
        self.echo = f"> {message.splitlines()[0]}\n" if self.shows_prompt else ""
        reply, self.ended_by = self.orch.wait_for_reply("tester", "t1", self.path, message)
        return reply, self.now


@pytest.fixture
def sim(orch, monkeypatch, tmp_path):
    return SimTerminal(orch, monkeypatch, tmp_path / "agent-responses" / "test_result.md")


def test_ready_status_ends_the_turn_once_the_file_has_settled(sim):
    """File written and status `completed`: taken after the settle time, without waiting for a poll."""
    sim.write_at(7.05, FINAL)
    sim.at(7.05, status="completed")
    reply, taken_at = sim.wait()
    assert reply == FINAL.strip()
    assert SETTLE <= taken_at - sim.file_written_at <= SETTLE + 0.15
    # one read of status and screen was enough (the screen read with it could have said the CLI still works)
    assert len([t for t in sim.screen_reads if t >= sim.file_written_at]) == 1
    assert len([t for t in sim.status_reads if t >= sim.file_written_at]) == 1
    assert sim.sent == []
    assert sim.ended_by == "CAO's ready status"          # what the reply's log line names


def test_stuck_processing_with_a_still_screen_ends_after_the_quiet_bound(sim):
    """Codex under CAO 2.5.4: file written, screen idle, status `processing` for good."""
    sim.runs("codex")
    sim.busy_screen_until = 8.0
    sim.write_at(7.5, FINAL)
    reply, taken_at = sim.wait()
    assert reply == FINAL.strip()
    assert taken_at - 8.0 >= QUIET                      # never before the screen was still long enough
    assert taken_at - 8.0 <= QUIET + 2 * POLL + SETTLE  # and within the bounds after it stopped
    assert sim.sent == []
    assert sim.ended_by == "a still screen"


WORKING_MARK, DONE_MARK = "\x1b]7501;state=working:app=codex\x07", "\x1b]7501;state=done:app=codex\x07"


def test_a_cli_that_marks_its_turn_ended_is_taken_within_a_confirm_read_of_the_mark(sim, orch):
    """Codex under CAO 2.5.4: status `processing` for good, but Codex marks its turn's end on its screen.
    The reply is taken once that mark shows, not QUIET_SCREEN_SECONDS after the screen went still."""
    sim.runs("codex")
    sim.busy_screen_until = 10**9                     # the working screen, then the mark: no still screen at all
    sim.busy_mark = WORKING_MARK
    sim.write_at(7.5, FINAL)
    sim.at(8.0, busy_screen_until=0.0, still_screen=f"{WORKING_MARK}{DONE_MARK} Worked for 8s › Ask Codex")
    reply, taken_at = sim.wait()
    assert reply == FINAL.strip()
    assert 8.0 <= taken_at <= 8.0 + orch.CONFIRM_READ_SECONDS + 0.1
    assert sim.sent == []
    assert sim.ended_by == "the CLI's end-of-turn mark"


def test_a_draft_under_a_stale_completed_status_waits_for_the_final_answer(sim):
    """CAO answers `completed` left over from before while Codex, marked working, writes a draft and then
    its answer: only the answer is read."""
    sim.runs("codex")
    sim.status = "completed"
    sim.busy_screen_until = 10**9
    sim.busy_mark = WORKING_MARK
    sim.write_at(3.0, DRAFT)
    sim.write_at(6.0, FINAL)
    sim.at(6.5, busy_screen_until=0.0, still_screen=f"{WORKING_MARK}{DONE_MARK} Worked for 6s")
    reply, taken_at = sim.wait()
    assert reply == FINAL.strip() and taken_at >= 6.5


def test_a_changing_screen_is_never_cut_short(sim):
    """The file is there early, but the agent keeps working (screen changing) for a minute."""
    sim.busy_screen_until = 60.0
    sim.write_at(3.0, FINAL)
    reply, taken_at = sim.wait()
    assert taken_at >= 60.0 + QUIET
    assert reply == FINAL.strip()
    assert sim.sent == []                               # no reminder to a working agent


def test_unknown_status_is_judged_by_file_and_screen_and_logged_once(sim, capsys):
    """After a cao-server restart every status reads `unknown`: the file and the screen decide."""
    sim.status = "unknown"
    sim.busy_screen_until = 4.5
    sim.write_at(4.0, FINAL)
    reply, taken_at = sim.wait()
    assert reply == FINAL.strip()
    assert QUIET <= taken_at - 4.5 <= QUIET + 2 * POLL + SETTLE
    assert capsys.readouterr().out.count("CAO cannot tell the status of terminal t1") == 1


def test_a_file_rewritten_while_the_agent_works_is_read_once_final(sim):
    """A draft first, the final text later: the draft is never taken, however long it sat."""
    sim.busy_screen_until = 12.0
    sim.write_at(2.0, DRAFT)
    sim.write_at(11.0, FINAL)
    sim.at(12.0, status="completed")
    reply, taken_at = sim.wait()
    assert reply == FINAL.strip()
    assert taken_at >= 12.0


def test_a_draft_with_a_ready_status_read_before_it_is_not_taken(sim):
    """A ready status read before the file appeared does not confirm that file."""
    sim.status = "completed"                            # left over from the previous turn
    sim.at(0.5, status="processing")
    sim.busy_screen_until = 20.0
    sim.write_at(1.0, DRAFT)
    sim.write_at(15.0, FINAL)
    sim.at(20.0, status="completed")
    reply, _ = sim.wait()
    assert reply == FINAL.strip()


def test_prompt_never_seen_arriving_is_sent_again_whole_before_any_reminder(sim, capsys):
    """A dialog took the prompt: its screen never shows it. After the grace the same prompt goes out again."""
    sim.shows_prompt = False
    sim.status = "idle"
    sim.at(GRACE - 1, shows_prompt=True)                # the dialog is gone: the next input arrives
    sim.at(GRACE + 5, status="processing")
    sim.write_at(GRACE + 10, FINAL)
    sim.at(GRACE + 10, status="completed")
    reply, _ = sim.wait(message="the whole prompt")
    assert reply == FINAL.strip()
    assert sim.sent == ["the whole prompt"]
    assert "does not show the prompt" in capsys.readouterr().out


def test_a_prompt_that_never_shows_after_its_resend_counts_the_agent_lost_not_reminded(sim, orch):
    """A reminder is never the first thing an agent sees of its task."""
    sim.runs("codex")
    sim.shows_prompt = False
    sim.status = "processing"                           # as CAO reads Codex's idle composer
    with pytest.raises(orch.AgentLost, match="never showed the prompt"):
        sim.wait(message="the whole prompt")
    assert sim.sent == ["the whole prompt"]


def test_an_agent_that_worked_gets_a_reminder_not_the_prompt_again(sim):
    """Busy, then idle without its file: a reminder naming the file, after the idle grace."""
    sim.at(5.0, status="idle")
    sim.write_at(50.0, FINAL)
    sim.at(50.0, status="completed")
    reply, _ = sim.wait()
    assert reply == FINAL.strip()
    assert len(sim.sent) == 1 and sim.sent[0].startswith("Reminder:") and str(sim.path) in sim.sent[0]


def test_a_reply_that_arrives_just_before_the_reminder_gets_none(sim):
    """Idle since the read at 6 s, the file appears at 35.5 s, half a second before the reminder was due."""
    sim.at(5.0, status="idle")
    sim.write_at(6.0 + GRACE - 0.5, FINAL)
    reply, _ = sim.wait()
    assert reply == FINAL.strip() and sim.sent == []


def test_status_reads_stay_at_poll_rate_while_the_file_waits_for_a_ready_status(sim, orch, monkeypatch):
    """File written, status never ready, screen always changing: one status read per POLL_SECONDS, plus
    the quicker ones of the QUIET_SCREEN_SECONDS after the file settled."""
    monkeypatch.setattr(orch, "RESPONSE_TIMEOUT", 120.0)
    sim.busy_screen_until = 10**9
    sim.write_at(1.0, FINAL)
    with pytest.raises(orch.RunError, match="RESPONSE_TIMEOUT"):
        sim.wait()
    quick = orch.QUIET_SCREEN_SECONDS / orch.CONFIRM_READ_SECONDS + 1     # asked whether it has finished
    allowed = sim.now / POLL + 1 + quick
    assert len(sim.status_reads) <= allowed
    assert len(sim.screen_reads) <= allowed
    gaps = [b - a for a, b in zip(sim.status_reads, sim.status_reads[1:])]
    assert sum(1 for gap in gaps if gap < POLL - 1e-9) <= quick
    late = [t for t in sim.status_reads if t > 1.0 + orch.FILE_SETTLE_SECONDS + orch.QUIET_SCREEN_SECONDS + POLL]
    assert all(b - a >= POLL - 1e-9 for a, b in zip(late, late[1:]))      # then back at the usual pace


def test_error_status_stops_the_turn(sim, orch):
    sim.at(3.0, status="error")
    with pytest.raises(orch.RunError, match="reports status 'error'"):
        sim.wait()


def test_an_agent_idle_all_along_is_reminded_once_its_idle_grace_is_used_up(sim):
    """Idle all along (its busy moment fell between two polls), the prompt on its screen: it is reminded
    once its idle grace is used up, counted from the first idle reading, and its file is then taken."""
    sim.status = "idle"
    sim.write_at(45.0, FINAL)
    sim.at(45.0, status="completed")
    reply, _ = sim.wait()
    assert reply == FINAL.strip()
    assert len(sim.sent) == 1 and sim.sent[0].startswith("Reminder:")
    assert sim.reminder_at <= POLL + GRACE + 0.2          # idle counted from the first idle reading


def test_the_first_look_after_a_send_comes_within_half_a_second(sim):
    """A CLI that compacts as the prompt is submitted says so at once, and a long turn's output can push those
    words out of the screen CAO keeps: the screen is read FIRST_LOOK_SECONDS after the send, not a poll later."""
    sim.write_at(7.05, FINAL)
    sim.at(7.05, status="completed")
    sim.wait()
    assert sim.screen_reads and sim.screen_reads[0] <= sim.orch.FIRST_LOOK_SECONDS + 0.06
    assert sim.status_reads[0] <= sim.orch.FIRST_LOOK_SECONDS + 0.06


def test_a_compaction_shown_only_in_the_first_second_of_a_turn_is_seen(sim, monkeypatch):
    """Compacting as the prompt is submitted, for a second; gone from the screen before the first poll."""
    sim.orch.record_sent(["explore:t1"])
    sim.still_screen = "✽ Compacting conversation… (esc to interrupt)"
    sim.at(1.0, still_screen="› idle composer")
    sim.write_at(7.05, FINAL)
    sim.at(7.05, status="completed")
    sim.wait()
    assert [(e.role, e.what) for e in sim.orch.agent_events] == [("tester", "compacted")]
    assert "explore:t1" not in sim.orch.context_sent
