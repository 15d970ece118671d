"""What prefill_ab.py and layer_ab.py share: running a snippet under another tree's gpt2ffn, and naming a tree's
commit. Not a benchmark of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path


def run_in_tree(src: Path, code: str, isa: str | None = None) -> dict:
    """The last line `code` prints, as JSON with "package": gpt2ffn.__file__ among its keys, run in a fresh process
    with `src`/src first on the path (and GPT2FFN_ISA=isa if given); stops if the gpt2ffn that answered is not
    src's own (an installed one would answer silently for a tree without src/gpt2ffn)."""
    env = dict(os.environ, PYTHONPATH=str(src / "src"))
    if isa:
        env["GPT2FFN_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(got["package"]).resolve().is_relative_to(src.resolve()):
        sys.exit(f"{src} has no gpt2ffn of its own (src/gpt2ffn): the run imported {got['package']}")
    return got


def commit(src: Path) -> str:
    """The tree's HEAD and whether it has uncommitted changes (what its numbers are of)."""
    git = ["git", "-C", str(src)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    return head + (" + uncommitted changes" if dirty.strip() else "")
