"""Op coverage of the tpu device: PyTorch's OpInfo samples, tpu against CPU.

    python -m benchmarks.op_coverage [--ops a,b] [--out benchmarks/results]

Runs :mod:`benchmarks.opinfo` over op_db (or the listed ops), prints
the pass rate by category and overall, forward and backward, as % of samples,
and writes ``op_coverage.json`` and ``op_coverage.md`` into the out dir.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import opinfo as harness

FORWARD_TARGET = 95.0
BACKWARD_TARGET = 90.0


def _pct(tally: harness.Tally) -> str:
    value = harness.pct(tally)
    return "  n/a" if math.isnan(value) else f"{value:5.1f}"


def _row(name: str, fwd: harness.Tally, bwd: harness.Tally) -> list[str]:
    return [
        name,
        _pct(fwd),
        f"{fwd.passed}/{fwd.total}",
        f"{fwd.failed}",
        f"{fwd.errored}",
        _pct(bwd),
        f"{bwd.passed}/{bwd.total}",
        f"{bwd.failed}",
        f"{bwd.errored}",
    ]


HEADER = ["category", "fwd %", "fwd pass", "fwd fail", "fwd err", "bwd %", "bwd pass", "bwd fail", "bwd err"]


def summary_rows(results: harness.Results) -> list[list[str]]:
    by_cat = results.by_category()
    rows = [_row(cat, *by_cat[cat]) for cat in harness.CATEGORIES if cat in by_cat]
    rows.append(_row("overall", *results.totals()))
    return rows


def _text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [HEADER, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: harness.Results, top: int) -> str:
    fwd, bwd = results.totals()
    out = [
        "# tpu op coverage (OpInfo, tpu vs CPU)",
        "",
        f"Ops run: {len(results.ops)}; excluded: {len(results.excluded)}; not run (time budget): "
        f"{len(results.not_run)}; {results.seconds:.0f} s.",
        "",
        f"Forward: {_pct(fwd).strip()}% of {fwd.total} samples (target >= {FORWARD_TARGET:.0f}%). "
        f"Backward: {_pct(bwd).strip()}% of {bwd.total} samples (target >= {BACKWARD_TARGET:.0f}%).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(HEADER) - 1)) + "|",
    ]
    for row in summary_rows(results):
        out.append("| " + " | ".join(row) + " |")
    out += ["", f"## Ops with the most failing or erroring samples (top {top})", ""]
    out.append("| op | category | fwd fail | fwd err | bwd fail | bwd err | first message |")
    out.append("|---|---|---:|---:|---:|---:|---|")
    for r in results.worst(top):
        f, b = r.forward, r.backward
        msg = f.first_message or b.first_message or ""
        out.append(
            f"| {r.name} | {r.category} | {f.failed} | {f.errored} | {b.failed} | {b.errored} | {_md_escape(msg[:300])} |"
        )
    out += ["", "## Per op", "", "| op | category | dtype | fwd pass/total | bwd pass/total | first message |", "|---|---|---|---|---|---|"]
    for r in results.ops.values():
        for dtype, d in r.dtypes.items():
            msg = d.forward.first_message or d.backward.first_message or d.sample_error or ""
            out.append(
                f"| {r.name} | {r.category} | {dtype} | {d.forward.passed}/{d.forward.total} | "
                f"{d.backward.passed}/{d.backward.total} | {_md_escape(msg[:200])} |"
            )
    out += ["", "## Excluded", "", "| op | reason |", "|---|---|"]
    for name, reason in sorted(results.excluded.items()):
        out.append(f"| {name} | {_md_escape(reason)} |")
    out += ["", "Backward only left out:", "", "| op | reason |", "|---|---|"]
    for name, reason in sorted(results.excluded_backward.items()):
        out.append(f"| {name} | {_md_escape(reason)} |")
    out += ["", "Sample-level exclusions:", ""]
    for op, _, reason in harness.SAMPLE_RULES:
        out.append(f"- {op}: {reason}")
    out += ["", "Arguments kept on CPU in the tpu run:", ""]
    for op, (_, reason) in harness.CPU_RESIDENT_ARGS.items():
        out.append(f"- {op}: {reason}")
    out += ["", "Compared on shape/dtype/device only (values undefined):", ""]
    for op, reason in harness.VALUES_UNDEFINED.items():
        out.append(f"- {op}: {reason}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma-separated op names (default: all of op_db)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; later ops are not run")
    parser.add_argument("--max-samples", type=int, default=None, help="cap per op, dtype and direction")
    parser.add_argument("--top", type=int, default=25, help="how many worst ops to list")
    parser.add_argument("--trace", action="store_true", help="print each op's name to stderr before it runs")
    args = parser.parse_args(argv)

    faulthandler.enable()  # a crashing op at least leaves a traceback
    op_names = [n.strip() for n in args.ops.split(",") if n.strip()] if args.ops else None
    ops = harness.resolve_ops(op_names)

    bar = tqdm(total=len(ops), unit="op", dynamic_ncols=True, file=sys.stderr)

    def progress(name: str) -> None:
        if args.trace:
            tqdm.write(f"op: {name}", file=sys.stderr)
            sys.stderr.flush()
        bar.set_postfix_str(name, refresh=False)
        bar.update(1)

    results = harness.run(
        [harness.full_name(op) for op in ops],
        backward=not args.no_backward,
        time_budget=args.time_budget,
        max_samples=args.max_samples,
        progress=progress,
    )
    bar.close()

    fwd, bwd = results.totals()
    print()
    print(f"tpu op coverage: {len(results.ops)} ops run, {len(results.excluded)} excluded, "
          f"{len(results.not_run)} not run (time budget), {results.seconds:.0f} s")
    print(_text_table(summary_rows(results)))
    print()
    print(f"forward : {_pct(fwd).strip()}% of {fwd.total} samples pass   (target >= {FORWARD_TARGET:.0f}%)"
          f"  {'OK' if harness.pct(fwd) >= FORWARD_TARGET else 'BELOW TARGET'}")
    print(f"backward: {_pct(bwd).strip()}% of {bwd.total} samples pass   (target >= {BACKWARD_TARGET:.0f}%)"
          f"  {'OK' if harness.pct(bwd) >= BACKWARD_TARGET else 'BELOW TARGET'}")
    n_crash = sum("crashes the process" in r for r in [*results.excluded.values(), *results.excluded_backward.values()])
    print(f"excluded ops: {len(results.excluded)} (see EXCLUDED in benchmarks/opinfo/exclusions.py), "
          f"backward-only exclusions: {len(results.excluded_backward)} (EXCLUDED_BACKWARD), "
          f"of which {n_crash} for crashes; "
          f"samples excluded by {len(harness.SAMPLE_RULES)} sample rules: "
          f"{sum(d.excluded_samples for r in results.ops.values() for d in r.dtypes.values())}")
    crashes = {n: r for n, r in [*results.excluded.items(), *results.excluded_backward.items()] if "crashes" in r}
    for name, reason in crashes.items():
        print(f"  CRASH (excluded{' backward' if name in results.excluded_backward else ''}): {name}: {reason[:150]}")
    worst = results.worst(args.top)
    if worst:
        print()
        print(f"ops with the most failing/erroring samples (top {args.top}):")
        for r in worst:
            f, b = r.forward, r.backward
            msg = f.first_message or b.first_message or ""
            print(f"  {r.name:45s} fwd {f.failed:3d} fail {f.errored:3d} err | bwd {b.failed:3d} fail {b.errored:3d} err | {msg[:160]}")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = results.to_json()
    data["summary"] = {
        "forward": {"passed": fwd.passed, "failed": fwd.failed, "errored": fwd.errored, "pct": harness.pct(fwd)},
        "backward": {"passed": bwd.passed, "failed": bwd.failed, "errored": bwd.errored, "pct": harness.pct(bwd)},
        "targets": {"forward": FORWARD_TARGET, "backward": BACKWARD_TARGET},
        "torch": torch.__version__,
    }
    (out_dir / "op_coverage.json").write_text(json.dumps(data, indent=1, default=str))
    (out_dir / "op_coverage.md").write_text(markdown(results, args.top))
    print(f"\nwrote {out_dir / 'op_coverage.json'} and {out_dir / 'op_coverage.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
