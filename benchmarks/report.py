"""Writing benchmark results: JSON for tools, a markdown table for people."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

DEFAULT_DIR = Path(__file__).with_name("results")


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
    }


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write(name: str, payload: dict[str, Any], table: str, out_dir: Path = DEFAULT_DIR) -> tuple[Path, Path]:
    """Writes <name>.json and <name>.md into out_dir; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    write_atomically(json_path, json.dumps({"environment": environment(), **payload}, indent=2))
    write_atomically(md_path, f"# {name}\n\n{table}\n")
    return json_path, md_path
