"""Write docs/cli.md, the CLI reference, from the typer app itself, so the page cannot drift from the code.

    python scripts/gen_cli_docs.py            # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check    # exit 1 when docs/cli.md differs from what the app gives

The walk goes over the command tree that typer builds from `jaxrl.cli.main.app` (not over files), so
commands moved between modules, added or renamed appear here as they are. Each command gives its help text
(the app's `rich_markup_mode` is "markdown", so the text is written as it is, with `<` escaped outside code
spans so that `<output_dir>` is not read as an HTML tag), its usage line, and each argument and option as
typer's help record gives it (names, metavar, help, default). `tests/test_docs.py` runs `--check`.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import typer
import typer.core
import typer.main

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "docs" / "cli.md"
HEADER = """# CLI reference

Every `jaxrl` command, argument and option, as `jaxrl COMMAND --help` prints them. This page is generated
from the CLI itself by `scripts/gen_cli_docs.py` (`tests/test_docs.py` fails when it is out of date); what
each command is for, with examples: [Commands](commands.md).
"""
_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _markdown(text: str) -> str:
    """Help text as markdown: `<` and `>` escaped outside code spans, trailing spaces dropped."""
    parts = _CODE_SPAN.split(text.strip())
    escaped = [p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts]
    return "\n".join(line.rstrip() for line in "".join(escaped).splitlines())


def _params(command: typer.core.TyperCommand, ctx: typer.Context, kind: str) -> list[str]:
    """One list item per parameter of `kind` ("argument" or "option") that has a help record."""
    items = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None or param.param_type_name != kind:
            continue
        names, help_text = record
        item = f"- `{names}`"
        if help_text:
            item += ": " + _markdown(help_text).replace("\n", " ")
        items.append(item)
    return items


def _command(command: typer.core.TyperCommand, ctx: typer.Context, path: str, depth: int) -> list[str]:
    """The section of one command (and, for a group, of each of its subcommands, one heading deeper)."""
    lines = [f"{'#' * depth} `{path}`", ""]
    if command.help:
        lines += [_markdown(command.help), ""]
    lines += ["```console", f"$ {path} {' '.join(command.collect_usage_pieces(ctx))}".rstrip(), "```", ""]
    for title, kind in (("Arguments", "argument"), ("Options", "option")):
        items = _params(command, ctx, kind)
        if items:
            lines += [f"**{title}**", "", *items, ""]
    if isinstance(command, typer.core.TyperGroup):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            sub_ctx = typer.Context(sub, info_name=name, parent=ctx)
            lines += _command(sub, sub_ctx, f"{path} {name}", depth + 1)
    return lines


def render() -> str:
    """The whole page, from `jaxrl.cli.main.app`."""
    from jaxrl.cli.main import app

    command = typer.main.get_command(app)
    ctx = typer.Context(command, info_name="jaxrl")
    body = "\n".join(_command(command, ctx, "jaxrl", 2)).rstrip() + "\n"
    return HEADER + "\n" + body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/cli.md instead of writing it")
    args = ap.parse_args(argv)
    page = render()
    if not args.check:
        OUT.write_text(page)
        return 0
    current = OUT.read_text() if OUT.exists() else ""
    if current == page:
        return 0
    diff = difflib.unified_diff(current.splitlines(), page.splitlines(), "docs/cli.md", "from the app", lineterm="")
    print("\n".join(list(diff)[:60]))
    print("docs/cli.md is out of date with the CLI: run `python scripts/gen_cli_docs.py` and commit docs/cli.md")
    return 1


if __name__ == "__main__":
    sys.exit(main())
