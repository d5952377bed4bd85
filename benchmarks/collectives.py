"""Collectives over ``tpu_dist`` on tpu tensors against raw gloo on CPU tensors.

``python -m benchmarks.collectives [--quick] [--world-size 2] [--sizes 4K,1M] [--collectives all_reduce]``

The ranks here share a host, so ``tpu_dist`` carries these collectives through
its shared-memory segment (``torch_tpu/distributed/shared_memory.py``), where
gloo sends them over TCP on the loopback interface. A third side,
``tpu_dist`` with ``TORCH_TPU_DIST_TRANSPORT=gloo`` (the path of a group that
spans hosts: gloo on CPU views of the tpu tensors), shows what the tpu layer
itself costs over raw gloo, per call and per byte.

Collectives: ``all_reduce`` (SUM) and ``all_to_all_single`` (even splits), at
4 KiB, 16 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB and 64 MiB of float32
per rank (the input tensor of each rank). One run spawns ``--world-size``
processes on 127.0.0.1 (each takes ``tpu:<rank>``), which join a ``tpu_dist``
group (the world), a ``tpu_dist`` group on gloo alone, and a plain gloo group
(``new_group(backend="gloo")``, the anchor, which also carries the
benchmark's own barriers and reductions).

Per size and collective: warm-up calls on each side (their time picks the
calls per block, about ``--block-ms`` of work, and the rounds, at most
``--rounds`` within ``--cell-budget`` seconds: large sizes get fewer), then
rounds of one block per side, sides alternating which goes first, a barrier
before each block. A block's time per call is the max over ranks; the
reported time is its median over rounds, with the spread of the rounds
(IQR / median: other load on the machine widens it). The ratio is paired: the
median over rounds of tpu_dist's block time over gloo's in the same round (the
sides run back to back, so they share the machine's drift); the gloo-alone
side gets its own paired ratio, without a target. GB/s is the algorithmic bandwidth, bytes per rank's tensor / time.

Rounds: the round-to-round spread here is 20-60% (more for the shared-memory
side's few-microsecond calls), so the median ratio's error over 61 rounds is
about 5%; the default allows up to DEFAULT_ROUNDS, and the 10 s cell budget
gives about 65 to each cell of the three sides.

Targets (time ratio tpu_dist / gloo, printed beside the numbers):
  4 KiB - 64 KiB (per-call overhead)   <= 1.20
  >= 1 MiB (bandwidth)                 <= 1.05
256 KiB is measured but has no target.

The full run takes about 2 minutes (3 ranks: about 2.5) on the 2-core development machine
(--quick, a smoke run of every size with a few short rounds: about 15 s). Rank 0 writes
``benchmarks/results/collectives.{json,md,png}``. The launcher has a deadline
(``--timeout``): past it every rank is killed and the run exits non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import report
from torch_tpu.distributed import group_transport
from torch_tpu.distributed.local_ranks import free_port, start_local_ranks

KiB, MiB = 2**10, 2**20
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
COLLECTIVES = ("all_reduce", "all_to_all_single")
SIDES = ("tpu_dist", "gloo", "tpu_dist_gloo")  # the last: tpu_dist with TORCH_TPU_DIST_TRANSPORT=gloo
DEFAULT_ROUNDS = 241  # the cell budget stops most cells near 65 (module docstring)
ELEMENT_BYTES = 4  # float32


@dataclasses.dataclass(frozen=True)
class Target:
    """A bound on the time ratio tpu_dist / gloo over a range of sizes (bytes, inclusive)."""

    label: str
    low: int
    high: int | None
    max_ratio: float

    def covers(self, nbytes: int) -> bool:
        return nbytes >= self.low and (self.high is None or nbytes <= self.high)


TARGETS = (
    Target("per-call overhead, 4-64 KiB", 4 * KiB, 64 * KiB, 1.20),
    Target("bandwidth, >= 1 MiB", 1 * MiB, None, 1.05),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every rank needs to run the same schedule (picklable: it crosses the spawn)."""

    sizes: tuple[int, ...]
    collectives: tuple[str, ...]
    warmup: int
    max_rounds: int
    min_rounds: int
    block_s: float
    max_calls: int
    cell_budget_s: float
    group_timeout_s: float
    out_dir: str
    quick: bool


# ---------------------------------------------------------------- per rank: tensors and calls


def _elements(nbytes: int, world: int) -> int:
    """float32 elements of a rank's tensor; a multiple of world so all_to_all splits evenly."""
    return max(world, nbytes // ELEMENT_BYTES // world * world)


def make_call(collective: str, nbytes: int, device: torch.device, group: dist.ProcessGroup | None,
              world: int) -> Callable[[], None]:
    """One blocking call of `collective` on a rank's tensor of about `nbytes`, allocated once."""
    # Zeros: SUM keeps them zero, where ones would double each call and reach inf.
    source = torch.zeros(_elements(nbytes, world), device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(source, op=dist.ReduceOp.SUM, group=group)
    if collective == "all_to_all_single":
        received = torch.empty_like(source)
        return lambda: dist.all_to_all_single(received, source, group=group)
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def check_collectives(device: torch.device, group: dist.ProcessGroup | None, rank: int, world: int) -> None:
    """Both collectives give the right values on `device`, so the timing cannot compare a broken path."""
    n = 4 * world
    x = torch.full((n,), float(rank + 1), device=device)
    dist.all_reduce(x, group=group)
    expected = torch.full((n,), float(world * (world + 1) // 2))
    if x.device != device or not torch.equal(x.cpu(), expected):
        raise RuntimeError(f"all_reduce on {device}: got {x.cpu().tolist()}, expected {expected.tolist()}")
    # Element i of rank r's input is r * n + i; chunk j goes to rank j.
    source = (torch.arange(n, dtype=torch.float32) + rank * n).to(device)
    received = torch.empty_like(source)
    dist.all_to_all_single(received, source, group=group)
    chunk = n // world
    expected = torch.cat([torch.arange(chunk, dtype=torch.float32) + r * n + rank * chunk for r in range(world)])
    if received.device != device or not torch.equal(received.cpu(), expected):
        raise RuntimeError(f"all_to_all_single on {device}: got {received.cpu().tolist()}, "
                           f"expected {expected.tolist()}")


# ---------------------------------------------------------------- per rank: timing


def seconds_per_call(call: Callable[[], None], calls: int) -> float:
    # The calls are blocking (the work is waited for) and tpu ops run on the
    # calling thread, so the clock stops when the last collective is done.
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def max_over_ranks(values: list[float], anchor: dist.ProcessGroup) -> list[float]:
    """Elementwise max over ranks: a collective is as slow as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=anchor)
    return t.tolist()


def warm_up(calls: dict[str, Callable[[], None]], warmup: int, anchor: dist.ProcessGroup) -> float:
    """Runs `warmup` calls per side; returns the slower side's time per call (the same on every rank).

    The estimate is the median of single calls: one call held up by another
    process must not shrink the blocks to a single call.
    """
    estimates = []
    for call in calls.values():
        call()  # the first call may set up connections: untimed
        estimates.append(statistics.median(seconds_per_call(call, 1) for _ in range(max(1, warmup - 1))))
    return max(max_over_ranks(estimates, anchor))


def plan_cell(per_call_s: float, settings: Settings) -> tuple[int, int]:
    """(calls per block, rounds): blocks of about block_s, rounds capped by the cell budget."""
    calls = min(settings.max_calls, max(1, round(settings.block_s / per_call_s)))
    round_s = len(SIDES) * calls * per_call_s
    rounds = min(settings.max_rounds, max(settings.min_rounds, int(settings.cell_budget_s // round_s)))
    return calls, rounds


def timed_rounds(calls: dict[str, Callable[[], None]], per_block: int, rounds: int,
                 anchor: dist.ProcessGroup) -> dict[str, list[float]]:
    """Seconds per call of each side's block in each round, max over ranks."""
    names = list(calls)
    local: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()  # a collection inside a block would land on one side only
    try:
        for r in range(rounds):
            # Alternate which side goes first, so neither always follows the other's traffic.
            for name in (names if r % 2 == 0 else names[::-1]):
                dist.barrier(group=anchor)
                local[name].append(seconds_per_call(calls[name], per_block))
    finally:
        gc.enable()
    merged = max_over_ranks([t for name in names for t in local[name]], anchor)
    return {name: merged[i * rounds:(i + 1) * rounds] for i, name in enumerate(names)}


def measure_cell(collective: str, nbytes: int, device: torch.device, groups: dict[str, dist.ProcessGroup | None],
                 world: int, settings: Settings) -> dict[str, Any]:
    """Times one (collective, size) on every side; the samples are the same on every rank."""
    anchor = groups["gloo"]
    calls = {name: make_call(collective, nbytes, torch.device("cpu") if name == "gloo" else device, group, world)
             for name, group in groups.items()}
    per_call_s = warm_up(calls, settings.warmup, anchor)
    per_block, rounds = plan_cell(per_call_s, settings)
    samples = timed_rounds(calls, per_block, rounds, anchor)
    return {"collective": collective, "bytes": _elements(nbytes, world) * ELEMENT_BYTES,
            "calls_per_block": per_block, "rounds": rounds,
            "samples_us": {name: [s * 1e6 for s in ts] for name, ts in samples.items()}}


def run_rank(rank: int, world: int, port: int, settings: Settings) -> None:
    """A spawned rank: joins both groups, checks, times every cell; rank 0 reports."""
    started = time.perf_counter()
    dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=settings.group_timeout_s))
    anchor = dist.new_group(backend="gloo")
    os.environ["TORCH_TPU_DIST_TRANSPORT"] = "gloo"  # read when a group is made
    gloo_alone = dist.new_group(backend="tpu_dist")
    del os.environ["TORCH_TPU_DIST_TRANSPORT"]
    transports = [group_transport(), group_transport(gloo_alone)]
    if transports != ["shared_memory", "gloo"]:
        raise RuntimeError(f"tpu_dist groups on {transports}, expected shared_memory and gloo")
    groups = {"tpu_dist": None, "gloo": anchor, "tpu_dist_gloo": gloo_alone}  # None: the world, tpu_dist
    device = torch.device("tpu", torch.tpu.current_device())  # tpu:<LOCAL_RANK>, set by tpu_dist
    for name, group in groups.items():
        check_collectives(torch.device("cpu") if name == "gloo" else device, group, rank, world)
    cells = []
    for nbytes in settings.sizes:
        for collective in settings.collectives:
            cell = measure_cell(collective, nbytes, device, groups, world, settings)
            cells.append(cell)
            if rank == 0:
                print(progress_line(cell), flush=True)
    dist.barrier(group=anchor)
    if rank == 0:
        publish(cells, world, settings, time.perf_counter() - started)
    dist.destroy_process_group()


# ---------------------------------------------------------------- results (rank 0)


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def target_for(nbytes: int) -> Target | None:
    return next((t for t in TARGETS if t.covers(nbytes)), None)


def relative_iqr(samples: list[float]) -> float:
    """Interquartile range over the median: how far to trust a ratio (other load on the machine widens it)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)


def summarize_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """Medians, bandwidths, spread, ratio and target of one measured cell.

    The ratio is paired: the median over rounds of (tpu_dist's block / gloo's block of
    the same round). The rounds spread by 20-40% on this 2-core machine (gloo's threads
    and the ranks share the cores) and drift over a run, which moves a ratio of two
    medians by more than the 5% the target allows, either way from run to run; the two
    blocks of a round run back to back and share that drift. The ratio of the medians
    is kept beside it."""
    samples = cell["samples_us"]
    medians = {name: statistics.median(samples[name]) for name in SIDES}
    ratio = statistics.median(t / g for t, g in zip(samples["tpu_dist"], samples["gloo"]))
    target = target_for(cell["bytes"])
    row: dict[str, Any] = {"collective": cell["collective"], "bytes": cell["bytes"], "size": size_label(cell["bytes"])}
    for name in SIDES:
        row[f"{name}_us"] = medians[name]
        row[f"{name}_gbps"] = cell["bytes"] / (medians[name] * 1e-6) / 1e9
        row[f"{name}_iqr"] = relative_iqr(cell["samples_us"][name])
    gloo_alone = statistics.median(t / g for t, g in zip(samples["tpu_dist_gloo"], samples["gloo"]))
    row.update(ratio=ratio, median_ratio=medians["tpu_dist"] / medians["gloo"], gloo_alone_ratio=gloo_alone,
               target=target.max_ratio if target else None,
               met=None if target is None else ratio <= target.max_ratio,
               calls_per_block=cell["calls_per_block"], rounds=cell["rounds"], samples_us=cell["samples_us"])
    return row


def progress_line(cell: dict[str, Any]) -> str:
    row = summarize_cell(cell)
    return (f"{row['collective']:>17} {row['size']:>7}: tpu_dist {row['tpu_dist_us']:10.1f} us, "
            f"gloo {row['gloo_us']:10.1f} us, ratio {row['ratio']:.3f}; tpu_dist on gloo alone "
            f"{row['tpu_dist_gloo_us']:10.1f} us, ratio {row['gloo_alone_ratio']:.3f} "
            f"({row['rounds']} rounds x {row['calls_per_block']} calls)")


def _number(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def render_table(rows: list[dict[str, Any]]) -> str:
    columns = ["collective", "size", "tpu_dist µs", "gloo µs", "tpu_dist GB/s", "gloo GB/s", "ratio", "target", "met",
               "ratio of medians", "IQR/median", "on gloo alone µs", "on gloo alone ratio", "rounds x calls"]
    shown = [{
        "collective": r["collective"], "size": r["size"],
        "tpu_dist µs": _number(r["tpu_dist_us"]), "gloo µs": _number(r["gloo_us"]),
        "tpu_dist GB/s": _number(r["tpu_dist_gbps"]), "gloo GB/s": _number(r["gloo_gbps"]),
        "ratio": f"{r['ratio']:.3f}", "target": "-" if r["target"] is None else f"<= {r['target']:.2f}",
        "met": "-" if r["met"] is None else ("yes" if r["met"] else "NO"),
        "ratio of medians": f"{r['median_ratio']:.3f}",
        "IQR/median": f"{r['tpu_dist_iqr']:.0%} / {r['gloo_iqr']:.0%}",
        "on gloo alone µs": _number(r["tpu_dist_gloo_us"]), "on gloo alone ratio": f"{r['gloo_alone_ratio']:.3f}",
        "rounds x calls": f"{r['rounds']} x {r['calls_per_block']}",
    } for r in rows]
    return report.markdown_table(shown, columns)


def summaries(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target: cells met, and the worst ratio with where it was."""
    lines = []
    for target in TARGETS:
        covered = [r for r in rows if target.covers(r["bytes"])]
        if not covered:
            continue
        met = sum(r["ratio"] <= target.max_ratio for r in covered)
        worst = max(covered, key=lambda r: r["ratio"])
        verdict = "MET" if met == len(covered) else "NOT MET"
        lines.append(f"target {target.label}: ratio <= {target.max_ratio:.2f}: {verdict}, {met}/{len(covered)} "
                     f"cells (worst {worst['ratio']:.3f}, {worst['collective']} {worst['size']})")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Time per call against size, log-log: one panel per collective, both sides in each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed in the venv: skipping the plot")
        return None
    collectives = [c for c in COLLECTIVES if any(r["collective"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(collectives), figsize=(6 * len(collectives), 4.5), squeeze=False)
    for ax, collective in zip(axes[0], collectives):
        mine = sorted((r for r in rows if r["collective"] == collective), key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in mine]
        for name, style, label in (("tpu_dist", "o-", "tpu_dist (tpu tensors, shared memory)"),
                                   ("tpu_dist_gloo", "^:", "tpu_dist on gloo alone (tpu tensors)"),
                                   ("gloo", "s--", "gloo (cpu tensors)")):
            ax.plot(sizes, [r[f"{name}_us"] for r in mine], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([r["size"] for r in mine], rotation=45, fontsize=8)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("median µs per call")
        ax.set_title(collective)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def publish(cells: list[dict[str, Any]], world: int, settings: Settings, elapsed_s: float) -> None:
    """Prints the table and summaries; writes JSON, markdown and the plot."""
    rows = [summarize_cell(c) for c in cells]
    lines = summaries(rows)
    head = (f"world size {world} on 127.0.0.1; median µs per call over rounds (max over ranks); ratio: median "
            f"over rounds of tpu_dist / gloo in the same round (tpu_dist on shared memory; 'on gloo alone': "
            f"a tpu_dist group with TORCH_TPU_DIST_TRANSPORT=gloo, as across hosts); "
            f"GB/s = bytes per rank / time; IQR/median of the rounds, tpu_dist / gloo"
            + ("; --quick (a smoke run: too few rounds to judge the targets)" if settings.quick else ""))
    markdown = f"{head}\n\n{render_table(rows)}\n\n" + "\n".join(f"- {s}" for s in lines)
    markdown += f"\n\nwall time {elapsed_s:.0f} s (rank 0, from group init)"
    print()
    print(markdown)
    payload = {"world_size": world, "targets": [dataclasses.asdict(t) for t in TARGETS],
               "config": dataclasses.asdict(settings), "rows": rows, "summary": lines, "wall_time_s": elapsed_s}
    out = Path(settings.out_dir)
    json_path, md_path = report.write("collectives", payload, markdown, out_dir=out)
    png = plot(rows, out / "collectives.png")
    print(f"wrote {json_path}, {md_path}" + (f", {png}" if png else ""))


# ---------------------------------------------------------------- launcher


def start_ranks(world: int, settings: Settings) -> list[mp.Process]:
    return start_local_ranks(run_rank, world, (world, free_port(), settings))


def supervise(procs: list[mp.Process], timeout_s: float) -> int:
    """Waits for every rank; kills them all past the deadline or once one fails (the rest would block)."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                print(f"rank(s) failed (rank, exit code): {failed}; stopping the others", file=sys.stderr)
                return 1
            if all(p.exitcode == 0 for p in procs):
                return 0
            if time.monotonic() > deadline:
                print(f"ranks did not finish within {timeout_s:.0f} s; killed them", file=sys.stderr)
                return 1
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def parse_size(text: str) -> int:
    """'4K', '4KiB', '64M', '1048576' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def settings_from(args: argparse.Namespace) -> Settings:
    sizes = tuple(parse_size(s) for s in args.sizes.split(",")) if args.sizes else tuple(SIZES)
    return Settings(
        sizes=sizes, collectives=tuple(args.collectives.split(",")),
        warmup=args.warmup if args.warmup is not None else (4 if args.quick else 5),
        max_rounds=args.rounds if args.rounds is not None else (7 if args.quick else DEFAULT_ROUNDS),
        min_rounds=3 if args.quick else 9,
        block_s=(args.block_ms if args.block_ms is not None else (10.0 if args.quick else 50.0)) / 1e3,
        max_calls=1000,
        cell_budget_s=args.cell_budget if args.cell_budget is not None else (1.0 if args.quick else 10.0),
        group_timeout_s=60.0, out_dir=str(args.out), quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: every size, up to 7 short rounds")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (processes, one tpu device each)")
    parser.add_argument("--sizes", help="comma-separated bytes per rank, K/M suffixes allowed (default 4K..64M)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), help="comma-separated subset")
    parser.add_argument("--rounds", type=int, help=f"timed rounds per cell at most (default {DEFAULT_ROUNDS}; --quick 7)")
    parser.add_argument("--warmup", type=int, help="warm-up calls per side and cell, >= 2 (default 5; --quick 4)")
    parser.add_argument("--block-ms", type=float, help="work per timed block (default 50; --quick 10)")
    parser.add_argument("--cell-budget", type=float,
                        help="seconds of timed rounds per cell; large sizes get fewer rounds (default 10; --quick 1)")
    parser.add_argument("--timeout", type=float,
                        help="deadline for the whole run in seconds (default 600; --quick 120)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_DIR)
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    if (args.warmup is not None and args.warmup < 2) or (args.rounds is not None and args.rounds < 1):
        parser.error("--warmup must be at least 2 (the first call is not timed) and --rounds at least 1")
    unknown = set(args.collectives.split(",")) - set(COLLECTIVES)
    if unknown:
        parser.error(f"unknown collectives {sorted(unknown)}; choose from {', '.join(COLLECTIVES)}")
    settings = settings_from(args)
    timeout_s = args.timeout if args.timeout is not None else (120.0 if args.quick else 600.0)
    print(f"{args.world_size} ranks, {len(settings.sizes)} sizes x {len(settings.collectives)} collectives; "
          f"deadline {timeout_s:.0f} s", flush=True)
    return supervise(start_ranks(args.world_size, settings), timeout_s)


if __name__ == "__main__":
    sys.exit(main())
