"""The docs: the site under docs/ builds with no warning, the CLI reference is the app's own help, the README
stays short, keeps the fresh-machine commands that `.ci/run` runs, and links only to pages and anchors that
exist."""

from __future__ import annotations

import html as html_module
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _build_site(out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2, not a warning
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, env=env, timeout=300)


def test_the_docs_site_builds_strictly_and_the_readme_links_resolve(tmp_path):
    """`mkdocs build --strict` (mkdocs.yml turns broken links, missing anchors and pages left out of the nav
    into warnings): exit 0 and no WARNING line. Then every `docs/...` link of the README names a built page,
    and its `#anchor` an id on that page; the site's home page holds the README's fresh-machine commands."""
    site = tmp_path / "site"
    built = _build_site(site)
    output = built.stdout + built.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert built.returncode == 0 and not warnings, output[-4000:]

    links = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)", README.read_text())
    assert len(links) >= 15, links  # the README's table of pages
    for page, anchor in links:
        html = site / Path(page).relative_to("docs").with_suffix("") / "index.html"
        if page == "docs/index.md":
            html = site / "index.html"
        assert html.is_file(), f"README.md links to {page}, which the site does not build"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"README.md links to {page}#{anchor}: no such anchor"
    home = html_module.unescape(re.sub(r"<[^>]+>", "", (site / "index.html").read_text()))
    for command in _fresh_machine_commands():
        assert command in home, f"the site's home page lacks the README's command {command!r}"


def _fresh_machine_commands() -> list[str]:
    """The two command lines of the README's first code block (set up + quickstart; set up + the suite)."""
    block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_the_readme_is_short_and_ci_runs_its_test_command_verbatim():
    """The README is an entry point (under 150 lines), the rest are pages; `.ci/run` runs the README's second
    command exactly, so the command a newcomer copies is the one CI proves."""
    lines = README.read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines: move sections to docs/"
    setup_and_run, setup_and_test = _fresh_machine_commands()
    assert setup_and_run.endswith("scripts/make_assets.py && .venv/bin/jaxrl run configs/quickstart.toml")
    assert setup_and_test.endswith(".venv/bin/python -m pytest -q -n 2 --dist loadfile")
    assert setup_and_test in (REPO / ".ci" / "run").read_text().splitlines()


def test_the_cli_reference_is_the_apps_own_help():
    """docs/cli.md is what scripts/gen_cli_docs.py makes from the typer app now: a command, argument, option or
    help text changed without regenerating the page fails here."""
    spec = importlib.util.spec_from_file_location("gen_cli_docs", REPO / "scripts" / "gen_cli_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = gen.render()
    assert "### `jaxrl run`" in page and "#### `jaxrl eval run`" in page, page[:2000]
    assert (REPO / "docs" / "cli.md").read_text() == page, (
        "docs/cli.md is out of date with the CLI: run `python scripts/gen_cli_docs.py` and commit docs/cli.md")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def test_worktree_at_makes_the_tree_a_benchmark_row_names(tmp_path):
    """scripts/worktree_at.sh, in a two-commit repository: the tree at the first commit, with one file copied
    from the checkout and one from the second commit; a commit that does not exist, or a folder that does,
    is refused with exit 2 and one line."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    script = repo / "scripts" / "worktree_at.sh"
    script.write_bytes((REPO / "scripts" / "worktree_at.sh").read_bytes())
    script.chmod(0o755)
    _git(tmp_path, "init", "-q", "-b", "main", str(repo))
    for key, value in (("user.name", "t"), ("user.email", "t@t")):
        _git(repo, "config", key, value)
    (repo / "code.py").write_text("old\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "old")
    old = _git(repo, "rev-parse", "--short", "HEAD").strip()
    (repo / "code.py").write_text("new\n")
    (repo / "scripts" / "bench.py").write_text("bench at the new commit\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "new")
    new = _git(repo, "rev-parse", "--short", "HEAD").strip()
    (repo / "scripts" / "bench.py").write_text("bench in the checkout\n")

    before = tmp_path / "before"
    done = subprocess.run([str(script), old, str(before), "scripts/bench.py"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (before / "code.py").read_text() == "old\n"
    assert (before / "scripts" / "bench.py").read_text() == "bench in the checkout\n"
    assert _git(before, "rev-parse", "--short", "HEAD").strip() == old

    other = tmp_path / "other"
    done = subprocess.run([str(script), old, str(other), f"{new}:scripts/bench.py"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (other / "scripts" / "bench.py").read_text() == "bench at the new commit\n"

    for args, reason in (([f"{'0' * 40}", str(tmp_path / "x")], "not a commit"),
                         ([old, str(before)], "already exists")):
        refused = subprocess.run([str(script), *args], capture_output=True, text=True)
        assert refused.returncode == 2 and reason in refused.stderr, refused.stderr
    assert not (tmp_path / "x").exists()


_CREATES = re.compile(r"(--output=|--target |-d |mkdir -p |venv |> )$")


def _machine_paths(text: str) -> list[str]:
    """The lines of one markdown file that cite a machine's own path: any `/work/`, and a `/tmp/...` path
    outside a code block or used in one before the block's command creates it (`--output=`, `--target`,
    `-d`, `mkdir -p`, `venv`, `>`)."""
    bad, in_code, created = [], False, set()
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code, created = not in_code, set()
            continue
        if "/work/" in line:
            bad.append(f"{n}: {line.strip()}")
        for found in re.finditer(r"/tmp/[\w.-]+", line):
            path = found.group(0)
            if in_code and (path in created or _CREATES.search(line[:found.start()])):
                created.add(path)
            else:
                bad.append(f"{n}: {line.strip()}")
    return bad


def test_the_docs_cite_no_machine_paths():
    """No page and not the README sends a reader to a folder of the machine a figure was taken on (a clean
    clone cannot rerun it); a temporary file that a command makes and then uses is allowed. Checked on
    the rule's own cases first, so that it can fail."""
    assert _machine_paths("see /work/wt-coord\n") and _machine_paths("`--jaxrl /tmp/s20/before`\n")
    assert _machine_paths("```\npython x.py /tmp/qwen3-tok\n```\n")
    assert not _machine_paths("```\ngit archive --output=/tmp/src.tar.gz HEAD\nscp /tmp/src.tar.gz host:\n```\n")
    bad = {str(path.relative_to(REPO)): _machine_paths(path.read_text())
           for path in [README, *sorted((REPO / "docs").rglob("*.md"))]}
    bad = {path: lines for path, lines in bad.items() if lines}
    assert not bad, f"machine paths in the docs (use repo-relative paths; scripts/worktree_at.sh for trees): {bad}"
