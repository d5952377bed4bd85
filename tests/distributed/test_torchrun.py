"""init_process_group("tpu_dist") under torchrun (env:// rendezvous on 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torch_tpu.distributed.local_ranks import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_gives_each_local_rank_its_own_device():
    env = {**os.environ, "TORCH_TPU_NUM_DEVICES": "2", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(Path(__file__).with_name("torchrun_worker.py"))],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 of 2: tpu:0 ok" in out.stdout and "rank 1 of 2: tpu:1 ok" in out.stdout, out.stdout
