"""Metric sinks (TensorBoard, Weights & Biases offline), the progress bar and the wall-time table.

What the sinks wrote is read back with readers independent of the code that
wrote it: TensorBoard's own EventAccumulator, and for W&B a reader of the
.wandb record log written here from its format (LevelDB-style 32 KiB blocks of
length-prefixed chunks, each a wandb_internal_pb2.Record).
"""

import glob
import io
import json
import os
import random
import struct
import sys

import pytest

from prime.diloco import OuterStepResult
from prime.metrics import TIME_ROWS, MetricsLogger, RunMetrics
from prime.progress import Progress, format_duration


def tensorboard_scalars(log_dir: str) -> dict:
    """{tag: [(step, value)]} of every scalar in log_dir, as TensorBoard shows them (purged events left out)."""
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(log_dir, size_guidance={ea_mod.SCALARS: 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def wandb_records(run_file: str) -> list:
    """(record type, record) of every record of a .wandb file."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos:pos + length], pos + length
        if kind in (1, 2):  # full, first
            pending = chunk
        else:  # middle, last
            pending += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append((rec.WhichOneof("record_type"), rec))
    return out


def wandb_history(run_file: str) -> tuple:
    """(run record, [{key: value}] per logged step) of a .wandb file."""
    run, rows = None, []
    for kind, rec in wandb_records(run_file):
        if kind == "run":
            run = rec.run
        elif kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return run, rows


def _log_some(m: MetricsLogger, rng: random.Random) -> list:
    sent = []
    for step in range(1, 7):
        rec = {"loss": rng.uniform(1, 5), "lr": 1e-3, "mfu": None, "tokens": step * 256}
        m.record("step", step, **rec)
        sent.append(("step", step, rec))
        if step % 3 == 0:
            rec = {"outer_step": step // 3, "allreduce_s": rng.random(), "bytes_sent": rng.randrange(1 << 30),
                   "bytes_measured": True, "compression_error": rng.random() / 100, "utilization": rng.random(),
                   "members": [0, 1]}
            m.record("outer", step, **rec)
            sent.append(("outer", step, rec))
    return sent


def _expected(sent: list) -> dict:
    """{tag: [(step, value)]} of the numeric fields (bools as 0/1; None and lists are not numbers)."""
    out: dict = {}
    for kind, step, rec in sent:
        for k, v in rec.items():
            if isinstance(v, bool):
                v = float(v)
            if isinstance(v, (int, float)):
                out.setdefault(f"{kind}/{k}", []).append((step, float(v)))
    return out


def test_tensorboard_and_offline_wandb_get_every_numeric_field(tmp_path, seed, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    rng = random.Random(seed)
    m = MetricsLogger(str(tmp_path), 1, enabled=True, tensorboard=True, wandb=True, wandb_project="proj",
                      wandb_mode="offline", run_id="job-7", config={"optim": {"lr": 1e-3}})
    sent = _log_some(m, rng)
    m.close()
    want = _expected(sent)
    tb = tensorboard_scalars(str(tmp_path / "tb" / "job-7" / "node1"))
    assert set(tb) == set(want)
    for tag, pts in want.items():
        assert [s for s, _ in tb[tag]] == [s for s, _ in pts]
        assert [v for _, v in tb[tag]] == pytest.approx([v for _, v in pts], rel=1e-6), tag  # float32 in events
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    run, rows = wandb_history(runs[0])
    assert run.project == "proj" and run.run_group == "job-7" and run.display_name == "node1"
    assert run.run_id == open(tmp_path / "wandb" / "node1.id").read().strip()
    got: dict = {}
    for row in rows:
        for k, v in row.items():
            if not k.startswith("_"):
                got.setdefault(k, []).append((row["_step"], float(v)))
    assert got == want  # JSON doubles: exact


def test_a_missing_package_is_one_line_and_training_goes_on(tmp_path, monkeypatch, capsys):
    for name in ("wandb", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # what an absent package looks like to an import
    m = MetricsLogger(str(tmp_path), 0, enabled=True, tensorboard=True, wandb=True)
    m.record("step", 1, loss=2.0)
    m.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "pip install tensorboard" in err[0] and "pip install wandb" in err[1]
    assert json.loads(open(tmp_path / "metrics_node0.jsonl").readline())["loss"] == 2.0


def test_wandb_online_without_login_is_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    m = MetricsLogger(str(tmp_path), 0, enabled=True, wandb=True, wandb_mode="online")
    m.record("step", 1, loss=2.0)
    m.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prime:")]
    assert len(err) == 1 and "Weights & Biases could not start in online mode" in err[0], err


def test_tensorboard_shows_one_curve_after_a_resume_and_after_a_fresh_start(tmp_path):
    pytest.importorskip("tensorboard")
    log_dir = str(tmp_path / "tb" / "prime" / "node0")

    def run(steps, resume_step=None, offset=0.0):
        m = MetricsLogger(str(tmp_path), 0, enabled=True, tensorboard=True, resume_step=resume_step)
        for s in steps:
            m.record("step", s, loss=float(s) + offset)
        m.close()

    run(range(1, 11))
    run(range(7, 13), resume_step=6, offset=100.0)  # resumed from the checkpoint of step 6
    assert tensorboard_scalars(log_dir)["step/loss"] == [(s, s + (100.0 if s > 6 else 0.0)) for s in range(1, 13)]
    run(range(1, 4), offset=1000.0)  # a fresh run in the same directory
    assert tensorboard_scalars(log_dir)["step/loss"] == [(s, s + 1000.0) for s in range(1, 4)]


# -- the progress bar and the wall-time table ----------------------------------------------


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_and_plain_lines_elsewhere():
    tty = _Tty()
    bar = Progress(100, label="step", stream=tty, redraw_s=0)
    bar.update(25, rate="1.0k tok/s")
    bar.write("outer 1 (step 25) | all-reduce 0.10 s")
    bar.status("outer step 2: averaging across nodes ...")
    bar.update(100)
    bar.close()
    out = tty.getvalue()
    assert out.count("\r\x1b[2K") >= 4 and "step 25/100 [######" in out and "25%" in out and "ETA" in out
    assert "1.0k tok/s" in out and "outer step 2: averaging" in out
    assert "\x1b[2Kouter 1 (step 25) | all-reduce 0.10 s\n" in out  # the line went above the bar
    assert out.endswith("100/100 [" + "#" * 24 + "] 100% | 1.0k tok/s\n")
    log = io.StringIO()
    bar = Progress(100, stream=log, every_s=0)
    bar.update(50)
    bar.status("outer")
    bar.write("a line")
    bar.close()
    assert log.getvalue() == "a line\n"  # no carriage returns, no escapes: only whole lines
    assert format_duration(83) == "1m23s" and format_duration(7384) == "2h03m" and format_duration(None) == "?"


def _run_metrics(tmp_path, **kw):
    return RunMetrics(out_dir=str(tmp_path), node_rank=0, is_logger=True, local_world=1, num_nodes=2, total_steps=20,
                      log_every=5, tokens_per_step=256, flops_per_token=1e6, peak=None, local_sum=lambda v: list(v),
                      **dict(dict(codec="int8", block_size=256), **kw), inner_steps=5, model_numel=1000)


def test_the_summary_says_where_the_wall_time_went(tmp_path, capsys, seed):
    rng = random.Random(seed)
    m = _run_metrics(tmp_path)
    m.open(progress="lines")
    parts = {"compute": 0.0, "outer": 0.0, "outer_wait": 0.0, "checkpoint": rng.random(), "start": rng.random()}
    for step in range(1, 11):
        s = rng.uniform(0.1, 0.2)
        m.compute(s)
        parts["compute"] += s
        m.inner_step(step, 3.0, 1.0, 1e-3, s, show=False)
        if step % 5 == 0:
            o, w = rng.uniform(0.5, 1.0), rng.uniform(0.0, 0.5)
            m.spend("outer", o)
            m.spend("outer_wait", w)
            parts["outer"] += o
            parts["outer_wait"] += w
    m.spend("checkpoint", parts["checkpoint"])
    m.spend("start", parts["start"])
    wall = sum(parts.values()) + 1.5  # 1.5 s of other things
    s = m.summary(10, wall=wall, outer_steps=2, multi_node=True)
    m.close()
    assert s["time_compute_s"] == pytest.approx(parts["compute"])
    assert s["time_outer_local_s"] == pytest.approx(parts["outer"] - parts["outer_wait"])
    assert s["time_outer_wait_s"] == pytest.approx(parts["outer_wait"])
    assert s["time_checkpoint_s"] == pytest.approx(parts["checkpoint"]) and s["time_start_s"] == pytest.approx(parts["start"])
    assert s["time_other_s"] == pytest.approx(wall - sum(parts.values()) + parts["outer_wait"])
    out = capsys.readouterr().out
    assert "where the wall time went" in out
    for _, what in TIME_ROWS:
        assert what in out
    assert sum(s[f"time_{k}_s"] for k, _ in TIME_ROWS) == pytest.approx(wall)


def test_run_metrics_draw_the_bar_with_the_phase_and_the_outer_step(tmp_path, monkeypatch):
    tty = _Tty()
    monkeypatch.setattr("sys.stdout", tty)
    m = _run_metrics(tmp_path)
    m.open(progress="auto")
    assert m.progress is not None and m.progress.interactive
    m.progress.redraw_s = 0
    for step in range(1, 5):
        m.inner_step(step, 3.0, 1.0, 1e-3, 0.1, show=False)
    m.outer_running(1)
    m.print("outer 1 (step 5) | ...")
    m.summary(4, wall=1.0, outer_steps=0, multi_node=False)
    m.close()
    out = tty.getvalue()
    assert "step 4/20 [" in out and "outer 1 [########..] 4/5" in out and "loss 3.0000" in out
    assert "outer step 1: averaging across nodes" in out and "2.6k tok/s" in out
    assert out.index("step 4/20") < out.index("summary (node 0)")  # the bar ends before the summary


def test_prime_train_in_a_terminal_draws_the_bar_and_in_a_pipe_prints_lines(tmp_path):
    """A real terminal (a pty) gets the redrawn bar; a pipe gets the plain step lines and no escape codes."""
    import os
    import pty
    import select
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("PRIME_NODE_RANK", "PRIME_NUM_NODES", "PRIME_STORE_ADDR", "PRIME_FAULTS"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "prime.train", "--config", "configs/tiny.toml", "--train.steps", "12",
           "--data.seq_len", "64", "--train.micro_batch_size", "4", "--metrics.log_every", "5",
           "--metrics.out_dir", str(tmp_path / "run"), "--metrics.plot", "false"]
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=slave, stderr=slave, env=env, cwd=root)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert p.wait(timeout=60) == 0, seen.decode(errors="replace")
    tty = seen.decode(errors="replace")
    assert "\r\x1b[2Kstep 12/12 [" + "#" * 24 + "] 100%" in tty and "ETA" in tty and "tok/s" in tty, tty[-2000:]
    assert "step      5/12 | loss" in tty and "where the wall time went" in tty
    piped = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stdout and "\x1b" not in piped.stdout and "[####" not in piped.stdout
    assert "step      5/12 | loss" in piped.stdout and "where the wall time went" in piped.stdout


def test_an_outer_step_of_a_dense_start_says_so_and_counts_int8_bytes(tmp_path, capsys, seed):
    """topk's dense start (OuterStepResult.dense): the line ends with the note, the record has dense=True, and an
    unmeasured byte count is estimated at int8's bytes a value, not topk's (a later sparse step: topk's)."""
    from prime.codecs import CODECS

    rng = random.Random(seed)
    numel = rng.randrange(1 << 16, 1 << 20)
    m = _run_metrics(tmp_path, codec="topk", block_size=4096, density=48 / 4096, average_density=96 / 4096)
    m.open(progress="lines")
    for k, dense in ((1, True), (2, False)):
        m.outer_step(5 * k, OuterStepResult(did_sync=True, inner_step=5 * k, outer_step=k, numel=numel, dense=dense))
    m.close()
    out = capsys.readouterr().out.splitlines()
    lines = [l for l in out if l.startswith("outer ")]
    assert "dense start (int8)" in lines[0] and "dense start" not in lines[1], lines
    recs = [json.loads(l) for l in open(glob.glob(str(tmp_path / "metrics_node0.jsonl"))[0])]
    outer = [r for r in recs if r["kind"] == "outer"]
    assert outer[0]["dense"] is True and "dense" not in outer[1]
    int8 = CODECS["int8"].bytes_per_value(64)
    topk = (CODECS["topk"].bytes_per_value(4096, 48 / 4096) + CODECS["topk"].bytes_per_value(4096, 96 / 4096)) / 2
    assert outer[0]["bytes_sent"] == pytest.approx(numel * int8)  # 2 (N-1)/N = 1 at N = 2
    assert outer[1]["bytes_sent"] == pytest.approx(numel * topk)
