"""Menus an agent CLI opens by itself: the loop never lets a typed message pick a choice. A known menu gets
the choice that keeps what the user chose, picked with the arrow keys; a menu it does not know stops the turn
with one line naming it, and nothing is typed."""

from __future__ import annotations

import pytest

# Codex 0.169 at a usage limit whose answer carried the rate-limit headers (as its screen shows it).
CODEX_SWITCH_MENU = """\
■ You've hit your usage limit. Try again at 3:05 PM.

  Approaching rate limits
  Switch to gpt-6-luna for lower credit usage?

› 1. Switch to gpt-6-luna              Uses fewer credits for upcoming turns
  2. Keep current model
  3. Keep current model (never show again)  Hide future rate limit reminders about switching models

  Press enter to confirm or esc to go back
"""
CLAUDE_LIMIT_MENU = """\
⎿  You've hit your session limit · resets 3pm (Europe/Berlin)

 What do you want to do?
 ❯ 1. Stop and wait for limit to reset
   2. Request more
"""
ANSWER_WITH_A_LIST = """\
• Wrote the analysis:
  1. Parse the name
  2. Print the greeting
› Ask Codex to do anything
"""
# Codex 0.169's dialog in a project it does not trust yet, as CAO's screen showed it on a redraw.
CODEX_TRUST_MENU = """\
   Folder access  /work/project

  Trust this folder? Codex can read, edit, and run files here, subject to your permission settings.
  Your trust decision will be saved.
› 1. Trust and continue
  2. Back to Agent Command Center
  enter continue · esc back
"""
UNKNOWN_MENU = """\
  Enable full access?
› 1. Yes, continue anyway
  2. Go back without enabling full access
"""


def test_codexs_model_switch_menu_is_read_with_its_question_and_highlight(orch):
    menu = orch.open_menu(CODEX_SWITCH_MENU)
    assert menu.highlighted == 1 and menu.question == "Switch to gpt-6-luna for lower credit usage?"
    assert [number for number, _ in menu.choices] == [1, 2, 3]
    assert orch.safe_menu_choice(menu) == ("Codex's offer to switch the model", 2)   # not 3: that writes config
    assert orch.menu_keys(menu, 2) == ["Down", "Enter"]


def test_claudes_usage_limit_menu_gets_stop_and_wait(orch):
    claude, codex = orch.agent_cli("claude_code"), orch.agent_cli("codex")
    menu = orch.open_menu(CLAUDE_LIMIT_MENU, claude)
    assert menu == orch.open_menu(CLAUDE_LIMIT_MENU) and menu.question == "What do you want to do?"
    assert orch.safe_menu_choice(menu) == orch.safe_menu_choice(menu, claude) == ("Claude Code's usage-limit menu", 1)
    assert orch.menu_keys(menu, 1) == ["Enter"]
    assert orch.safe_menu_choice(orch.open_menu("❯ 1. Yes\n  2. No\n", claude), claude) is None
    assert orch.open_menu(CLAUDE_LIMIT_MENU, codex) is None      # not Codex's glyph: not a menu Codex opened


def test_codexs_trust_dialog_trusts_the_working_directory_the_run_was_given(orch):
    """A prompt's Enter would pick the same; picked first, the prompt is not swallowed by the dialog."""
    menu = orch.open_menu(CODEX_TRUST_MENU)
    codex = orch.agent_cli("codex")
    assert orch.safe_menu_choice(menu, codex) == ("Codex's question whether to trust the project", 1)
    assert orch.safe_menu_choice(menu, orch.agent_cli("claude_code")) is None     # Codex's dialog, not another's
    assert orch.menu_keys(menu, 1) == ["Enter"]


def test_a_numbered_list_in_an_answer_is_no_menu(orch):
    assert orch.open_menu(ANSWER_WITH_A_LIST) is None
    assert orch.open_menu("") is None and orch.open_menu(None) is None


def test_an_escape_coloured_menu_is_read_too(orch):
    coloured = CODEX_SWITCH_MENU.replace("› 1.", "\x1b[36m›\x1b[0m \x1b[1m1.\x1b[0m")
    assert orch.open_menu(coloured) == orch.open_menu(CODEX_SWITCH_MENU)


class MenuTerminal:
    """A terminal whose screen shows a menu until the loop picks a choice with Enter."""

    def __init__(self, screen: str):
        self.screen, self.keys, self.typed = screen, [], []

    def get_screen(self, terminal_id: str) -> str:
        return self.screen

    def session_terminals(self, session: str) -> list[str]:
        return ["t1"]

    def send_key(self, terminal_id: str, key: str) -> None:
        self.keys.append(key)
        if key == "Enter":
            self.screen = "› Ask Codex to do anything\n"

    def send_input(self, terminal_id: str, message: str) -> None:
        self.typed.append(message)

    def get_output(self, terminal_id: str, mode: str = "full") -> str:
        return self.screen


@pytest.fixture
def menu_terminal(orch, monkeypatch):
    def make(screen: str) -> MenuTerminal:
        terminal = MenuTerminal(screen)
        monkeypatch.setattr(orch, "api", terminal)
        monkeypatch.setattr(orch, "_screen", terminal.get_screen)
        monkeypatch.setattr(orch, "session_name", "cao-menu")
        return terminal
    return make


def test_a_message_to_a_terminal_with_codexs_menu_keeps_the_model_first(orch, menu_terminal, capsys):
    terminal = menu_terminal(CODEX_SWITCH_MENU)
    orch.deliver("tester", "t1", "Your usage limit has reset. Continue the task above.")
    assert terminal.keys == ["Down", "Enter"]                         # 2. Keep current model, then the message
    assert terminal.typed == ["Your usage limit has reset. Continue the task above."]
    out = capsys.readouterr().out
    assert "Codex's offer to switch the model on terminal t1" in out and 'choosing 2. "Keep current model"' in out


def test_a_menu_the_loop_does_not_know_stops_the_turn_and_nothing_is_typed(orch, menu_terminal, capsys):
    terminal = menu_terminal(UNKNOWN_MENU)
    with pytest.raises(orch.RunError) as stopped:
        orch.deliver("tester", "t1", "Reminder: your answer has not arrived.")
    assert terminal.keys == [] and terminal.typed == []
    message = stopped.value.message
    assert "shows a menu the loop does not answer (Enable full access? 1. Yes, continue anyway 2. Go back" in message
    assert "\n" not in message
    assert "a menu the loop does not answer: Enable full access?" in capsys.readouterr().out


def test_a_menu_that_stays_open_after_the_choice_stops_the_turn(orch, menu_terminal, monkeypatch):
    terminal = menu_terminal(CODEX_SWITCH_MENU)
    monkeypatch.setattr(terminal, "send_key", lambda terminal_id, key: terminal.keys.append(key))   # ignores keys
    monkeypatch.setattr(orch, "MENU_CLOSE_SECONDS", 0.3)
    with pytest.raises(orch.RunError, match="still shows Codex's offer to switch the model"):
        orch.deliver("tester", "t1", "Continue.")
    assert terminal.typed == []
