"""Export a revision of this repository as the package `flash_cute_old` (its kernels in
`flash_cute_old.kernels`), for the A/B scripts that time it beside the working tree in one
process. Run from the repository root:

    python benchmarks/old_package.py REV OLD_DIR      # then OLD_DIR/flash_cute_old/...

Absolute imports of `flash_cute` inside the exported files are renamed; the old package keeps
its own disk cache namespace (its sources are fingerprinted like any other version).
"""

import re
import subprocess
import sys
from pathlib import Path


def export(rev: str, old_dir: str) -> Path:
    package = Path(old_dir) / "flash_cute_old"
    for source, target in (("flash_cute", package), ("kernels", package / "kernels")):
        files = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", f"{rev}:{source}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            if not name.endswith(".py"):
                continue
            text = subprocess.run(
                ["git", "show", f"{rev}:{source}/{name}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            text = re.sub(r"\bflash_cute\b(?=[.\s])", "flash_cute_old", text)
            # The torch.library namespace too: both packages' ops live in one process.
            text = re.sub(r'"flash_cute(?=::|")', '"flash_cute_old', text)
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_text(text)
    return package


if __name__ == "__main__":
    print(export(sys.argv[1], sys.argv[2]))
