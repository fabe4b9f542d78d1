"""The workflow passes Snakemake's own linter (every rule with a log and an environment, no
undeclared environment variables), as the issue-10 layout promised."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_snakemake_lint_is_clean():
    out = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "--lint", "-s", str(ROOT / "Snakefile"),
                          "-d", str(ROOT)], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Lints for" not in text, text[-3000:]
