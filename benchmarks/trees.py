"""What prefill_ab.py and layer_ab.py share: running a snippet under another tree's gpt2ffn, and naming a tree's
commit. Not a benchmark of its own."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def ab_parser(description: str, rounds: int, repeats: int, threads: int) -> argparse.ArgumentParser:
    """The options both A/B scripts take (the other tree, the precision, rounds, repeats, threads, ISA, output),
    with each script's own defaults; a script adds what is its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--against", type=Path, required=True, help="the other tree (a checkout with src/gpt2ffn built)")
    p.add_argument("--precision", default="int8", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--isa", help="GPT2FFN_ISA for both trees (default: what each picks)")
    p.add_argument("--out", type=Path)
    return p


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
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout
    return head + (" + uncommitted changes" if dirty.strip() else "")
