from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start")[1].split("##")[0]
    commands = [line for line in quick.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2, commands
    assert commands[0].endswith("gpt2ffn demo")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
