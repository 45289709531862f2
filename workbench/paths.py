"""Where things are: the repository root (a source checkout or an editable install), the kernel sources, the
recorded fixtures."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
