"""What a user sees: one line per step, one per outer step, a JSONL file, a summary and a loss plot.

Definitions used in the lines and the JSONL records:

  tok/s        tokens processed by this node's processes per second of the step
  MFU          model FLOPs per second / (peak bf16 FLOPs per device x devices),
               model FLOPs = ModelArgs.flops_per_token(seq_len) x tokens
  compression  relative L2 error of the int8 round trip of the local
               pseudo-gradient d: ||dequantize(quantize(d)) - d|| / ||d||
               (the error a single hop of the ring adds; see prime/diloco.py)
  utilization  compute time / wall time: time spent in inner steps divided by
               the wall time between two outer steps, outer step included
  DP bytes     what plain data parallelism would have sent for the same steps:
               a ring all-reduce of the fp32 gradient every inner step,
               2 (N-1)/N x 4 bytes per value and process
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from typing import Optional

import torch

__all__ = ["peak_flops", "human_bytes", "MetricsLogger", "plot_losses", "PEAK_TFLOPS_BF16"]

# Dense bf16 peak TFLOP/s per device, from the vendors' data sheets (no sparsity).
PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100 SXM": 989.0,  # also H100 HBM3 boards
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "A100": 312.0,
}


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> Optional[float]:
    """Peak FLOP/s of one device: the override when > 0, the table for known GPUs, None otherwise (CPU)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H200" in name:
        return PEAK_TFLOPS_BF16["H200"] * 1e12
    if "H100" in name:
        if "PCIe" in name:
            return PEAK_TFLOPS_BF16["H100 PCIe"] * 1e12
        if "NVL" in name:
            return PEAK_TFLOPS_BF16["H100 NVL"] * 1e12
        return PEAK_TFLOPS_BF16["H100 SXM"] * 1e12
    if "A100" in name:
        return PEAK_TFLOPS_BF16["A100"] * 1e12
    return None


def human_bytes(n: Optional[float]) -> str:
    """1536 -> '1.5 KiB'."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class MetricsLogger:
    """Prints and records the metrics of one node (only its local rank 0 writes)."""

    def __init__(self, out_dir: str, node_rank: int, *, enabled: bool, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "prime", config: Optional[dict] = None, resume_step: Optional[int] = None):
        self.node_rank, self.enabled = node_rank, enabled
        self.path = os.path.join(out_dir, f"metrics_node{node_rank}.jsonl")
        self._file = self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            # A resumed run keeps the records up to its checkpoint, so the file holds one continuous curve.
            kept = [r for r in read_records(self.path) if r["step"] <= resume_step and r["kind"] != "summary"]
        self._file = open(self.path, "w", buffering=1)
        for r in kept:
            self._file.write(json.dumps(r) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(out_dir, "tb", f"node{node_rank}"))
            except ImportError:
                self.print("tensorboard is not installed (pip install tensorboard): not logging to it")
        if wandb:
            try:
                import wandb as _wandb

                self._wandb = _wandb.init(project=wandb_project, name=f"node{node_rank}", config=config or {})
            except ImportError:
                self.print("wandb is not installed (pip install wandb): not logging to it")

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def record(self, kind: str, step: int, **values) -> None:
        """Appends one JSON line {kind, step, ...} and forwards numbers to TensorBoard / W&B."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "node": self.node_rank, **values}
        self._file.write(json.dumps(rec) + "\n")
        nums = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in nums.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(nums, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_records(path: str) -> list[dict]:
    """The records of a metrics JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(out_dir: str, png_path: str) -> Optional[str]:
    """Plots the loss of every node (metrics_node*.jsonl in out_dir) with the outer steps marked.

    Returns the path written, or None with a note on stderr when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("prime: matplotlib is not installed (pip install matplotlib): no loss plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    outer_steps = set()
    for path in sorted(glob.glob(os.path.join(out_dir, "metrics_node*.jsonl"))):
        recs = read_records(path)
        steps = [r["step"] for r in recs if r["kind"] == "step"]
        losses = [r["loss"] for r in recs if r["kind"] == "step"]
        if steps:
            node = recs[0].get("node", "?")
            ax.plot(steps, losses, lw=1.2, label=f"node {node}")
        outer_steps |= {r["step"] for r in recs if r["kind"] == "outer"}
    for i, s in enumerate(sorted(outer_steps)):
        ax.axvline(s, color="grey", lw=0.6, ls=":", label="outer step" if i == 0 else None)
    ax.set_xlabel("inner step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("DiLoCo training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")
