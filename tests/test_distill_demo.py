"""scripts/distill_demo.py writes its environment, SFT data and configs, and never over files already there
unless asked (`--force`): a second run into the same folder is one line, exit 2, the files as they were."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "distill_demo.py"


def test_the_demo_never_writes_over_its_files_unless_forced(tmp_path):
    out = tmp_path / "demo"
    first = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    student = out / "student.toml"
    assert 'adv_tau = 0.0' in student.read_text() and (out / "env" / "shout" / "__init__.py").is_file()
    student.write_text("mine\n")
    again = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "exists; pass --force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and student.read_text() == "mine\n"
    forced = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--force"], capture_output=True, text=True)
    assert forced.returncode == 0 and 'adv_tau = 0.0' in student.read_text()
