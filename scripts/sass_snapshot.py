"""The machine code of the plain, taps and timing builds of a few shapes, one SASS file each (nvdisasm, no source
lines), for checking that a refactor leaves the kernel's instructions as they were:

    python scripts/sass_snapshot.py OUT_DIR                       # write OUT_DIR/<model>.<build>.sass
    python scripts/sass_snapshot.py OUT_DIR --compare BEFORE_DIR  # and diff against an earlier snapshot; exit 1 on a difference
"""
from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.compiler import compile as C  # noqa: E402
from workbench.compiler.assemble import BuildOptions, assemble  # noqa: E402
from workbench.model.config import get_config  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b")
BUILDS = {"plain": {}, "taps": {"taps": True}, "timing": {"timing": True}}


def sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin)
        return subprocess.run([C.cuda_tool("nvdisasm"), "-c", str(p)], capture_output=True, text=True,
                              check=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--compare", help="an earlier snapshot's folder")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    differ = 0
    for model in MODELS:
        cfg = get_config(model)
        for build, fields in BUILDS.items():
            cubin, _ = C.compile_cubin(assemble(cfg, BuildOptions(**fields)))
            text = sass(cubin)
            name = f"{model}.{build}.sass"
            (out / name).write_text(text)
            line = f"{name}: {sum(1 for t in text.splitlines() if t.strip().startswith('/*'))} instructions"
            if a.compare:
                before = (Path(a.compare) / name).read_text()
                diff = list(difflib.unified_diff(before.splitlines(), text.splitlines(), lineterm="", n=0))
                line += ", identical" if not diff else f", {len(diff)} diff lines"
                differ += bool(diff)
            print(line, flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
