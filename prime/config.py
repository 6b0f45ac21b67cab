"""Run configuration: one dataclass per component, loaded from TOML, overridable from the command line.

    prime-train --config configs/demo.toml --diloco.inner_steps 50 --optim.lr=1e-3

Every field is documented right under it (the docstring after a field is what
`prime-train --help-config` prints). Precedence, lowest first: dataclass
default, TOML file, environment (only the [nodes] section: PRIME_NODE_RANK,
PRIME_NUM_NODES, PRIME_STORE_ADDR), command line. `Config.validate()` raises
ValueError naming the field and the bad value.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from prime.ops import check_block_size, default_block_size
from prime.shares import parse_procs

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml
    except ModuleNotFoundError:
        _toml = None

__all__ = [
    "Config",
    "ModelConfig",
    "OptimConfig",
    "DiLoCoConfig",
    "TrainConfig",
    "DataConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "MemoryConfig",
    "NodesConfig",
    "ElasticConfig",
    "load_config",
    "parse_cli",
    "describe",
]


def _require(cond: bool, name: str, rule: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _require_range(value: float, name: str, lo: float, hi: float, unit: str = "", why: str = "") -> None:
    """lo <= value <= hi (both ends included); the message names the field, the bounds and why they are there."""
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}]{unit}, got {value!r}{'; ' + why if why else ''}")


def _require_rate(mbit: float, name: str) -> None:
    if mbit != 0:
        _require_range(mbit, name, _MIN_RATE_MBIT, _MAX_RATE_MBIT, " Mbit/s (or 0: unlimited)")


# Every wait the job makes (ring, store, heartbeats) is at most a day, so that the
# sums the trainer builds from them (the process group timeout) stay far from any
# overflow, and at least a second (below that a loaded machine misses it).
_MIN_TIMEOUT_S, _MAX_TIMEOUT_S = 1.0, 86400.0
# The ring's send-rate cap in Mbit/s: 0 (unlimited), else at least 0.1 Mbit/s (a
# 64 KiB frame every 5 s) and at most 1 Tbit/s.
_MIN_RATE_MBIT, _MAX_RATE_MBIT = 0.1, 1e6
_INT64_MAX = 2**63 - 1
# A stop (SIGTERM, ...) waits at most an hour: enough for the largest checkpoint write to finish.
_MAX_STOP_GRACE_S = 3600.0


def _check_numbers(section: Any, section_name: str) -> None:
    """Every float field of a section is finite and every int field fits an int64, naming the field.

    Runs before the section's own rules, so that inf or nan never reaches a
    comparison (nan fails every one, inf passes every lower bound)."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        name = f"{section_name}.{f.name}"
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        if isinstance(v, int) and not isinstance(v, bool) and not -_INT64_MAX - 1 <= v <= _INT64_MAX:
            raise ValueError(f"{name} must fit a 64-bit integer, got {v!r}")


def model_layers(args) -> list:
    """The layers diloco.fragments cuts the trainer's model (prime.model.Transformer of `args`) into, as
    prime.fragments.layer_units groups its parameters: the embedding, one per block, the final norm and the output
    projection unless it is tied to the embedding. Counted from the shape: building the model, even on the meta
    device, imports torch's compiler (about a second for every config parsed); tests/test_config.py holds this
    list to the real model's."""
    out = [] if args.tie_embeddings else ["output"]
    return ["tok_embeddings"] + [f"layers.{i}" for i in range(args.n_layers)] + ["norm"] + out


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Preset shape: tiny, 150M, 1B or 10B (see prime/model.py). The fields below replace preset values when set."""
    dim: Optional[int] = None
    """Hidden size (None: the preset's)."""
    n_layers: Optional[int] = None
    """Number of transformer blocks (None: the preset's)."""
    n_heads: Optional[int] = None
    """Attention heads (None: the preset's)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (None: the preset's)."""
    ffn_dim: Optional[int] = None
    """SwiGLU hidden size (None: the preset's)."""
    vocab_size: Optional[int] = None
    """Vocabulary size (None: the tokenizer's when data.path has prime-tokenize's meta.json, else the preset's;
    byte-level data needs >= 256)."""
    max_seq_len: Optional[int] = None
    """Longest sequence (None: the preset's)."""
    rope_theta: Optional[float] = None
    """Rotary base (None: the preset's)."""
    tie_embeddings: Optional[bool] = None
    """Share input and output embeddings (None: the preset's)."""

    def validate(self) -> None:
        from prime.model import PRESETS

        _require(self.name in PRESETS, "model.name", f"one of {sorted(PRESETS)}", self.name)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            v = getattr(self, name)
            _require(v is None or v >= 1, f"model.{name}", ">= 1 (or unset)", v)
        self.args().validate()

    def args(self):
        """The ModelArgs this section describes."""
        from prime.model import preset

        overrides = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
        return preset(self.name, **overrides)


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate of the inner AdamW."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr over this many inner steps."""
    decay_steps: int = 0
    """Warmup-stable-decay: the last decay_steps steps decay linearly to min_lr_ratio * lr (0: no decay)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr at the end of the decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""

    def validate(self) -> None:
        _require(self.lr > 0, "optim.lr", "> 0", self.lr)
        _require(self.lr <= 1, "optim.lr", "<= 1 (AdamW moves every weight by about lr per step)", self.lr)
        _require(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        _require(self.weight_decay * self.lr < 1, "optim.weight_decay", f"< 1 / optim.lr ({1 / self.lr:g}): each "
                 "step multiplies the weights by 1 - lr * weight_decay", self.weight_decay)
        _require(0 <= self.beta1 < 1, "optim.beta1", "in [0, 1)", self.beta1)
        _require(0 <= self.beta2 < 1, "optim.beta2", "in [0, 1)", self.beta2)
        _require(self.eps > 0, "optim.eps", "> 0", self.eps)
        _require(self.eps <= 1e-2, "optim.eps", "<= 0.01 (a larger eps swamps the gradient statistics: "
                 "AdamW stops adapting and barely trains)", self.eps)
        _require(self.warmup_steps >= 0, "optim.warmup_steps", ">= 0", self.warmup_steps)
        _require(self.decay_steps >= 0, "optim.decay_steps", ">= 0", self.decay_steps)
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        _require(self.grad_clip >= 0, "optim.grad_clip", ">= 0 (0 disables clipping)", self.grad_clip)


@dataclass
class DiLoCoConfig:
    inner_steps: int = 100
    """H: inner optimizer steps between two outer steps (INTELLECT-1 used 100)."""
    outer_lr: Optional[float] = None
    """Learning rate of the outer SGD. Unset (none): the codec's, 0.7 (INTELLECT-1's), for topk 3 (docs/codec.md, "The
    sparse codec")."""
    outer_momentum: Optional[float] = None
    """Momentum of the outer SGD. Unset (none): the codec's, 0.9, for topk 0 (its error feedback is the memory)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (False: heavy ball)."""
    codec: str = "int8"
    """Wire codec of the pseudo-gradient all-reduce: int8 (about 3.9x fewer bytes), fp4 (about 7.8x), topk (sparse: the
    largest values of every chunk at 2 bits with their positions, about 180x at the default density;
    docs/wire-format-sparse.md) or none (exact fp32)."""
    block_size: Optional[int] = None
    """Codec block (int8, fp4): one scale per block_size values; topk: values per chunk (power of two, 32..4096). Unset
    (none): the codec's default, 64 for int8 (1-byte scales), 256 for fp4 (fp32 scales), 4096 for topk."""
    density: Optional[float] = None
    """topk: the share of each chunk's values sent per outer step, in (0, 1] (k = density x block_size, at least 1).
    Unset (none): 48/4096. Error feedback is always on with topk: what a round leaves out is sent in later rounds."""
    average_density: Optional[float] = None
    """topk: the share of each chunk of the average that its owner sends back, in (0, 1]. Unset (none): 96/4096 when
    diloco.density is unset too (with 48/4096: 0.0222 bytes a value, 1/45 of int8's), else diloco.density. The sum of N
    nodes' selections holds up to N x density of a chunk; a higher average density drops less of it (docs/codec.md, "The
    sparse codec"), for (density + average_density) / 2 of the bytes per value of density alone."""
    feedback_decay: Optional[float] = None
    """Error feedback: the share of the residual added to the next pseudo-gradient, in (0, 1] (1: all of it). Below 1
    old residual fades geometrically, as SparseLoCo's accumulator; needs error feedback on. Unset (none): 1, for topk
    0.8."""
    dense_outer_steps: int = 0
    """topk: each fragment's first dense_outer_steps outer steps send the pseudo-gradient dense, as int8, and apply the
    average as it is (outer lr 1, no momentum), before the sparse codec takes over: early pseudo-gradients are large and
    dense, and a sparse round there undoes most of each node's progress. Costs int8's bytes for those outer steps;
    measured to help on short runs at H = 5, not at H = 10 (docs/codec.md, "Dense start"). 0: none. Above 0 only with
    topk."""
    error_feedback: Optional[bool] = None
    """Error feedback: each node keeps what its contribution to the all-reduce lost to the codec (a residual of the
    outer state's size, per node, saved in its checkpoints) and adds it to its next pseudo-gradient (docs/training.md,
    "Error feedback"). Unset (none): on for codec fp4, off for int8; true with codec none is refused. An elastic joiner
    starts from a zero residual."""
    retries: int = 2
    """How many times a failed all-reduce is retried, each on a freshly built ring, before the job stops."""
    timeout_s: float = 300.0
    """Ring timeout in seconds for any single wait (connect, send, receive)."""
    streams: int = 0
    """Parallel TCP streams per ring link (0: the ring's default)."""
    max_rate_mbit: float = 0.0
    """Cap the ring's send rate per link in Mbit/s, to emulate slow links (0: unlimited)."""
    compression_error: bool = True
    """Measure the int8 round-trip error of the local pseudo-gradient at each outer step (costs one
    quantize+dequantize)."""
    check_replicas: bool = True
    """At start and after a resume, check through the ring that all nodes hold identical outer weights and settings; at
    the end, that their final weights are bit-identical."""
    overlap: bool = False
    """Run each outer step's all-reduce in the background during the next inner steps and apply it at the next outer
    step (docs/training.md, "Overlapping the all-reduce")."""
    overlap_scheme: str = "eager-merge"
    """With overlap: eager-merge (default: eager, but when the average arrives the local weights keep half of their
    start's offset from the outer weights, Streaming DiLoCo's merge: the smallest loss cost at high overlap_steps,
    docs/training.md), eager (the next inner steps start from the outer update the local pseudo-gradient gives),
    eager-adaptive (from the one it gives shrunk by ||average||^2 / ||local||^2 of the previous outer step, within
    [1/nodes, 1]) or delayed (from the outer weights without the step in flight)."""
    overlap_steps: int = 0
    """With overlap: apply the average in flight after this many inner steps of the next outer step, shifting the local
    weights by what their start missed (0: inner_steps, the whole phase); fewer cost less loss, enough to hide the
    all-reduce is enough. Below inner_steps it needs an eager overlap_scheme."""
    fragments: int = 1
    """Streaming fragments: cut the model into this many fragments of whole layers with balanced bytes, each with its
    own outer step at its own offset in the phase (fragment p at inner steps (p + 1) inner_steps / fragments + k
    inner_steps), so that one fragment's all-reduce is in flight at a time with 1/fragments of the bytes, and with
    overlap its buffers are 1/fragments of the model (docs/training.md, "Streaming fragments"). With overlap,
    overlap_steps is at most inner_steps / fragments (0: that). At the end of training every fragment syncs once more,
    so that every node ends with the same weights. At most inner_steps and the model's layers (its blocks, the
    embedding, the final norm and an untied output)."""
    phase: str = "steps"
    """What ends a node's phase between two outer steps: steps (each node runs inner_steps inner steps; nodes of
    different speeds wait for the slowest) or time (each node runs inner steps for phase_seconds, so a faster node runs
    more of them; the outer step weights each node's pseudo-gradient by the tokens it trained; docs/heterogeneous.md).
    """
    phase_seconds: float = 0.0
    """With phase = time: the seconds of compute in a phase (inner_steps nominal steps of phase_seconds / inner_steps
    each: the schedule of fragments, overlap, the learning rate, checkpoints and train.steps runs on them). Required
    with phase = time."""
    outer_state_device: str = "auto"
    """Where the outer weights and momentum live: cpu (pinned memory), gpu (the parameters' GPU) or auto (gpu when they
    fit in the GPU memory free when DiLoCo is built, less the gradients and inner optimizer state still to come and a
    margin of max(8 GiB, 15% of the card) for activations; prime.outer.resolve_device, logged)."""

    def resolved_block_size(self) -> int:
        """block_size, or the codec's default when it is unset."""
        return default_block_size(self.codec) if self.block_size is None else self.block_size

    def outer_settings(self) -> dict:
        """outer_lr, outer_momentum, feedback_decay, density and average_density, each unset one the codec's
        default (prime.codecs; density and average_density None for a codec that is not sparse)."""
        from prime.codecs import codec

        return codec(self.codec, "diloco.codec").outer_settings(self.outer_lr, self.outer_momentum,
                                                                self.feedback_decay, self.density,
                                                                self.average_density)

    def validate(self) -> None:
        _require(self.inner_steps >= 1, "diloco.inner_steps", ">= 1", self.inner_steps)
        from prime.overlap import SCHEMES

        _require(self.overlap_scheme in SCHEMES, "diloco.overlap_scheme",
                 " or ".join(repr(name) for name in SCHEMES), self.overlap_scheme)
        eager = SCHEMES[self.overlap_scheme].eager
        _require(1 <= self.fragments <= self.inner_steps, "diloco.fragments",
                 f"in [1, diloco.inner_steps = {self.inner_steps}]", self.fragments)
        _require_range(self.fragments, "diloco.fragments", 1, 1024)
        _require(0 <= self.overlap_steps <= self.inner_steps, "diloco.overlap_steps",
                 f"in [0, diloco.inner_steps = {self.inner_steps}] (0: inner_steps)", self.overlap_steps)
        if self.fragments > 1:
            from prime.fragments import FragmentSchedule

            spacing = FragmentSchedule(self.inner_steps, self.fragments).spacing()
            _require(self.overlap_steps <= spacing, "diloco.overlap_steps",
                     f"<= {spacing} with diloco.fragments = {self.fragments} (inner_steps / fragments: the spacing of "
                     "the fragments' syncs, so that one average is in flight at a time; 0: that)", self.overlap_steps)
        _require(not (0 < self.overlap_steps < self.inner_steps and not eager),
                 "diloco.overlap_steps", f"0 or diloco.inner_steps with overlap_scheme = {self.overlap_scheme!r}",
                 self.overlap_steps)
        if self.overlap and not eager and self.fragments > 1:
            # delayed starts from the outer weights without the average in flight, so that average can only land
            # at a boundary (overlap_steps = inner_steps); fragments land theirs within inner_steps / fragments.
            raise ValueError(f"diloco.overlap_scheme = {self.overlap_scheme!r} needs diloco.overlap_steps = "
                             f"inner_steps, which diloco.fragments = {self.fragments} cannot have (at most "
                             "inner_steps / fragments): use an eager overlap_scheme with fragments")
        _require(self.phase in ("steps", "time"), "diloco.phase", "'steps' or 'time'", self.phase)
        if self.phase == "time":
            _require(self.phase_seconds > 0, "diloco.phase_seconds", "> 0 with diloco.phase = 'time'",
                     self.phase_seconds)
            _require_range(self.phase_seconds, "diloco.phase_seconds", 0.01, 86400, " seconds")
        else:
            _require(self.phase_seconds == 0, "diloco.phase_seconds", "0 (unset) unless diloco.phase = 'time'",
                     self.phase_seconds)
        _require(self.outer_state_device in ("cpu", "gpu", "auto"), "diloco.outer_state_device",
                 "'cpu', 'gpu' or 'auto'", self.outer_state_device)
        from prime.codecs import CODECS, names

        _require(self.codec in CODECS, "diloco.codec", names(), self.codec)
        outer = self.outer_settings()
        _require(outer["outer_lr"] > 0, "diloco.outer_lr", "> 0", outer["outer_lr"])
        _require(outer["outer_lr"] <= 10, "diloco.outer_lr",
                 "<= 10 (0.7 is usual; 1 with no momentum is plain averaging)", outer["outer_lr"])
        _require(0 <= outer["outer_momentum"] < 1, "diloco.outer_momentum", "in [0, 1)", outer["outer_momentum"])
        from prime.feedback import check_feedback_decay, resolve_error_feedback

        feedback = resolve_error_feedback(self.error_feedback, self.codec, "diloco.error_feedback")
        check_feedback_decay(outer["feedback_decay"], feedback, "diloco.feedback_decay")
        if self.block_size is not None:
            check_block_size(self.block_size, "diloco.block_size")
        _require(self.dense_outer_steps >= 0, "diloco.dense_outer_steps", ">= 0", self.dense_outer_steps)
        _require(self.dense_outer_steps == 0 or self.codec == "topk", "diloco.dense_outer_steps",
                 "0 unless diloco.codec = 'topk' (the other codecs are dense already)", self.dense_outer_steps)
        for name, value in (("diloco.density", self.density), ("diloco.average_density", self.average_density)):
            if value is not None:
                _require(self.codec == "topk", name, "unset unless diloco.codec = 'topk'", value)
                _require(0 < value <= 1, name, "in (0, 1]", value)
        _require(self.retries >= 0, "diloco.retries", ">= 0", self.retries)
        _require_range(self.retries, "diloco.retries", 0, 100)
        _require(self.timeout_s > 0, "diloco.timeout_s", "> 0", self.timeout_s)
        _require_range(self.timeout_s, "diloco.timeout_s", _MIN_TIMEOUT_S, _MAX_TIMEOUT_S, " seconds")
        _require(self.streams >= 0, "diloco.streams", ">= 0", self.streams)
        _require_range(self.streams, "diloco.streams", 0, 64, " (0: the ring's default)",
                       "the ring opens at most 64 TCP streams per link")
        _require(self.max_rate_mbit >= 0, "diloco.max_rate_mbit", ">= 0 (0: unlimited)", self.max_rate_mbit)
        _require_rate(self.max_rate_mbit, "diloco.max_rate_mbit")


@dataclass
class TrainConfig:
    steps: int = 1000
    """Total inner optimizer steps of the run."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on each process."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (the batch per node is micro_batch_size * grad_accum * procs)."""
    seed: int = 0
    """Seed of the weight initialization (must be the same on every node) and of the data order."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    fsdp: str = "auto"
    """Shard the model over the node's processes with FSDP2: on, off or auto (on when a node runs > 1 process)."""
    mixed_precision: str = "auto"
    """bf16 (bf16 compute, fp32 master weights and gradient reduction), fp32, or auto (bf16 on GPU, fp32 on CPU)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (saves memory, costs ~1/3 more compute)."""
    compile: bool = False
    """torch.compile each transformer block."""
    threads: int = 0
    """torch CPU threads per process (0: torch's default)."""
    stop_grace_s: float = 30.0
    """On SIGTERM, SIGINT or SIGHUP a process stops at once and exits with 128 + the signal's number; one still stopping
    this many seconds later (a write, a collective stuck in C++) is ended without waiting more (docs/stopping.md).
    prime-simulate waits this long and 5 s more for its nodes, then kills what is left."""

    slowdown: float = 1.0
    """Each inner step takes this many times its own time (a sleep after it, counted in the step): a slower node,
    emulated for tests and benchmarks (prime-simulate --slow-node R:F sets it for node R)."""

    def validate(self) -> None:
        _require(self.steps >= 1, "train.steps", ">= 1", self.steps)
        _require(self.micro_batch_size >= 1, "train.micro_batch_size", ">= 1", self.micro_batch_size)
        _require(self.grad_accum >= 1, "train.grad_accum", ">= 1", self.grad_accum)
        _require(self.device in ("auto", "cpu", "cuda"), "train.device", "'auto', 'cpu' or 'cuda'", self.device)
        _require(self.fsdp in ("auto", "on", "off"), "train.fsdp", "'auto', 'on' or 'off'", self.fsdp)
        _require(
            self.mixed_precision in ("auto", "bf16", "fp32"), "train.mixed_precision", "'auto', 'bf16' or 'fp32'",
            self.mixed_precision,
        )
        _require(self.threads >= 0, "train.threads", ">= 0", self.threads)
        _require_range(self.threads, "train.threads", 0, 4096)
        _require(0 <= self.seed <= _INT64_MAX, "train.seed", f"in [0, {_INT64_MAX}]", self.seed)
        _require(self.stop_grace_s > 0, "train.stop_grace_s", "> 0 seconds", self.stop_grace_s)
        _require_range(self.stop_grace_s, "train.stop_grace_s", 0, _MAX_STOP_GRACE_S, " seconds",
                       "a stopped job holds its machines this long at most")
        _require_range(self.slowdown, "train.slowdown", 1, 100, "", "1: the node's own speed")


@dataclass
class DataConfig:
    source: str = "embedded"
    """embedded (the Python standard library's own .py files, bytes), text (a directory of text files, bytes) or bin
    (token shards: prime-tokenize's output, or nanoGPT-style *.bin)."""
    path: str = ""
    """Directory for source = text or bin (ignored for embedded)."""
    bin_dtype: str = "auto"
    """Token dtype of the .bin shards: auto (from prime-tokenize's meta.json; uint16 without one), uint16 or uint32."""
    seq_len: int = 256
    """Tokens per training sequence."""

    def validate(self) -> None:
        _require(self.source in ("embedded", "text", "bin"), "data.source", "'embedded', 'text' or 'bin'", self.source)
        _require(self.bin_dtype in ("auto", "uint16", "uint32"), "data.bin_dtype", "'auto', 'uint16' or 'uint32'",
                 self.bin_dtype)
        _require(self.seq_len >= 1, "data.seq_len", ">= 1", self.seq_len)
        if self.source in ("text", "bin"):
            if not self.path:
                raise ValueError(f"data.path must name a directory when data.source is {self.source!r}, got ''")
            if not os.path.isdir(self.path):
                raise ValueError(
                    f"data.path {self.path!r} does not exist or is not a directory "
                    f"(data.source = {self.source!r}); point it at your data or use data.source = 'embedded'"
                )


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Checkpoint directory (each node writes under dir/node<rank>/step_<n>/); empty: no checkpoints."""
    every: int = 0
    """Save every this many inner steps (0: only at the end and when the job stops on an error). Needs dir: without
    it nothing is saved (a warning says so)."""
    resume: bool = True
    """Resume from the newest checkpoint that every node has, when dir holds one."""
    async_save: bool = True
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save) so training does not stall."""
    keep: int = 2
    """Keep this many newest checkpoints per node (0: keep all)."""

    def validate(self) -> None:
        _require(self.every >= 0, "checkpoint.every", ">= 0", self.every)
        _require(self.keep >= 0, "checkpoint.keep", ">= 0", self.keep)


@dataclass
class MetricsConfig:
    log_every: int = 1
    """Print a step line every this many inner steps (the first, the last and outer steps always; the JSONL file gets
    every step)."""
    out_dir: str = "runs/default"
    """Where metrics_node<rank>.jsonl and loss.png go."""
    plot: bool = True
    """Write out_dir/loss.png at the end (needs matplotlib; skipped with a note when it is missing)."""
    peak_tflops: float = 0.0
    """Peak bf16 TFLOP/s per device for MFU (0: from the table for H100/H200/A100; CPU: MFU shown as n/a)."""
    tensorboard: bool = False
    """Also log every step, outer step and summary field to TensorBoard, under out_dir/tb/<nodes.run_id>/node<rank>
    (needs the tensorboard package)."""
    wandb: bool = False
    """Also log every field to Weights & Biases: one W&B run per node, named node<rank>, grouped by nodes.run_id (needs
    the wandb package)."""
    wandb_project: str = "prime"
    """W&B project name."""
    wandb_mode: str = ""
    """W&B mode: online (needs a login), offline (files under out_dir/wandb, no network; `wandb sync` uploads them
    later) or empty (the WANDB_MODE environment variable, else online)."""
    progress: str = "auto"
    """auto: a progress bar with ETA and tokens/s when the output is a terminal, plain lines otherwise; bar; lines."""
    outer_hash: bool = False
    """Record a 64-bit hash (blake2b) of the outer weights after every outer step (outer_hash in the metrics JSONL), to
    show that the nodes agree after each one; a pass over this process's outer weights."""

    def validate(self) -> None:
        _require(self.log_every >= 1, "metrics.log_every", ">= 1", self.log_every)
        _require(self.peak_tflops >= 0, "metrics.peak_tflops", ">= 0", self.peak_tflops)
        _require_range(self.peak_tflops, "metrics.peak_tflops", 0, 1e6, " TFLOP/s")
        _require(bool(self.out_dir), "metrics.out_dir", "a directory path", self.out_dir)
        _require(self.wandb_mode in ("", "online", "offline"), "metrics.wandb_mode", "'online', 'offline' or ''",
                 self.wandb_mode)
        _require(self.progress in ("auto", "bar", "lines"), "metrics.progress", "'auto', 'bar' or 'lines'",
                 self.progress)
        _require(bool(self.wandb_project.strip()), "metrics.wandb_project", "a project name", self.wandb_project)


@dataclass
class MemoryConfig:
    check: bool = True
    """Refuse to start when the memory plan printed at start (every process's GPU and host memory, checkpoints included)
    does not fit, naming the settings to change (prime/memory.py)."""
    host_gib: float = 0.0
    """Host memory for all of this job's processes on one host, GiB (0: detected, the cgroup limit or the machine's
    memory)."""
    gpu_gib: float = 0.0
    """Memory of each GPU, GiB (0: the device's)."""
    host_procs: int = 0
    """Processes of this job sharing one host's memory (0: counted, the processes that report this host through the
    store, else this node's)."""

    def validate(self) -> None:
        _require_range(self.host_gib, "memory.host_gib", 0, 1 << 20, " GiB (0: detected)")
        _require_range(self.gpu_gib, "memory.gpu_gib", 0, 1 << 16, " GiB (0: detected)")
        _require_range(self.host_procs, "memory.host_procs", 0, 1 << 16, " (0: counted)")


@dataclass
class NodesConfig:
    num_nodes: int = 1
    """Nodes in the DiLoCo ring (env PRIME_NUM_NODES, flag --num-nodes)."""
    node_rank: int = 0
    """This node's rank, 0..num_nodes-1 (env PRIME_NODE_RANK, flag --node-rank)."""
    store_addr: str = "127.0.0.1:29600"
    """host:port of the cross-node TCPStore, hosted by node 0's first process (env PRIME_STORE_ADDR, flag --store-addr).
    """
    run_id: str = "prime"
    """Name of the run; nodes with another run_id never join this ring (env PRIME_RUN_ID)."""
    procs: str = ""
    """Processes of each node, comma-separated, when nodes run different numbers (e.g. "2,1"; each node runs the most of
    any node, or one: prime/shares.py). Empty: every node runs as many as this one (prime-simulate --procs-per-node sets
    it)."""

    def validate(self) -> None:
        _require(self.num_nodes >= 1, "nodes.num_nodes", ">= 1", self.num_nodes)
        _require(
            0 <= self.node_rank < self.num_nodes, "nodes.node_rank", f"in [0, {self.num_nodes - 1}]", self.node_rank
        )
        if self.procs:
            parse_procs(self.procs, self.num_nodes)
        self._check_store_addr()

    def _check_store_addr(self) -> None:
        host, _, port = self.store_addr.rpartition(":")
        _require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "nodes.store_addr", "host:port",
                 self.store_addr)

    def validate_elastic(self) -> None:
        """As validate(), except that node_rank may be >= num_nodes: such a node joins a running job."""
        _require(self.num_nodes >= 1, "nodes.num_nodes", ">= 1", self.num_nodes)
        _require(self.node_rank >= 0, "nodes.node_rank", ">= 0", self.node_rank)
        self._check_store_addr()

    @property
    def store_host(self) -> str:
        return self.store_addr.rpartition(":")[0]

    @property
    def store_port(self) -> int:
        return int(self.store_addr.rpartition(":")[2])


@dataclass
class ElasticConfig:
    enabled: bool = False
    """Elastic membership: nodes may die, leave and join mid-training (docs/elastic.md). One or more processes per node;
    a node started with node_rank >= num_nodes joins the running job."""
    heartbeat_interval_s: float = 1.0
    """Each node bumps its heartbeat counter in the store this often (seconds)."""
    heartbeat_timeout_s: float = 10.0
    """A node whose heartbeat has not moved for this long is dead: an outer step in flight is retried without it."""
    barrier_timeout_s: float = 300.0
    """How long the first node at an outer step waits for a live member that has not arrived before evicting it."""
    max_attempts: int = 5
    """All-reduce attempts per outer step (each with the nodes still alive) before the job stops."""
    min_nodes: int = 1
    """Stop when fewer nodes than this would contribute to an outer step."""
    transfer_timeout_s: float = 60.0
    """Live recovery: a joiner gives up on a source that sends nothing for this long, or that has not delivered a
    frame this long plus its size at 64 KiB/s (half transfer_max_rate_mbit where that is lower) after the joiner began
    waiting for it (69 s for a 4 MiB piece at 60 s), and resumes from another; the handshake has 10 s in all, and no
    wait goes past join_timeout_s from the download's start (prime/elastic/transfer.py). A source gives a joiner's
    request, and each of its sends, this long."""
    transfer_max_rate_mbit: float = 0.0
    """Cap on the rate at which a node serves its state to a joiner, Mbit/s (0: unlimited)."""
    join_timeout_s: float = 600.0
    """A joiner stops when it cannot download the state and be admitted within this long."""
    external_store: bool = False
    """The TCPStore at nodes.store_addr is hosted outside the nodes (python -m prime.elastic.store, prime-simulate
    --elastic); else node 0 hosts it and its death stops the job."""
    digest: bool = False
    """Hash the outer weights and momentum after every outer step (SHA-256, about 1 GB/s here) and record it, to prove
    that the nodes agree."""

    def validate(self) -> None:
        _require(self.heartbeat_interval_s > 0, "elastic.heartbeat_interval_s", "> 0", self.heartbeat_interval_s)
        _require_range(self.heartbeat_interval_s, "elastic.heartbeat_interval_s", 0.01, 60, " seconds")
        _require(self.heartbeat_timeout_s > self.heartbeat_interval_s, "elastic.heartbeat_timeout_s",
                 f"> heartbeat_interval_s ({self.heartbeat_interval_s})", self.heartbeat_timeout_s)
        _require_range(self.heartbeat_timeout_s, "elastic.heartbeat_timeout_s", 0.02, _MAX_TIMEOUT_S, " seconds")
        _require(self.barrier_timeout_s > 0, "elastic.barrier_timeout_s", "> 0", self.barrier_timeout_s)
        _require_range(self.barrier_timeout_s, "elastic.barrier_timeout_s", _MIN_TIMEOUT_S, _MAX_TIMEOUT_S, " seconds")
        _require(self.max_attempts >= 1, "elastic.max_attempts", ">= 1", self.max_attempts)
        _require_range(self.max_attempts, "elastic.max_attempts", 1, 100)
        _require(self.min_nodes >= 1, "elastic.min_nodes", ">= 1", self.min_nodes)
        _require(self.transfer_timeout_s > 0, "elastic.transfer_timeout_s", "> 0", self.transfer_timeout_s)
        _require_range(self.transfer_timeout_s, "elastic.transfer_timeout_s", _MIN_TIMEOUT_S, _MAX_TIMEOUT_S,
                       " seconds")
        _require(self.transfer_max_rate_mbit >= 0, "elastic.transfer_max_rate_mbit", ">= 0 (0: unlimited)",
                 self.transfer_max_rate_mbit)
        _require_rate(self.transfer_max_rate_mbit, "elastic.transfer_max_rate_mbit")
        _require(self.join_timeout_s > 0, "elastic.join_timeout_s", "> 0", self.join_timeout_s)
        _require_range(self.join_timeout_s, "elastic.join_timeout_s", _MIN_TIMEOUT_S, _MAX_TIMEOUT_S, " seconds")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def validate(self) -> "Config":
        """Checks every section and the rules that span sections; returns self."""
        for f in dataclasses.fields(self):
            _check_numbers(getattr(self, f.name), f.name)
        for f in dataclasses.fields(self):
            if f.name == "nodes" and self.elastic.enabled:
                self.nodes.validate_elastic()  # a joiner's node_rank is >= num_nodes
            else:
                getattr(self, f.name).validate()
        uneven = bool(self.nodes.procs) and len(set(parse_procs(self.nodes.procs, self.nodes.num_nodes))) > 1
        if uneven and self.elastic.enabled:
            raise ValueError(f"nodes.procs = {self.nodes.procs!r}: nodes that run different numbers of processes "
                             "need a fixed set of nodes (elastic.enabled = false)")
        self._resolve_vocab_size()
        args = self.model.args()
        if self.data.source in ("embedded", "text") and args.vocab_size < 256:
            raise ValueError(
                f"model.vocab_size must be >= 256 for byte-level data (data.source = {self.data.source!r}), "
                f"got {args.vocab_size}"
            )
        if self.data.seq_len > args.max_seq_len:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({args.max_seq_len})")
        if self.diloco.fragments > 1:  # fragments = 1 fits every model
            layers = model_layers(args)
            if self.diloco.fragments > len(layers):
                raise ValueError(
                    f"diloco.fragments ({self.diloco.fragments}) is more than the model's {len(layers)} layers "
                    f"(model.name = {self.model.name!r}: {args.n_layers} blocks, and "
                    f"{', '.join(u for u in layers if not u.startswith('layers.'))}); a fragment holds whole layers")
        return self

    def _resolve_vocab_size(self) -> None:
        """Tokenized data (prime-tokenize's meta.json): an unset model.vocab_size becomes the tokenizer's, a
        smaller one is refused naming both numbers (a larger one only pads the embedding)."""
        if self.data.source != "bin":
            return
        from prime.data import check_vocab_size, read_metadata

        meta = read_metadata(self.data.path)
        if meta is None:
            return
        if self.model.vocab_size is None:
            self.model.vocab_size = meta["vocab_size"]
        check_vocab_size(meta, self.data.path, self.model.vocab_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------
# loading and overriding

_ENV = {"PRIME_NUM_NODES": "nodes.num_nodes", "PRIME_NODE_RANK": "nodes.node_rank",
        "PRIME_STORE_ADDR": "nodes.store_addr", "PRIME_RUN_ID": "nodes.run_id"}
_FLAG_ALIASES = {"--num-nodes": "nodes.num_nodes", "--node-rank": "nodes.node_rank",
                 "--store-addr": "nodes.store_addr", "--run-id": "nodes.run_id"}


def _section_types(section_cls) -> dict:
    return typing.get_type_hints(section_cls)


def _convert(dotted: str, raw: Any, tp) -> Any:
    """Converts a TOML value or a command-line string to the field's type, or raises ValueError naming the field."""
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in targs:  # Optional[X]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            return None
        tp = next(t for t in targs if t is not type(None))
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(raw, bool):
                raise ValueError
            if isinstance(raw, int):
                return raw
            if isinstance(raw, float) and raw.is_integer():
                return int(raw)
            if isinstance(raw, str):
                return int(raw.strip().replace("_", ""))
            raise ValueError
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if tp is str:
            if not isinstance(raw, str):
                raise ValueError
            return raw
    except (ValueError, TypeError, SyntaxError):
        pass
    else:
        raise AssertionError(f"unsupported field type {tp} for {dotted}")
    name = getattr(tp, "__name__", str(tp))
    raise ValueError(f"{dotted} must be {'a' if name != 'int' else 'an'} {name}, got {raw!r}")


def _set(cfg: Config, dotted: str, raw: Any) -> None:
    section_name, _, key = dotted.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections or not key:
        raise ValueError(f"unknown config field {dotted!r}; sections are {sorted(sections)} (write section.field)")
    section = getattr(cfg, section_name)
    types = _section_types(type(section))
    if key not in types:
        raise ValueError(f"unknown config field {dotted!r}; {section_name} has {sorted(types)}")
    setattr(section, key, _convert(dotted, raw, types[key]))


def load_config(path: Optional[str] = None, overrides: Optional[list[tuple[str, Any]]] = None, env=None) -> Config:
    """Builds a Config from defaults, the TOML file at `path`, the environment and `overrides` (dotted name, value)."""
    cfg = Config()
    if path:
        if _toml is None:
            raise RuntimeError("reading TOML needs Python 3.11+ (tomllib) or the tomli package: pip install tomli")
        if not os.path.isfile(path):
            raise ValueError(f"config file {path!r} does not exist")
        with open(path, "rb") as f:
            try:
                doc = _toml.load(f)
            except Exception as e:  # tomllib.TOMLDecodeError: say which file
                raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None
        for section_name, table in doc.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: top-level key {section_name!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, f"{section_name}.{key}", value)
    env = os.environ if env is None else env
    for var, dotted in _ENV.items():
        if env.get(var):
            _set(cfg, dotted, env[var])
    for dotted, value in overrides or []:
        _set(cfg, dotted, value)
    return cfg


def parse_cli(argv: list[str]) -> tuple[Optional[str], list[tuple[str, str]], bool]:
    """Splits argv into (config path, [(dotted field, value)], help_requested)."""
    path, overrides, want_help = None, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help", "--help-config"):
            want_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; use --config FILE and --section.field VALUE")
        name, eq, value = arg.partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{name} needs a value")
            value = argv[i + 1]
            i += 2
        else:
            i += 1
        if name == "--config":
            path = value
        elif name in _FLAG_ALIASES:
            overrides.append((_FLAG_ALIASES[name], value))
        else:
            overrides.append((name[2:], value))
    return path, overrides, want_help


def describe() -> str:
    """Every field with its type, default and documentation: the text of --help-config."""
    lines = [__doc__.strip(), ""]
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory
        lines.append(f"[{sec.name}]")
        docs = _field_docs(cls)
        types = _section_types(cls)
        for f in dataclasses.fields(cls):
            tp = types[f.name]
            targs = [t for t in typing.get_args(tp) if t is not type(None)]
            tname = f"{targs[0].__name__} or None" if targs else tp.__name__
            lines.append(f"  {f.name} ({tname}, default {f.default!r})")
            if f.name in docs:
                lines.append(f"      {docs[f.name]}")
        lines.append("")
    return "\n".join(lines)


def _field_docs(cls) -> dict:
    """The string literal written under each field of a dataclass (read from its source)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def config_from_argv(argv: Optional[list[str]] = None) -> Config:
    """parse_cli + load_config + validate; prints the field reference and exits on --help."""
    argv = sys.argv[1:] if argv is None else argv
    path, overrides, want_help = parse_cli(argv)
    if want_help:
        print("usage: prime-train --config FILE [--section.field VALUE ...] "
              "[--node-rank N --num-nodes N --store-addr H:P]\n")
        print(describe())
        raise SystemExit(0)
    return load_config(path, overrides).validate()
