"""The docs' `mkport ...` commands against the command line: every subcommand they run exists, and every option they
give it is one that subcommand takes (read from the Typer app itself, so a renamed or removed option fails here).

A command is found in a fenced code block (a whole line) or in inline code (`mkport ...`); it runs to the next
`mkport `, shell separator (&&, ||, ;, an unescaped |, #) or the end of its span. A README table row whose first
cell is `mkport NAME ...` also lends NAME to the inline `--options` of its other cells (its description)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from mkport.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# docs/benchmarks.md is also the log of the kernel designs that were measured and removed; these options went with
# them (kernel v2's producer warp, the attention/o_proj fusion that was never merged) and stay in the log as run.
HISTORICAL = {("benchmarks.md", "diff", "--fused-o-proj"), ("benchmarks.md", "diff", "--producer-warp")}

COMMAND = re.compile(r"(?<![\w./~-])mkport ((?:cache )?[a-z][a-z-]*)")
SEPARATOR = re.compile(r"&&|\|\||;|(?<!\\)\||#")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ROW = re.compile(r"^\|\s*`mkport ([a-z][a-z-]*)")


def cli_options() -> dict[str, set[str]]:
    """subcommand ('cache list' for a group's) -> the options it takes, --help included."""
    out: dict[str, set[str]] = {}

    def walk(command, prefix):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*prefix, name])
        else:
            out[" ".join(prefix)] = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        if hasattr(command, "commands") and prefix:  # a group (`mkport cache`): its own --help
            out[" ".join(prefix)] = {"--help"}

    walk(typer.main.get_command(app), [])
    return out


def _spans(text: str) -> list[tuple[int, str, str]]:
    """(line number, span, the whole line) of every code block line (without its comment) and inline code span."""
    spans, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:  # a shell comment is prose
            spans.append((number, re.sub(r"(^|\s)#.*", "", line), line))
        else:
            spans += [(number, span, line) for span in re.findall(r"`([^`\n]+)`", line)]
    return spans


def doc_problems(name: str, text: str, options: dict[str, set[str]]) -> list[str]:
    """'name:line: ...' for each unknown subcommand and each option its subcommand does not take."""
    problems = set()

    def check(number: int, command: str, flags: list[str]) -> None:
        if command not in options:
            problems.add(f"{name}:{number}: no subcommand `mkport {command}`")
            return
        for flag in flags:
            if flag not in options[command] and (name, command, flag) not in HISTORICAL:
                problems.add(f"{name}:{number}: `mkport {command}` takes no {flag}")

    for number, span, line in _spans(text):
        for match in COMMAND.finditer(span):
            command = match.group(1)
            rest = COMMAND.split(span[match.end():], maxsplit=1)[0]
            rest = SEPARATOR.split(rest, maxsplit=1)[0]
            check(number, command, OPTION.findall(rest))
        row = ROW.match(line)
        if row and span.startswith("--"):
            check(number, row.group(1), OPTION.findall(span)[:1])
    return sorted(problems)


def test_every_documented_command_and_option_exists():
    options = cli_options()
    assert {"generate", "speak", "serve", "cache list"} <= set(options)
    found = sum(len(COMMAND.findall(doc.read_text())) for doc in DOCS)
    assert found > 100  # the pattern finds the docs' commands
    assert [p for doc in DOCS for p in doc_problems(doc.name, doc.read_text(), options)] == []


def test_a_wrong_option_or_subcommand_is_found():
    options = cli_options()
    text = "\n".join([
        "Run `mkport generate MODEL --chek` or `mkport specs --json`.",
        "```",
        "mkport speak \"Hi\" --random-weights tiny --backend reference --out a.wav && mkport lsit",
        "mkport diff qwen3-0.6b --producer-warp  # --not-checked (mkport needs a GPU)",
        "```",
        "| `mkport bench-tts (DIR \\| --random-weights 0.6b)` | times it; `--plan FILE`, `--no-such`; was `bench --tts` |",
        "`mkport cache clear --builds|--weights|--all`, `mkport cache list --all`",
    ])
    assert doc_problems("page.md", text, options) == [
        "page.md:1: `mkport generate` takes no --chek",
        "page.md:3: no subcommand `mkport lsit`",
        "page.md:4: `mkport diff` takes no --producer-warp",
        "page.md:6: `mkport bench-tts` takes no --no-such",
        "page.md:7: `mkport cache list` takes no --all",
    ]
    # the same removed option is allowed only where the log of removed designs keeps it
    assert doc_problems("benchmarks.md", "`mkport diff --producer-warp`", options) == []
