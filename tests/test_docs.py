"""The documentation cannot drift from the program, nor point nowhere.

docs/settings.md holds one row per setting whose variable, JSON key and default are the program's
own (``SETTINGS``, defaults as ``--help-settings`` shows them), and no row for a setting that does
not exist; the README's short table obeys the same rule. Every relative Markdown link in README.md
and docs/*.md leads to a file that exists, and every ``#anchor`` to a heading of that file. The
script's sections use only what stands above them, but for the forward references listed here.
"""

from __future__ import annotations

import ast
import re
import symtable
import textwrap
from pathlib import Path

import pytest

import run_orchestrator_loop as orch
from conftest import FULL_SUITE_COMMAND, ROOT, project_files

README = ROOT / "README.md"
DOCS = ROOT / "docs"
SETTINGS_DOC = DOCS / "settings.md"
TABLE_HEADER = "| variable | JSON key | default | meaning |"
ENVIRONMENT_ONLY = "– (environment only)"
README_LIMIT = 20_000


def markdown_files() -> list[Path]:
    return [README, *docs_pages()]


def docs_pages() -> list[Path]:
    """The pages of docs/ git tracks (not a draft lying beside them)."""
    return [page for page in project_files("docs") if page.parent == DOCS and page.suffix == ".md"]


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row; a `|` inside a code span does not split."""
    cells, cell, in_code = [], "", False
    for char in line.strip().removeprefix("|").removesuffix("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    cells.append(cell.strip())
    return cells


def settings_rows(text: str) -> list[list[str]]:
    """Every row of every table headed like the settings table."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.strip() == TABLE_HEADER:
            in_table = True
        elif in_table and line.startswith("|---"):
            continue
        elif in_table and line.startswith("|"):
            rows.append(split_row(line))
        else:
            in_table = False
    return rows


def code_name(cell: str) -> str | None:
    """`NAME` -> NAME; anything else (prose, several code spans) -> None."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    return match.group(1) if match else None


def default_matches(cell: str, shown: str) -> bool:
    """The default cell says what --help-settings shows, perhaps with a note in brackets after it:
    `1800` s is "1800 s", – (each CLI's own default) is "-"."""
    plain = cell.replace("`", "").replace("–", "-").strip()
    return plain == shown or plain.startswith(shown + " (")


def check_rows(rows: list[list[str]], where: str) -> dict[str, list[list[str]]]:
    """Each row names a setting or a secret, with its JSON key and default; returns rows by variable."""
    by_name: dict[str, list[list[str]]] = {}
    problems = []
    for row in rows:
        if len(row) != 4:
            problems.append(f"{where}: a row without 4 cells: {row}")
            continue
        name = code_name(row[0])
        if name is None:
            problems.append(f"{where}: the variable cell is not one `NAME`: {row[0]!r}")
            continue
        by_name.setdefault(name, []).append(row)
        if name in orch.SECRET_VARIABLES:
            if row[1] != ENVIRONMENT_ONLY or not default_matches(row[2], "-"):
                problems.append(f"{where}: {name} is a secret: JSON key {ENVIRONMENT_ONLY}, default -; got {row[1:3]}")
            continue
        setting = orch.SETTINGS_BY_ENV.get(name)
        if setting is None:
            problems.append(f"{where}: {name} is no setting of the program")
            continue
        if code_name(row[1]) != setting.key:
            problems.append(f"{where}: {name}: JSON key {row[1]!r}, the program has `{setting.key}`")
        if not default_matches(row[2], orch._shown_default(setting)):
            problems.append(f"{where}: {name}: default {row[2]!r}, the program has {orch._shown_default(setting)!r}")
    assert problems == []
    return by_name


def test_settings_doc_has_exactly_one_matching_row_per_setting():
    by_name = check_rows(settings_rows(SETTINGS_DOC.read_text(encoding="utf-8")), "docs/settings.md")
    for setting in orch.SETTINGS:
        assert len(by_name.get(setting.env, [])) == 1, f"docs/settings.md: {setting.env} needs exactly one row"
    for secret in orch.SECRET_VARIABLES:
        assert len(by_name.get(secret, [])) == 1, f"docs/settings.md: {secret} needs exactly one row"
    assert set(by_name) == {s.env for s in orch.SETTINGS} | set(orch.SECRET_VARIABLES)


def test_readme_settings_table_is_the_programs_and_holds_the_settings_most_runs_set():
    readme = README.read_text(encoding="utf-8")
    by_name = check_rows(settings_rows(readme), "README.md")
    assert all(len(rows) == 1 for rows in by_name.values()), by_name
    missing = [env for env in orch.COMMON_SETTINGS if env not in by_name]
    assert missing == [], f"README.md: --help's settings most runs set, not in its table: {missing}"


def test_readme_is_a_front_door_that_lists_every_docs_page():
    readme = README.read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= README_LIMIT
    where = readme.split("\n## Where the rest is", 1)[1]
    assert [page.name for page in docs_pages() if f"](docs/{page.name})" not in where] == []


def test_readme_keeps_the_commands_the_suite_runs():
    readme = README.read_text(encoding="utf-8")
    quick_start = readme.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"```sh\n.*?pip install '\.\[cao\]'.*?\n.*?cao-orchestrator-loop --demo .*?\n```", quick_start, re.S)
    test = readme.split("\n## Test", 1)[1].split("\n## ", 1)[0]
    assert f"```sh\npip install -e '.[test]' && {FULL_SUITE_COMMAND}\n```" in test
    assert re.search(r"`(python -m pytest)` alone runs the fast tier", test)


# -- links -----------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def without_code(text: str) -> str:
    """The text without fenced blocks and inline code spans, where a link is no link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchor(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens, -1, -2 for repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {anchor(match.group(1), seen) for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def test_the_anchor_of_a_heading_is_githubs():
    seen: dict[str, int] = {}
    assert anchor("Long runs: compacted conversations and usage limits", seen) == \
        "long-runs-compacted-conversations-and-usage-limits"
    assert anchor("When a real CLI's turn ends", seen) == "when-a-real-clis-turn-ends"
    assert anchor("The scripted agent (mock_cli)", seen) == "the-scripted-agent-mock_cli"
    assert [anchor("Notes", seen), anchor("Notes", seen)] == ["notes", "notes-1"]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path):
    broken = []
    links = LINK.findall(without_code(page.read_text(encoding="utf-8")))
    for target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto: ...
            continue
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists() or ROOT not in linked.parents:
            broken.append(f"{target}: no such file in the repository")
        elif fragment and (linked.suffix != ".md" or fragment not in anchors(linked)):
            broken.append(f"{target}: no heading #{fragment} in {linked.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"
    if page != README:
        assert links, f"{page.relative_to(ROOT)} links nowhere"


# -- the sections' order -----------------------------------------------------------------

# The references from a section to a name defined in a later one, each with why it stands there; any other
# reference points upward (the module docstring says so). {name used: (the top-level users, why)}
FORWARD_REFERENCES = {
    "token_records_readable": (("check_budget_settings",), "a token budget needs the CLIs' records (5) readable"),
    "record_event": (("note_turn_outcome",), "a turn's outcome goes into the run record (4)"),
    "extract_test_evidence": (("_outcome",), "the run's page shows the tester's evidence (10)"),
    "tokens_not_counted": (("_tokens_figure", "_tokens_section"), "the page says why no tokens are known (15)"),
    "sent_turn_facts": (("_unanswered_turn",), "the page describes the prompt still unanswered (8)"),
    "promise_signal": (("reply_complete",), "a story's reply is whole with its promise signal (11)"),
    "record_agent_event": (("begin_limit_wait", "switch_to_fallback"), "the wait records a usage limit as asking (8) "
                           "does"),
    "new_agent_for": (("switch_to_fallback",), "a usage limit's fallback agent starts as any agent alone (7)"),
    "exit_terminals": (("end_agents_switched_from",), "... and the limited agent it took over is ended as any (7)"),
    "cut_short_here": (("ApiClient",), "a request of an agent start cut short (7) is never asked again"),
    "note_conversation": (("observe_terminal",), "the wait notes a compacted conversation for asking (8)"),
    "send_prompt": (("resend_in_full",), "the wait resends a prompt lost on the screen (8)"),
    "PromptDraft": (("stale_round_reason",), "whether the next prompt carries the round's history (12)"),
    "sprung_traps": (("start_failure_hint",), "a failed start-up names a CLI's trap only when --check finds it (16)"),
    "cli_switches": (("switched_to",), "a role the run moved to its fallback CLI runs on it (3)"),
    "RECORD_FORMATS": (("AGENT_CLIS",), "a row names the format of its records, whose reader is bound in (5)"),
    "COMPACTION_READERS": (("AGENT_CLIS",), "a row names its compaction settings, whose reader is bound in (5)"),
    "TokenReading": (("TokenRecords",), "a row's own reader returns what the records say of a turn (5)"),
    "RunningTotals": (("TokenRecords",), "... and is given a CLI's running totals (5)"),
    "Prompt": (("Turn", "wait_for_reply"), "the wait rebuilds a turn's prompt after a compaction (8)"),
}


def forward_references(source: str) -> set[tuple[str, str]]:
    """(top-level user, name) for each name a top-level function or class of section N uses that is first
    defined at the top level of a section M > N; sections are the `# N. Title` banners (0 above the first)."""
    banners = [(source.count("\n", 0, match.start()) + 1, int(match.group(1)))
               for match in re.finditer(r"^# (\d+)\. ", source, re.M)]

    def section(line: int) -> int:
        return max((number for start, number in banners if start <= line), default=0)

    tree = ast.parse(source)
    defined: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        else:
            names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        for name in names:
            defined.setdefault(name, section(node.lineno))

    def statement_at(line: int) -> ast.stmt:
        return next(node for node in tree.body if node.lineno <= line <= node.end_lineno)

    found = set()
    tables = list(symtable.symtable(source, "module", "exec").get_children())
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        user = statement_at(table.get_lineno())
        for symbol in table.get_symbols():
            name = symbol.get_name()
            outer = symbol.is_global() or (table.get_type() == "class" and not symbol.is_assigned())
            if symbol.is_referenced() and outer and defined.get(name, 0) > section(user.lineno):
                found.add((user_name(user), name))
    for user in tree.body:                      # annotations (never run) name what they mention
        found |= {(user_name(user), name) for name in annotation_names(user)
                  if defined.get(name, 0) > section(user.lineno)}
    links = {node: string_links(node) for node in tree.body}
    links = {node: strings for node, strings in links.items() if strings}
    for table in tree.body:                     # a row's string names a later table's entry (its format's reader)
        if isinstance(table, (ast.Assign, ast.AnnAssign)) and isinstance(table.value, (ast.Dict, ast.DictComp)):
            named = {part.value for part in ast.walk(table) if isinstance(part, ast.Constant)
                     and isinstance(part.value, str)}
            found |= {(user_name(user), user_name(table)) for user, strings in links.items() if strings & named
                      and section(table.lineno) > section(user.lineno)}
    return found


def user_name(node: ast.stmt) -> str:
    """A top-level statement as the check names it: its function's or class's name, the name it assigns, or its line."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(target, ast.Name):
            return target.id
    return getattr(node, "name", f"line {node.lineno}")


def annotation_names(node: ast.AST) -> set[str]:
    """The names an annotation under `node` mentions, written as code or as a string."""
    annotations = [n.annotation for n in ast.walk(node) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation]
    annotations += [n.returns for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.returns]
    names = set()
    for annotation in annotations:
        for part in ast.walk(annotation):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                names |= annotation_names(ast.parse(f"x: {part.value}"))
            elif isinstance(part, ast.Name):
                names.add(part.id)
    return names


def string_links(node: ast.AST) -> set[str]:
    """The strings the rows under `node` give their fields directly (e.g. records="claude transcripts")."""
    return {keyword.value.value for call in ast.walk(node) if isinstance(call, ast.Call)
            and getattr(call.func, "id", "") == "AgentCli" for keyword in call.keywords
            if isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, str) and keyword.value.value}


def test_forward_references_are_found_through_scopes():
    source = textwrap.dedent("""\
        # 0. First
        def early():
            late = 1
            return late + later()
        class Early:
            def method(self):
                return LATER
        # 1. Next
        def later():
            return early()
        late = 3
        LATER = 4
        """)
    assert forward_references(source) == {("early", "later"), ("Early", "LATER")}


def test_forward_references_are_found_in_annotations_and_in_the_rows_string_links():
    source = textwrap.dedent("""\
        from __future__ import annotations
        # 0. First
        def early(x: Later, y: "list[Quoted]") -> int | Returned:
            return 1
        class Early:
            field: dict[str, Held] = None
        ROWS = {"one": AgentCli("One", records="one's records")}
        # 1. Next
        class Later: pass
        class Quoted: pass
        class Returned: pass
        class Held: pass
        FORMATS = {name: name for name in ("one's records", "two's records")}
        """)
    assert forward_references(source) == {("early", "Later"), ("early", "Quoted"), ("early", "Returned"),
                                          ("Early", "Held"), ("ROWS", "FORMATS")}


def test_each_section_uses_only_what_stands_above_it_but_the_listed_references():
    source = Path(orch.__file__).read_text(encoding="utf-8")
    allowed = {(user, name) for name, (users, _why) in FORWARD_REFERENCES.items() for user in users}
    found = forward_references(source)
    assert sorted(found - allowed) == [], "a reference to a later section: move the name up, or list it here"
    assert sorted(allowed - found) == [], "listed but gone: take it off FORWARD_REFERENCES"
    assert "each uses only what stands above it, save the\nfew forward references tests/test_docs.py" in orch.__doc__
