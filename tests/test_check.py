"""--check: all a run needs, looked at in seconds, without an agent started or a token spent.

The agents' side (a probe in the agents' tmux server, a real cao-server) is proven end to end in
tests/e2e/test_check_e2e.py; here: the probe's script run by a real `sh`, each trap alone, and the
command's lines and exit codes against the fake CAO.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main


def run_check(module, capsys, *args: str) -> tuple[int, list[str]]:
    code = run_main(module, "--check", *args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out.splitlines()


def _side(orch, tmp_path: Path, uid: int = 1000, **env: str):
    home = tmp_path / "agents-home"
    home.mkdir(exist_ok=True)
    return orch.AgentsSide({"HOME": str(home), **env}, uid, {})


# -- the probe ----------------------------------------------------------------------


def test_the_probe_script_run_by_sh_names_each_program_its_path_and_version(orch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "fakecli"
    tool.write_text("#!/bin/sh\necho 'fakecli 3.4.5 (build 7)'\necho second line\n", encoding="utf-8")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    script = orch._probe_script(tmp_path, ["fakecli", "not-installed-anywhere"])
    subprocess.run(["sh", str(script)], env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                                             "IS_SANDBOX": "1"}, check=True, timeout=30)
    assert (tmp_path / "done").exists()
    side = orch._read_probe((tmp_path / "out").read_text(encoding="utf-8"))
    assert side.programs["fakecli"] == (str(tool), "fakecli 3.4.5 (build 7)")
    assert side.programs["not-installed-anywhere"] == ("", "")
    assert side.uid == os.getuid() and side.env["IS_SANDBOX"] == "1" and side.env["HOME"] == str(tmp_path)


LISTENER = """
import socket, sys, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_the_server_listening_on_api_s_port_is_found_with_its_environment_and_tmux_socket(load_orch):
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    server_process = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True,
                                      env={**env, "TMUX_TMPDIR": "/srv/agents-tmux"})
    try:
        port = int(server_process.stdout.readline())
        orch = load_orch(API=f"http://127.0.0.1:{port}")
        server = orch.local_server()
        hint = orch.tmux_hint("attach -t cao-loop-1")
    finally:
        server_process.kill()
        server_process.wait()
    assert server is not None and server.pid == server_process.pid and server.uid == os.getuid()
    assert server.env["TMUX_TMPDIR"] == "/srv/agents-tmux"
    assert server.tmux_socket == f"/srv/agents-tmux/tmux-{os.getuid()}/default"
    assert hint == f"tmux -S /srv/agents-tmux/tmux-{os.getuid()}/default attach -t cao-loop-1"


def test_a_server_on_another_machine_gets_a_plain_tmux_hint_and_no_probe(load_orch, monkeypatch):
    monkeypatch.delenv("TMUX_TMPDIR", raising=False)
    orch = load_orch(API="http://cao.example.org:9889")
    assert orch.local_server() is None and orch.tmux_hint("attach -t s") == "tmux attach -t s"
    side, lines = orch.agents_side(None)
    assert side is None and lines[0].ok is None and "runs on another machine" in lines[0].text


def test_without_tmux_the_agents_side_is_not_looked_into_and_the_line_says_how_to_install_it(orch, monkeypatch):
    which = orch.shutil.which
    monkeypatch.setattr(orch.shutil, "which", lambda name, **kw: None if name == "tmux" else which(name, **kw))
    monkeypatch.setattr(orch, "local_server", lambda: object())
    monkeypatch.setattr(orch, "probe_agents_side", lambda *args: pytest.fail("probed without tmux"))
    side, lines = orch.agents_side(None)
    assert side is None and [(line.ok, line.text) for line in lines] == [
        (False, "tmux is not installed: CAO runs the agents in tmux (Debian/Ubuntu: apt-get install tmux)")]


# -- each trap alone: found with its fix, passed once fixed ----------------------------


def trap_of(orch, provider: str, index: int = 0):
    """The check of a trap the provider's row declares, as --check runs it on what the probe saw."""
    cli = orch.AGENT_CLIS[provider]
    return lambda side: orch.check_trap(cli, cli.traps[index], side)


def test_claude_code_as_root_needs_is_sandbox(orch, tmp_path):
    trap = trap_of(orch, "claude_code")
    found = trap(_side(orch, tmp_path, uid=0))
    assert found.ok is False and "IS_SANDBOX=1 cao-server" in found.text
    assert trap(_side(orch, tmp_path, uid=0, IS_SANDBOX="1")).ok is True
    assert trap(_side(orch, tmp_path, uid=1000)).ok is True


def test_claude_code_needs_its_first_run_set_up_done(orch, tmp_path):
    trap = trap_of(orch, "claude_code", 1)
    side = _side(orch, tmp_path)
    found = trap(side)
    assert found.ok is False and "start `claude` once by hand" in found.text and "hasCompletedOnboarding" in found.text
    (tmp_path / "agents-home" / ".claude.json").write_text('{"hasCompletedOnboarding": false}', encoding="utf-8")
    assert trap(side).ok is False
    (tmp_path / "agents-home" / ".claude.json").write_text('{"hasCompletedOnboarding": true}', encoding="utf-8")
    assert trap(side).ok is True and str(tmp_path / "agents-home" / ".claude.json") in trap(side).text


def test_codex_needs_the_project_trusted(orch, tmp_path, workdir):
    trap = trap_of(orch, "codex")
    side = _side(orch, tmp_path)
    found = trap(side)
    assert found.ok is False and f'[projects."{workdir.resolve()}"]' in found.text and "trust_level" in found.text
    config = Path(side.env["HOME"]) / ".codex" / "config.toml"
    config.parent.mkdir()
    config.write_text(f'model = "m"\n[projects."{workdir.resolve()}"]\ntrust_level = "trusted"\n', encoding="utf-8")
    assert trap(side).ok is True
    config.write_text(f'[projects."{workdir.resolve().parent}"]\ntrust_level = "trusted"\n', encoding="utf-8")
    assert trap(side).ok is True                     # a folder above it counts
    config.write_text(f'[projects."{workdir.resolve()}"]\ntrust_level = "untrusted"\n', encoding="utf-8")
    assert trap(side).ok is False


def test_codex_home_moves_its_config(orch, tmp_path, workdir):
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f'[projects."{workdir.resolve()}"]\ntrust_level = "trusted"\n',
                                            encoding="utf-8")
    assert trap_of(orch, "codex")(_side(orch, tmp_path, CODEX_HOME=str(codex_home))).ok is True


def test_codex_needs_its_offer_of_another_model_at_a_usage_limit_turned_off(orch, tmp_path):
    """Else CAO's second Enter takes Codex's offer and the agent goes on with a model nobody chose."""
    trap = trap_of(orch, "codex", 1)
    side = _side(orch, tmp_path)
    config = Path(side.env["HOME"]) / ".codex" / "config.toml"
    found = trap(side)
    assert found.ok is False and f"add to {config}: [notice] then hide_rate_limit_model_nudge = true" in found.text
    config.parent.mkdir()
    config.write_text('model = "m"\n[notice]\nhide_rate_limit_model_nudge = true\n[projects."/w"]\n', encoding="utf-8")
    assert trap(side).ok is True
    config.write_text('notice.hide_rate_limit_model_nudge = true\n', encoding="utf-8")
    assert trap(side).ok is True
    for wrong in ('[notice]\nhide_rate_limit_model_nudge = false\n',
                  '[notice]\n[tui]\nhide_rate_limit_model_nudge = true\n',      # in another table
                  '[notice]\n# hide_rate_limit_model_nudge = true\n'):
        config.write_text(wrong, encoding="utf-8")
        assert trap(side).ok is False, wrong
    codex_home = tmp_path / "codex-home"                # CODEX_HOME moves it
    codex_home.mkdir()
    (codex_home / "config.toml").write_text("[notice]\nhide_rate_limit_model_nudge = true\n", encoding="utf-8")
    assert trap(_side(orch, tmp_path, CODEX_HOME=str(codex_home))).ok is True


def test_copilot_needs_cao_s_mcp_server_disabled(orch, tmp_path):
    trap = trap_of(orch, "copilot_cli")
    side = _side(orch, tmp_path)
    found = trap(side)
    assert found.ok is False and '{"disabledMcpServers": ["cao-mcp-server"]}' in found.text
    settings = Path(side.env["HOME"]) / ".copilot" / "settings.json"
    settings.parent.mkdir()
    settings.write_text('{"disabledMcpServers": ["cao-mcp-server"]}', encoding="utf-8")
    assert trap(side).ok is True


def test_hermes_needs_prompt_toolkit_no_cpr(orch, tmp_path):
    trap = trap_of(orch, "hermes")
    found = trap(_side(orch, tmp_path))
    assert found.ok is False and "set-environment -g PROMPT_TOOLKIT_NO_CPR 1" in found.text
    assert trap(_side(orch, tmp_path, PROMPT_TOOLKIT_NO_CPR="1")).ok is True


def test_opencode_needs_its_model_in_cao_s_config_file(orch, tmp_path):
    trap = trap_of(orch, "opencode_cli")
    side = _side(orch, tmp_path)
    assert trap(side).ok is False
    config = Path(side.env["HOME"]) / ".aws" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.write_text('{"model": "local/scripted"}', encoding="utf-8")
    assert trap(side).ok is True


def test_every_trap_a_row_declares_says_what_to_look_at_and_what_to_tell(orch):
    traps = [trap for cli in orch.AGENT_CLIS.values() for trap in cli.traps]
    assert len(traps) == 7
    for trap in traps:
        assert trap.found and trap.fix and bool(trap.env) != bool(trap.file), trap
        assert not trap.file or bool(trap.pattern) != bool(trap.json_key), trap
        assert not trap.env_value or trap.env, trap


def test_a_cli_the_agents_shells_do_not_find_is_said_with_where_it_is_here(orch, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mock_cli"
    tool.write_text("#!/bin/sh\n", encoding="utf-8")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    orch.PROVIDER = "mock_cli"
    side = _side(orch, tmp_path)
    side.programs = {"mock_cli": ("", "")}
    [line] = orch.check_clis(side, None)
    assert line.ok is False and f"ln -sf {tool} /usr/local/bin/mock_cli" in line.text
    side.programs = {"mock_cli": ("/usr/local/bin/mock_cli", "")}
    assert orch.check_clis(side, None)[0].ok is True


def test_a_cli_s_version_is_set_against_the_one_proven(orch, tmp_path):
    orch.PROVIDER = "codex"
    side = _side(orch, tmp_path)
    side.programs = {"codex": ("/usr/bin/codex", f"codex-cli {orch.AGENT_CLIS['codex'].proven}")}
    [line] = orch.check_clis(side, None)
    assert line.ok is True and "proven with" not in line.text
    side.programs = {"codex": ("/usr/bin/codex", "codex-cli 9.9.9")}
    [line] = orch.check_clis(side, None)
    assert line.ok is True and f"9.9.9 (proven with {orch.AGENT_CLIS['codex'].proven}" in line.text


# -- the command --------------------------------------------------------------------


def test_check_passes_when_a_run_can_start_and_starts_nothing(load_orch, fake_cao, prompt_file, capsys):
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file), API="http://cao.test")
    code, lines = run_check(orch, capsys)
    assert code == 0, lines
    assert lines[-1] == "a run can start"
    assert any(line.startswith("✓ agent profiles installed: system_analyst") for line in lines)
    assert any(line.startswith("! agent CLIs not checked") for line in lines)   # cao.test is not this machine
    assert not fake_cao.terminals and not fake_cao.prompts
    assert not Path(orch.STATE_FILE).exists()


def test_check_names_the_profiles_to_install(load_orch, fake_cao, prompt_file, capsys):
    fake_cao.missing_profiles = {"tester", "programmer"}
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file))
    code, lines = run_check(orch, capsys)
    assert code == 1 and lines[-1] == "fix what is marked, then run --check again"
    [line] = [line for line in lines if line.startswith("✗")]
    cao, profiles = orch.loop_program("cao") or "cao", Path(orch.__file__).resolve().parent / "profiles"
    assert line.endswith(
        "install them where the CAO server at http://cao.test runs, as its user: "
        f"`{cao} install {profiles}/programmer.md --provider mock_cli && {cao} install {profiles}/tester.md "
        "--provider mock_cli`; or OWN_SERVER=1 runs it on a CAO server of its own instead, which installs them itself")


def test_check_names_the_store_a_local_server_reads_and_one_command_for_it(load_orch, fake_cao, prompt_file, capsys,
                                                                           monkeypatch):
    """A server running here as a process: the command sets its HOME (and CAO_HOME_DIR where it has one), so it
    installs into the store that server reads, from any folder and any user's shell."""
    fake_cao.missing_profiles = {"tester"}
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file))
    server = orch.LocalServer(4242, os.getuid(), {"HOME": "/srv/their home", "PATH": "/usr/bin"})
    monkeypatch.setattr(orch, "local_server", lambda: server)
    monkeypatch.setattr(orch, "agents_side", lambda report, versions=True: (None, []))
    code, lines = run_check(orch, capsys)
    [line] = [line for line in lines if line.startswith("✗")]
    tester = Path(orch.__file__).resolve().parent / "profiles" / "tester.md"
    assert code == 1 and line.endswith(
        "the CAO server at http://cao.test reads its store in /srv/their home/.aws/cli-agent-orchestrator, so install "
        f"them there: `HOME='/srv/their home' {orch.loop_program('cao') or 'cao'} install {tester} --provider mock_cli`; or "
        "OWN_SERVER=1 runs it on a CAO server of its own instead, which installs them itself")


def test_check_with_cao_down_says_how_to_start_it(load_orch, prompt_file, capsys):
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file), API="http://127.0.0.1:9")
    code, lines = run_check(orch, capsys)
    assert code == 1
    assert any(line.startswith("✗ CAO server is not reachable at http://127.0.0.1:9") and "cao-server" in line
               for line in lines)


def test_check_with_bad_settings_exits_2_with_the_setting_s_line(load_orch, capsys):
    orch = load_orch(MAX_ROUNDS="many")
    code, lines = run_check(orch, capsys)
    assert code == 2 and lines[0].startswith("✗ MAX_ROUNDS") and len(lines) == 2


def test_check_refuses_a_cost_budget_with_a_model_it_cannot_price(load_orch, capsys, tmp_path):
    """MAX_RUN_COST with a model asked for that MODEL_PRICES leaves out: exit 2 before the run, naming it."""
    orch = load_orch(PROVIDER="codex", AGENT_HOME=str(tmp_path), MAX_RUN_COST="5", MODEL="gpt-5.1-codex",
                     PEER_PROGRAMMER_MODEL="gpt-5.1-codex-mini",
                     MODEL_PRICES='{"gpt-5.1-codex": {"input": 1.25, "output": 10}}')
    code, lines = run_check(orch, capsys)
    assert code == 2 and lines[0].startswith("✗ MAX_RUN_COST needs MODEL_PRICES") and \
        "it has none for gpt-5.1-codex-mini" in lines[0]


def test_check_and_status_together_are_a_usage_error(orch, capsys):
    assert run_main(orch, "--check", "--status") == 2
    assert "--check and --status" in capsys.readouterr().err


def test_check_marks_fall_back_to_words_where_the_output_cannot_show_them(orch, monkeypatch):
    class Ascii:
        encoding = "ascii"
    monkeypatch.setattr(orch.sys, "stdout", Ascii())
    assert [orch.check_mark(ok) for ok in (True, False, None)] == ["ok", "FAIL", "!"]


def test_commits_asked_for_need_a_git_repository(load_orch, fake_cao, prompt_file, capsys):
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file), COMMIT_ON_PASS="1")
    code, lines = run_check(orch, capsys)
    assert code == 1 and any("COMMIT_ON_PASS=1" in line and "git init" in line for line in lines)


@pytest.mark.parametrize("reachable", [True, False])
def test_ntfy_is_looked_at_only_where_set(load_orch, fake_cao, prompt_file, capsys, reachable):
    import httpx
    fake_cao.router.get("https://ntfy.test/v1/health").mock(
        return_value=httpx.Response(200, json={"healthy": True}) if reachable
        else None, side_effect=None if reachable else httpx.ConnectError("refused"))
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file), NTFY_TOPIC="loop-runs",
                     NTFY_SERVER="https://ntfy.test")
    code, lines = run_check(orch, capsys)
    assert code == (0 if reachable else 1)
    assert any(line.startswith("✓ ntfy server" if reachable else "✗ ntfy server") for line in lines)


# -- what a run costs -------------------------------------------------------------------


def test_the_estimate_names_the_measured_tokens_and_prices_them_where_one_model_is_priced(load_orch):
    orch = load_orch(PROVIDER="claude_code", MODEL="claude-sonnet-4-5",
                     MODEL_PRICES='{"claude-sonnet-4-5": {"input": 3, "output": 15}}')
    nine, fourteen = orch.AGENT_CLIS["claude_code"].run_tokens
    [line] = orch.cost_estimate()
    assert f"at least {nine:,} input tokens when it passes in round 1 (9 turns), {fourteen:,} in round 2" in line
    assert f"at MODEL_PRICES for claude-sonnet-4-5: at least {nine * 3 / 1e6:.2f} and {fourteen * 3 / 1e6:.2f}" in line


def test_the_estimate_has_no_price_without_one_priced_model_and_a_line_per_cli(load_orch):
    orch = load_orch(PROVIDER="claude_code", TESTER_PROVIDER="mock_cli")
    lines = orch.cost_estimate()
    assert len(lines) == 2 and "MODEL_PRICES" not in " ".join(lines)
    assert "had every role run it" in lines[0] and lines[1] == "estimate: mock_cli spends no model tokens"


def test_every_proven_cli_has_measured_run_figures(orch):
    for provider, cli in orch.AGENT_CLIS.items():
        if cli.proven:
            nine, fourteen = cli.run_tokens
            assert 0 < nine < fourteen, provider


def test_check_interrupted_or_failing_inside_says_one_line_never_a_traceback(load_orch, fake_cao, prompt_file,
                                                                            capsys, monkeypatch):
    orch = load_orch(PROVIDER="mock_cli", PROMPT_FILE=str(prompt_file))

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(orch, "preflight_lines", interrupted)
    assert run_main(orch, "--check") == 130
    err = capsys.readouterr().err
    assert err == "interrupted (SIGINT): --check started nothing and changed nothing\n"

    def broken():
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(orch, "preflight_lines", broken)
    code, lines = run_check(orch, capsys)
    assert code == 1 and any(line.startswith("✗ unexpected OSError while checking") for line in lines)

    def faulty():
        return {}["a key the code forgot"]
    monkeypatch.setattr(orch, "preflight_lines", faulty)
    assert run_main(orch, "--check") == 70                  # a fault of the loop itself: a bug, not a fix to make
    out, err = capsys.readouterr()
    assert "✗ a fault of --check itself (KeyError" in out and "Traceback (most recent call last)" in err


FAKE_CAO = """
import http.server, json, sys
answers = {"/health": {"status": "ok"}, "/agents/providers": [{"name": "mock_cli", "binary": "mock_cli",
                                                               "installed": True}]}
class Cao(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(answers.get(self.path.split("?")[0], {"name": "x"})).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Cao)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.mark.parametrize("signum, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_stop_signal_while_check_looks_from_the_agents_shell_leaves_no_window_in_their_tmux(
        tmp_path, prompt_file, signum, code):
    """--check on a cao-server the user runs looks from a new session of that server's tmux server; a SIGTERM or
    SIGHUP to --check while it looks (a CLI's --version that takes its time) removes that session before --check
    exits with the signal's code and one line. A real --check process, a real tmux server of the test's own
    (cao-server's TMUX_TMPDIR), a stand-in for cao-server whose /proc tells where its agents run."""
    import signal as signals
    import time
    tools, tmux_dir = tmp_path / "tools", tmp_path / "tmux"
    tools.mkdir(), tmux_dir.mkdir(mode=0o700)
    (tools / "mock_cli").write_text("#!/bin/sh\nsleep 60\n", encoding="utf-8")       # its --version takes a minute
    (tools / "mock_cli").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TMUX")}, "TMUX_TMPDIR": str(tmux_dir),
           "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    cao = subprocess.Popen([sys.executable, "-c", FAKE_CAO], env=env, stdout=subprocess.PIPE, text=True)
    tmux = ["tmux", "-S", str(tmux_dir / f"tmux-{os.getuid()}" / "default")]
    try:
        port = int(cao.stdout.readline())
        check = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "run_orchestrator_loop.py"),
                                  "--check"], env={**env, "API": f"http://127.0.0.1:{port}", "OWN_SERVER": "0",
                                                   "PROVIDER": "mock_cli", "PROMPT_FILE": str(prompt_file),
                                                   "WD": str(prompt_file.parent)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        give_up = time.monotonic() + 60
        while "cao-loop-check-" not in subprocess.run([*tmux, "ls"], capture_output=True, text=True).stdout:
            assert check.poll() is None and time.monotonic() < give_up, check.communicate()
            time.sleep(0.05)
        check.send_signal(getattr(signals, signum))
        out, err = check.communicate(timeout=60)
        assert check.returncode == code, (out, err)
        assert err.strip().splitlines()[-1].endswith(": --check started nothing and changed nothing"), err
        assert "Traceback" not in err
        assert "cao-loop-check-" not in subprocess.run([*tmux, "ls"], capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        cao.kill()
        cao.wait()


def test_the_probe_names_the_agents_tmux_socket_and_never_reaches_another_tmux_server(orch, tmp_path, monkeypatch):
    """The probe's tmux commands name the socket of cao-server's tmux server (-S): where the folder its
    TMUX_TMPDIR names is gone (a run's own server whose folder was removed), tmux would fall back to the user's
    own server, so the probe says so and runs nothing."""
    calls = []
    monkeypatch.setattr(orch.subprocess, "run", lambda args, **kwargs: calls.append(args) or
                        subprocess.CompletedProcess(args, 1, stdout="", stderr="no"))
    gone = orch.LocalServer(1, os.getuid(), {"TMUX_TMPDIR": str(tmp_path / "gone")})
    assert orch.probe_agents_side(gone, []) == f"its folder {tmp_path / 'gone'} is gone" and calls == []
    here = orch.LocalServer(1, os.getuid(), {"TMUX_TMPDIR": str(tmp_path)})
    assert "tmux could not start a window there" in orch.probe_agents_side(here, [])
    assert calls and all(call[:3] == ["tmux", "-S", here.tmux_socket] for call in calls), calls
