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
import importlib
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import torch

from prime.progress import Progress, format_count

__all__ = ["peak_flops", "human_bytes", "MetricsLogger", "TensorBoardSink", "WandbSink", "RunMetrics", "plot_losses",
           "read_records", "PEAK_TFLOPS_BF16", "TIME_ROWS"]

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


_SAFE_ID = "".join(chr(c) for c in range(128) if chr(c).isalnum()) + "-_."


def _sinks_note(msg: str) -> None:
    print(f"prime: {msg}", file=sys.stderr, flush=True)


def _optional_import(module: str, field: str, package: str, service: str):
    """The module, or None after one line saying that `field` is on but `package` is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        _sinks_note(f"{field} is on, but the {package} package is not installed (pip install {package}): "
                    f"not logging to {service}")
        return None


def _numbers(kind: str, values: dict) -> dict:
    """The numeric fields of a record as {kind/name: float} (bools as 0/1; None, text and lists left out)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool):
            out[f"{kind}/{k}"] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[f"{kind}/{k}"] = v
    return out


class TensorBoardSink:
    """Scalars of every record into out_dir/tb/<run id>/node<rank> (torch.utils.tensorboard; needs tensorboard).

    A fresh run hides older events of the same directory from TensorBoard, a resumed run those after its
    checkpoint (SummaryWriter's purge_step), so each node shows one continuous curve, as in the JSONL file."""

    def __init__(self, writer, log_dir: str):
        self.writer, self.log_dir = writer, log_dir

    @classmethod
    def open(cls, out_dir: str, run_id: str, node_rank: int, resume_step: Optional[int],
             config: Optional[dict]) -> Optional["TensorBoardSink"]:
        tb = _optional_import("torch.utils.tensorboard", "metrics.tensorboard", "tensorboard", "TensorBoard")
        if tb is None:
            return None
        SummaryWriter = tb.SummaryWriter
        log_dir = os.path.join(out_dir, "tb", run_id, f"node{node_rank}")
        try:
            writer = SummaryWriter(log_dir, purge_step=0 if resume_step is None else resume_step + 1, flush_secs=10)
            if config is not None:
                writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
        except Exception as e:  # noqa: BLE001 - a broken install (protobuf versions ...) must not stop training
            _sinks_note(f"TensorBoard could not start ({type(e).__name__}: {e}): not logging to it")
            return None
        return cls(writer, log_dir)

    def log(self, kind: str, step: int, values: dict) -> None:
        for tag, v in _numbers(kind, values).items():
            self.writer.add_scalar(tag, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Every record into a Weights & Biases run of its own per node (named node<rank>, grouped by run id).

    mode: online, offline (files under out_dir/wandb; `wandb sync` uploads them later; no network needed)
    or '' (the WANDB_MODE environment variable, else online). A resumed run continues the node's W&B run: its
    id is kept in out_dir/wandb/node<rank>.id."""

    def __init__(self, run, describe: str):
        self.run, self.describe = run, describe

    @classmethod
    def open(cls, out_dir: str, run_id: str, node_rank: int, project: str, mode: str, resume_step: Optional[int],
             config: Optional[dict]) -> Optional["WandbSink"]:
        wandb = _optional_import("wandb", "metrics.wandb", "wandb", "Weights & Biases")
        if wandb is None:
            return None
        mode = mode or os.environ.get("WANDB_MODE", "") or "online"
        id_dir = os.path.join(out_dir, "wandb")
        id_file = os.path.join(id_dir, f"node{node_rank}.id")
        run_key = None
        if resume_step is not None and os.path.exists(id_file):
            with open(id_file) as f:
                run_key = f.read().strip() or None
        if run_key is None:
            safe = "".join(c if c in _SAFE_ID else "-" for c in run_id)[:40]
            run_key = f"{safe}-node{node_rank}-{os.urandom(4).hex()}"
        try:
            os.makedirs(id_dir, exist_ok=True)
            run = wandb.init(project=project, group=run_id, name=f"node{node_rank}", job_type="node", id=run_key,
                             resume="allow", dir=out_dir, config=config or {}, mode=mode,
                             settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # noqa: BLE001 - no login, no network, a bad project name: train anyway
            _sinks_note(f"Weights & Biases could not start in {mode} mode ({type(e).__name__}: {e}): not logging to "
                        "it (metrics.wandb_mode = 'offline' needs no network or login)")
            return None
        with open(id_file, "w") as f:
            f.write(run_key + "\n")
        where = getattr(run, "dir", "") or out_dir
        describe = (f"Weights & Biases: offline run {run_key} under {os.path.dirname(where)} (upload later with "
                    f"`wandb sync {os.path.dirname(where)}`)" if mode == "offline"
                    else f"Weights & Biases: run {run_key} in project {project}, group {run_id}"
                    + (f" ({run.url})" if getattr(run, "url", None) else ""))
        return cls(run, describe)

    def log(self, kind: str, step: int, values: dict) -> None:
        nums = _numbers(kind, values)
        if kind == "summary":
            self.run.summary.update(nums)
        if nums:
            self.run.log(nums, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Prints and records the metrics of one node (only its local rank 0 writes): the JSONL file
    metrics_node<rank>.jsonl and, when asked for, TensorBoard and Weights & Biases."""

    def __init__(self, out_dir: str, node_rank: int, *, enabled: bool, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "prime", wandb_mode: str = "", run_id: str = "prime",
                 config: Optional[dict] = None, resume_step: Optional[int] = None, progress=None):
        self.node_rank, self.enabled = node_rank, enabled
        self.path = os.path.join(out_dir, f"metrics_node{node_rank}.jsonl")
        self.progress = progress
        self._file = None
        self.sinks: list = []
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
            sink = TensorBoardSink.open(out_dir, run_id, node_rank, resume_step, config)
            if sink is not None:
                self.sinks.append(sink)
                self.print(f"TensorBoard: {sink.log_dir} (tensorboard --logdir {os.path.join(out_dir, 'tb')})")
        if wandb:
            sink = WandbSink.open(out_dir, run_id, node_rank, wandb_project, wandb_mode, resume_step, config)
            if sink is not None:
                self.sinks.append(sink)
                self.print(sink.describe)

    def print(self, msg: str) -> None:
        if self.enabled:
            if self.progress is not None:
                self.progress.write(msg)
            else:
                print(msg, flush=True)

    def record(self, kind: str, step: int, **values) -> None:
        """Appends one JSON line {kind, step, ...} and hands the record to TensorBoard / W&B."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "node": self.node_rank, **values}
        self._file.write(json.dumps(rec) + "\n")
        for sink in list(self.sinks):
            try:
                sink.log(kind, step, values)
            except Exception as e:  # noqa: BLE001 - a tracking service failing must not stop training
                _sinks_note(f"{type(sink).__name__[:-4]} failed ({type(e).__name__}: {e}); no longer logging to it")
                self.sinks.remove(sink)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                _sinks_note(f"closing {type(sink).__name__[:-4]} failed ({type(e).__name__}: {e})")
        self.sinks = []


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


TIME_ROWS = (
    ("compute", "inner steps (forward, backward, optimizer)"),
    ("outer_local", "outer steps: pseudo-gradient, update, copies"),
    ("outer_wait", "outer steps: waiting for the average (wire, other nodes)"),
    ("checkpoint", "checkpoints (the part training waits for)"),
    ("start", "start: replica check or joining (other nodes)"),
    ("other", "other (data, logging)"),
)
"""The rows of the summary's wall-time table: (key, what it counts). 'outer_wait' is the part of an outer
step spent in the all-reduce (synchronous) or waiting for the previous average (overlap)."""


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


class RunMetrics:
    """The metrics of one training process: its log lines and records, and the accounting behind them.

    Accounts compute time (utilization), bytes sent against what data
    parallelism would have sent, and inner-step rates, and writes the step,
    outer and summary lines and records. Before open() (the checkpoint resume
    decides where the JSONL file continues) print() goes to stdout on the
    logging process and record() drops the record.

    local_sum(values) sums small values over the node's processes: a
    collective, so every process of the node calls inner_step(), outer_step()
    in the same order.
    """

    WARMUP_STEPS = 3
    """Inner steps left out of the medians: compilation, allocator warm-up and the first outer step's buffers."""

    def __init__(self, *, out_dir: str, node_rank: int, is_logger: bool, local_world: int, num_nodes: int,
                 total_steps: int, log_every: int, tokens_per_step: int, flops_per_token: float,
                 peak: Optional[float], local_sum: Callable[[list], list], codec: str, block_size: int,
                 inner_steps: int, model_numel: int, density: Optional[float] = None,
                 average_density: Optional[float] = None, step_weights: Optional[list] = None):
        self.out_dir, self.node_rank, self.is_logger = out_dir, node_rank, is_logger
        self.step_weights = step_weights
        """Nodes of different process counts (prime.shares): what an inner step of each node counts in a
        token-weighted average (None: 1 each)."""
        self.local_world, self.num_nodes, self.total_steps, self.log_every = local_world, num_nodes, total_steps, log_every
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.local_sum = local_sum
        from prime.codecs import CODECS, DENSE_START

        self.wire_bytes_per_value = CODECS[codec].bytes_per_value(block_size, density)
        if average_density is not None:  # topk: the owners send the average at their own density
            self.wire_bytes_per_value = (self.wire_bytes_per_value
                                         + CODECS[codec].bytes_per_value(block_size, average_density)) / 2
        self.inner_steps, self.model_numel = inner_steps, model_numel
        self.dense_bytes_per_value = CODECS[DENSE_START[0]].bytes_per_value(DENSE_START[1])
        """Wire bytes per value of a sparse codec's dense start (int8)."""
        self.codec = codec if CODECS[codec].lossy else "codec"  # names the compression error in the outer step's line
        self.log: Optional[MetricsLogger] = None
        self.reset()

    def open(self, *, tensorboard: bool = False, wandb: bool = False, wandb_project: str = "prime",
             wandb_mode: str = "", run_id: str = "prime", progress: str = "auto", config: Optional[dict] = None,
             resume_step: Optional[int] = None) -> None:
        """Opens the JSONL file, TensorBoard and W&B when asked, and the progress bar (progress: auto, a bar
        on a terminal; bar; lines); a resumed run keeps its curve up to resume_step."""
        bar = None
        if self.is_logger and progress != "lines":
            bar = Progress(self.total_steps, label="step", start=resume_step or 0, every_s=0,
                           interactive=True if progress == "bar" else None)
            if not bar.interactive:
                bar = None  # not a terminal: the step and outer lines are the progress
        self.log = MetricsLogger(self.out_dir, self.node_rank, enabled=self.is_logger, tensorboard=tensorboard,
                                 wandb=wandb, wandb_project=wandb_project, wandb_mode=wandb_mode, run_id=run_id,
                                 config=config, resume_step=resume_step, progress=bar)

    @property
    def progress(self) -> Optional[Progress]:
        """The bar on a terminal (None: plain lines)."""
        return self.log.progress if self.log is not None else None

    def outer_running(self, outer_step: int) -> None:
        """Says on the bar that outer step `outer_step` runs (the bar shows it until the next inner step)."""
        if self.progress is not None:
            self.progress.status(f"outer step {outer_step}: averaging across nodes ...")

    def spend(self, what: str, seconds: float) -> None:
        """Counts wall time spent outside the inner steps: 'outer', 'outer_wait' (part of 'outer'),
        'checkpoint' or 'start' (see TIME_ROWS)."""
        self.spent[what] = self.spent.get(what, 0.0) + seconds

    def print(self, msg: str) -> None:
        """Prints on the node's logging process."""
        if self.log is not None:
            self.log.print(msg)
        elif self.is_logger:
            print(msg, flush=True)

    def record(self, kind: str, step: int, **values) -> None:
        """One JSONL record (dropped before open())."""
        if self.log is not None:
            self.log.record(kind, step, **values)

    def reset(self) -> None:
        """Starts the accounting of a run."""
        self.losses: list[tuple[int, float]] = []
        self.step_s: list[float] = []  # inner-step times, for the summary's medians
        self.total_sent = self.total_dp = self.compute_s = self.phase_compute = 0.0
        self.sent_measured = True
        self.phase_t0 = time.perf_counter()
        self.spent: dict[str, float] = {}

    def compute(self, step_s: float) -> None:
        """Counts `step_s` seconds of inner-step compute."""
        self.compute_s += step_s
        self.phase_compute += step_s

    def forget_phase(self) -> None:
        """The compute since the last outer step does not count (this node just took the job's position)."""
        self.phase_compute = 0.0

    def _mfu(self, tok_s: float) -> Optional[float]:
        return self.flops_per_token * tok_s / (self.peak * self.local_world) if self.peak else None

    def inner_step(self, step: int, loss: float, gnorm: float, lr: float, step_s: float, show: bool,
                   trained: Optional[int] = None) -> float:
        """Records inner step `step` in the JSONL file; prints its line when `show`. Returns the node's mean loss.
        trained: the inner steps this node trained so far, when it differs from `step` (time phases, where `step`
        is the schedule's nominal step)."""
        loss = self.local_sum([loss])[0] / self.local_world
        tok_s = self.tokens_per_step / step_s
        mfu = self._mfu(tok_s)
        self.losses.append((step, loss))
        self.step_s.append(step_s)
        mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        if self.progress is not None:  # before the line: the bar drawn under it shows this step
            fields = {}
            if self.num_nodes > 1:
                h = self.inner_steps
                k = (step - 1) % h + 1
                fill = round(10 * k / h)
                fields["phase"] = f"outer {(step - 1) // h + 1} [{'#' * fill}{'.' * (10 - fill)}] {k}/{h}"
            self.progress.update(step, loss=f"loss {loss:.4f}", rate=f"{format_count(tok_s)} tok/s", **fields)
        if show:
            self.print(
                f"step {step:>6}/{self.total_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {gnorm:.3f} | "
                f"{tok_s / 1e3:.1f}k tok/s | MFU {mfu_s} | {step_s * 1e3:.0f} ms"
            )
        self.record("step", step, loss=loss, lr=lr, grad_norm=gnorm, tokens_per_s=tok_s, mfu=mfu,
                    step_s=step_s, tokens=(step if trained is None else trained) * self.tokens_per_step)
        return loss

    def outer_step(self, step: int, r, note: str = "", fields: Optional[dict] = None) -> None:
        """Logs outer step `r` (a prime.diloco.OuterStepResult) at inner step `step`: all-reduce time and bytes
        (summed over the node's processes), error, utilization; `note` ends the line, `fields` join the record."""
        n = len(r.members) or self.num_nodes
        dense = getattr(r, "dense", False)  # a sparse codec's dense start: this average went as int8
        measured = r.bytes_sent is not None
        if measured:
            sent = float(r.bytes_sent)
        else:  # estimate a ring all-reduce of the wire format: 2 (N-1)/N of the encoded buffer
            per_value = self.dense_bytes_per_value if dense else self.wire_bytes_per_value
            sent = 2 * (n - 1) / n * r.numel * per_value
        measured = self.local_sum([1.0 if measured else 0.0])[0] == self.local_world
        sent, ar_s = self.local_sum([sent, r.allreduce_s])
        ar_s /= self.local_world
        err = r.compression_error
        # what data parallelism among this outer step's nodes would have sent over the same inner steps
        dp = 2 * (n - 1) / n * 4 * self.model_numel * self.inner_steps * getattr(r, "share", 1.0)  # (its fragment)
        self.total_sent += sent
        self.sent_measured &= measured
        self.total_dp += dp
        now = time.perf_counter()
        wall = now - self.phase_t0
        compute = self.phase_compute
        util = compute / wall if wall > 0 else float("nan")
        self.phase_t0, self.phase_compute = now, 0.0
        err_s = f"{100 * err:.2f}%" if err is not None else "n/a"
        if dense:
            fields = dict(fields or {}, dense=True)
            note = " | dense start (int8)" + note
        w = getattr(r, "weights", None)  # a token-weighted average: each node's inner steps and share
        if w is not None:
            steps, tokens = list(w.counts), [c * self.tokens_per_step for c in w.counts]
            if self.step_weights:  # counts in units of the fewest processes' step: tokens per unit, steps per node
                members = r.members if len(r.members) == len(w.counts) else range(len(w.counts))
                steps = [c // self.step_weights[m] for c, m in zip(w.counts, members)]
                tokens = [c * (self.tokens_per_step // self.step_weights[self.node_rank]) for c in w.counts]
            fields = dict(fields or {}, node_steps=steps, node_tokens=tokens, node_weights=w.weights)
            note = (f" | weights {'/'.join(f'{x:.2f}' for x in w.weights)} (inner steps "
                    f"{'/'.join(str(c) for c in steps)})") + note
        self.print(
            f"outer {r.outer_step} (step {step}) | all-reduce {ar_s:.2f} s, outer step {r.outer_s:.2f} s | "
            f"sent {human_bytes(sent)}{'' if measured else ' (est.)'} vs {human_bytes(dp)} for data parallel | "
            f"{self.codec} error {err_s} | pseudo-grad norm {r.pseudo_grad_norm:.3f} | utilization {100 * util:.1f}%"
            + (f" | {r.attempts} attempts" if r.attempts > 1 else "") + note
        )
        self.record("outer", step, outer_step=r.outer_step, allreduce_s=ar_s, outer_s=r.outer_s, phase_s=wall,
                    phase_compute_s=compute, fragment=getattr(r, "fragment", 0),
                    prepare_s=getattr(r, "prepare_s", None), update_s=getattr(r, "update_s", None),
                    bytes_sent=sent, bytes_measured=measured, dp_bytes=dp, compression_error=err,
                    pseudo_grad_norm=r.pseudo_grad_norm, utilization=util, attempts=r.attempts, **(fields or {}),
                    **r.ring_stats)

    def median_rates(self) -> Optional[tuple[float, Optional[float]]]:
        """(tokens/s per node, MFU) at the median inner-step time, warm-up steps excluded; None if too few steps."""
        times = sorted(self.step_s[self.WARMUP_STEPS:])
        if not times:
            return None
        tok_s = self.tokens_per_step / times[len(times) // 2]
        return tok_s, self._mfu(tok_s)

    def summary(self, step: int, wall: float, outer_steps: int, multi_node: bool) -> dict:
        """Records and prints the run's summary (bytes against data parallel when `multi_node`); returns it."""
        k = max(1, min(10, len(self.losses) // 5))
        first_step, first = self.losses[0] if self.losses else (0, float("nan"))
        last = mean(l for _, l in self.losses[-k:])
        util = self.compute_s / wall if wall > 0 else float("nan")
        s = {"node": self.node_rank, "steps": step, "first_step": first_step, "first_loss": first,
             "last_loss": last, "bytes_sent": self.total_sent, "bytes_measured": self.sent_measured,
             "dp_bytes": self.total_dp, "utilization": util, "wall_s": wall, "outer_steps": outer_steps}
        rate = self.median_rates()
        if rate:
            s["median_tokens_per_s"], s["median_mfu"] = rate
        split = self.time_split(wall)
        s.update({f"time_{key}_s": v for key, v in split.items()})
        self.record("summary", step, **{k2: v for k2, v in s.items() if k2 != "node"})
        if self.progress is not None:
            self.progress.close()  # the summary comes after the last state of the bar
        if self.is_logger:
            lines = [f"summary (node {self.node_rank}): {step} steps in {wall:.1f} s, "
                     f"loss {first:.3f} at step {first_step} -> {last:.3f} (mean of the last {k} steps)"]
            if multi_node:
                ratio = self.total_dp / self.total_sent if self.total_sent else float("nan")
                lines.append(
                    f"  {outer_steps} outer steps sent {human_bytes(self.total_sent)}"
                    f"{'' if self.sent_measured else ' (estimated)'}; data parallel would have sent "
                    f"{human_bytes(self.total_dp)} ({ratio:.0f}x more)"
                )
            lines.append(f"  compute utilization {100 * util:.1f}% (inner-step time / wall time)")
            if rate:
                tok_s, mfu = rate
                lines.append(f"  median inner step (first {self.WARMUP_STEPS} excluded): {tok_s / 1e3:.1f}k tok/s "
                             "per node" + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ""))
            lines.append("  where the wall time went:")
            width = max(len(what) for _, what in TIME_ROWS)
            for key, what in TIME_ROWS:
                pct = 100 * split[key] / wall if wall > 0 else float("nan")
                lines.append(f"    {what:<{width}} {split[key]:9.1f} s {pct:5.1f}%")
            self.print("\n".join(lines))
        return s

    def time_split(self, wall: float) -> dict:
        """Seconds of `wall` per TIME_ROWS key; 'other' is what the rest leaves (never below 0)."""
        outer, wait = self.spent.get("outer", 0.0), self.spent.get("outer_wait", 0.0)
        split = {"compute": self.compute_s, "outer_local": max(0.0, outer - wait), "outer_wait": wait,
                 "checkpoint": self.spent.get("checkpoint", 0.0), "start": self.spent.get("start", 0.0)}
        split["other"] = max(0.0, wall - sum(split.values()))
        return split

    def close(self, plot: bool = False) -> None:
        """Closes the file (if opened); with `plot`, node 0's logging process writes out_dir/loss.png."""
        if self.log is None:
            return
        self.log.close()
        if plot and self.is_logger and self.node_rank == 0:
            path = plot_losses(self.out_dir, os.path.join(self.out_dir, "loss.png"))
            if path:
                print(f"loss plot: {path}", flush=True)
