"""Where a benchmark's JSON report goes: only to the file --out names, never to an unannounced default."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def save_report(report: dict, out: str | None) -> None:
    """Writes `report` to `out` and says so; without --out, says how to keep it."""
    if out is None:
        print("(to keep these rows as JSON, add --out FILE.json)", file=sys.stderr)
        return
    Path(out).write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)
