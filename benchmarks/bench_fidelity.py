"""Fidelity of the outer step: final loss at equal tokens, data parallel against DiLoCo variants.

    nice python3 benchmarks/bench_fidelity.py --config configs/demo.toml --train.steps 120 --out benchmarks/results/fidelity_cpu
    python3 benchmarks/bench_fidelity.py --config configs/150M.toml --train.steps 300 --out OUT    # on a GPU

Every method sees the same tokens: N nodes (threads of this process, --nodes) each read their own shard
of the training split (the shards of a real N-node run) for train.steps inner steps; data parallel reads
the same N batches per step as one batch (the average of the N gradients, exact, every step). Methods:

  dp                   data parallel: AdamW on the average gradient of the N batches, every step
  diloco-exact         synchronous DiLoCo, codec none (exact fp32 average)
  diloco-int8          synchronous DiLoCo, int8 ring
  overlap-int8-eager   DiLoCo with overlap (eager), int8 ring; the average is applied at the next outer step
  overlap-int8-eager@F the same with overlap_steps = F x H (a fraction like 1/4, or a number of steps): the
                       average is applied after that many inner steps of the next outer step
  overlap-int8-eager-adaptive  DiLoCo with overlap (eager-adaptive), int8 ring
  overlap-int8-delayed DiLoCo with overlap (delayed), int8 ring
  overlap-int8-eager-merge  DiLoCo with overlap (eager-merge: the local weights keep half of their start's
                       offset when the average arrives), int8 ring; may end in @F as eager
  diloco-fp4           synchronous DiLoCo, fp4 ring, with error feedback (fp4's default: each node adds what its
                       last contribution lost to the codec to its next pseudo-gradient; prime/feedback.py)
  diloco-fp4-noef      the same without error feedback
  diloco-topk          synchronous DiLoCo, topk ring (64 of every 4096 values at 2 bits, error feedback always);
                       diloco-topk-k16 / -k256 / -k1024 keep 16 / 256 / 1024;
                       -plain: outer_lr 1, no outer momentum (error feedback as the only memory;
                       diloco-int8-plain: int8 with that outer update, for comparison); diloco-topk-c1024-plain /
                       -c512-plain: the same density in chunks of 1024 / 512; -plain-ef95: error feedback with a
                       decay of 0.95 (diloco.feedback_decay); -k48-a96-plain-ef95: 48 of 4096 per contribution, 96
                       per chunk of the owners' averages (diloco.average_density), decay 0.95 (-k32-a64-: 32 and 64);
                       -a128-plain: 64 and 128; any diloco-topk[-kK][-aA][-cC]-plain[-efDD][-lrX] spells a setting
                       out (K and A of every C, decay 0.DD, outer lr X, -mD Nesterov momentum 0.D; unset: K 64,
                       A = K, no decay, lr 1, no momentum;
                       diloco-int8-plain-lrX, diloco-exact-plain-lrX the same for int8 and exact);
                       overlap-topk-eager-merge with overlap. These keep the settings they were recorded with;
                       diloco-topk-defaults takes topk's own (48 / 96, decay 0.8, lr 3, no momentum)
  diloco-int8-ef       synchronous DiLoCo, int8 ring, with error feedback (int8's default is without)
  overlap-fp4-eager-merge  DiLoCo with overlap (eager-merge), fp4 ring with error feedback; may end in @F
  METHOD:fP            any DiLoCo method with streaming fragments (diloco.fragments = P): each fragment syncs
                       at its own offset in the phase; with overlap, overlap_steps defaults to H / P
  METHOD:t             any DiLoCo method in time phases (diloco.phase = "time", prime.phases) with nodes of the
                       speeds --slowdowns gives, on a virtual clock (so the run is deterministic): node r's
                       inner step takes slowdowns[r] time units, a nominal step tau units with
                       sum_r tau / slowdowns[r] = N (the nodes together train N inner steps a nominal step, as
                       N equal nodes in steps mode do: equal tokens); the outer step weighs each node by the
                       inner steps it trained (prime.weights). The LR schedule runs on nominal steps

DiLoCo runs through prime.DiLoCo and the real ring (prime.comm.Ring over 127.0.0.1). The final loss is
the mean cross-entropy of the final weights (DiLoCo: the outer weights after the last outer step; with
overlap, after finish() applied the last average) on --eval-batches fixed batches of a held-out split
(the last 5% of the corpus, never trained on). train.grad_accum is not used (one micro-batch per step). Writes <out>.json, <out>.csv (the training-loss curves) and
<out>.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import re
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prime.config import load_config, parse_cli  # noqa: E402
from prime.data import ShardedLoader, TokenSource, load_source  # noqa: E402
import prime.fragments  # noqa: E402
from prime.diloco import DiLoCo  # noqa: E402
from prime.model import Transformer  # noqa: E402

METHODS = {
    "dp": None,
    "diloco-exact": dict(codec="none", overlap=False),
    "diloco-int8": dict(codec="int8", overlap=False),
    "overlap-int8-eager": dict(codec="int8", overlap=True, overlap_scheme="eager"),
    "overlap-int8-eager-adaptive": dict(codec="int8", overlap=True, overlap_scheme="eager-adaptive"),
    "overlap-int8-delayed": dict(codec="int8", overlap=True, overlap_scheme="delayed"),
    "overlap-int8-eager-merge": dict(codec="int8", overlap=True, overlap_scheme="eager-merge"),
    "diloco-fp4": dict(codec="fp4", overlap=False, error_feedback=True),
    "diloco-fp4-noef": dict(codec="fp4", overlap=False, error_feedback=False),
    "diloco-int8-ef": dict(codec="int8", overlap=False, error_feedback=True),
    "overlap-fp4-eager-merge": dict(codec="fp4", overlap=True, overlap_scheme="eager-merge", error_feedback=True),
    "diloco-topk": dict(codec="topk", overlap=False),
    "diloco-topk-k16": dict(codec="topk", overlap=False, density=16 / 4096),
    "diloco-topk-k256": dict(codec="topk", overlap=False, density=256 / 4096),
    "diloco-topk-k1024": dict(codec="topk", overlap=False, density=1024 / 4096),
    "diloco-int8-plain": dict(codec="int8", overlap=False, outer_lr=1.0, outer_momentum=0.0),
    "diloco-topk-plain": dict(codec="topk", overlap=False, outer_lr=1.0, outer_momentum=0.0),
    "diloco-topk-plain-lr2": dict(codec="topk", overlap=False, outer_lr=2.0, outer_momentum=0.0),
    "diloco-topk-plain-ef95": dict(codec="topk", overlap=False, outer_lr=1.0, outer_momentum=0.0, feedback_decay=0.95),
    "diloco-topk-k48-a96-plain-ef95": dict(codec="topk", overlap=False, density=48 / 4096, average_density=96 / 4096,
                                           outer_lr=1.0, outer_momentum=0.0, feedback_decay=0.95),
    "diloco-topk-k32-a64-plain-ef95": dict(codec="topk", overlap=False, density=32 / 4096, average_density=64 / 4096,
                                           outer_lr=1.0, outer_momentum=0.0, feedback_decay=0.95),
    "diloco-topk-a128-plain": dict(codec="topk", overlap=False, average_density=128 / 4096, outer_lr=1.0,
                                   outer_momentum=0.0),
    "diloco-topk-k256-plain": dict(codec="topk", overlap=False, density=256 / 4096, outer_lr=1.0, outer_momentum=0.0),
    "diloco-topk-c1024-plain": dict(codec="topk", overlap=False, block_size=1024, outer_lr=1.0, outer_momentum=0.0),
    "diloco-topk-c512-plain": dict(codec="topk", overlap=False, block_size=512, outer_lr=1.0, outer_momentum=0.0),
    "overlap-topk-eager-merge": dict(codec="topk", overlap=True, overlap_scheme="eager-merge"),
}
# The topk methods above keep the settings they were recorded with (benchmarks/RESULTS.md) now that topk has
# defaults of its own: 64 of every 4096 values (the averages as many), no residual decay, and unless a method
# sets it, the block codecs' update (Nesterov, lr 0.7, momentum 0.9). diloco-topk-defaults takes topk's own.
for _opts in METHODS.values():
    if _opts is not None and _opts["codec"] == "topk":
        for _name, _value in (("density", 64 / 4096), ("feedback_decay", 1.0), ("outer_lr", 0.7),
                              ("outer_momentum", 0.9)):
            _opts.setdefault(_name, _value)
METHODS["diloco-topk-defaults"] = dict(codec="topk", overlap=False)
EVAL_FRACTION = 0.05
DENSE_SPEC = re.compile(r"diloco-(int8|exact)-plain-lr([\d.]+)")
TOPK_SPEC = re.compile(r"diloco-topk(?:-k(\d+))?(?:-a(\d+))?(?:-c(\d+))?-plain(?:-ef(\d+))?(?:-lr([\d.]+))?"
                       r"(?:-m(\d+))?(?:-d(\d+))?")


def method_options(base: str):
    """A method's DiLoCo options: a named one, or a setting spelled out: diloco-topk-k40-a112-plain-ef90 (40 and
    112 of every 4096, decay 0.90; -c1024 a chunk of 1024, -lr1.5 an outer lr, -m5 Nesterov momentum 0.5, -d4 the
    first 4 outer steps dense (-d0: none); unset: 1/64 of each chunk, the averages as many, no decay, lr 1, no
    momentum, no dense start), diloco-int8-plain-lr1.5 (int8 or exact with outer lr 1.5, no momentum); None when
    unknown."""
    if base in METHODS:
        return METHODS[base]
    m = DENSE_SPEC.fullmatch(base)
    if m is not None:
        return dict(METHODS[f"diloco-{m.group(1)}"], outer_lr=float(m.group(2)), outer_momentum=0.0)
    m = TOPK_SPEC.fullmatch(base)
    if m is None:
        return None
    k, a, c, ef, lr, mu, dense = m.groups()
    chunk = int(c) if c else 4096
    opts = dict(codec="topk", overlap=False, outer_lr=float(lr) if lr else 1.0,
                outer_momentum=int(mu) / 10 ** len(mu) if mu else 0.0,
                density=int(k) / chunk if k else 1 / 64, feedback_decay=int(ef) / 10 ** len(ef) if ef else 1.0)
    if c:
        opts["block_size"] = chunk
    if a:
        opts["average_density"] = int(a) / chunk
    if dense:
        opts["dense_outer_steps"] = int(dense)
    return opts


def lr_at(step, cfg):
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps > 0 and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    start = total - o.decay_steps
    if o.decay_steps > 0 and step > start:
        return o.lr * (1.0 - (1.0 - o.min_lr_ratio) * min(1.0, (step - start) / o.decay_steps))
    return o.lr


class Setup:
    def __init__(self, cfg, nodes, device):
        self.cfg, self.nodes, self.device = cfg, nodes, device
        src = load_source(cfg.data.source, cfg.data.path, cfg.data.bin_dtype)
        arrays = [a for a in src.arrays if a.shape[0] > 0]
        big = max(range(len(arrays)), key=lambda i: arrays[i].shape[0])
        cut = int(arrays[big].shape[0] * (1 - EVAL_FRACTION))  # held out: the tail of the largest array
        train = arrays[:big] + [arrays[big][:cut]] + arrays[big + 1 :]
        self.train_src = TokenSource(train, src.description + " (training split)", src.vocab_size)
        self.eval_src = TokenSource([arrays[big][cut:]], src.description + " (held-out split)", src.vocab_size)
        self.args = cfg.model.args()
        self.bf16 = device.type == "cuda"

    def model(self):
        torch.manual_seed(self.cfg.train.seed)
        return Transformer(self.args).to(self.device)

    def optimizer(self, model):
        o = self.cfg.optim
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)

    def loader(self, node):
        c = self.cfg
        return ShardedLoader(self.train_src, c.data.seq_len, c.train.micro_batch_size, shard=node,
                             num_shards=self.nodes, seed=c.train.seed, vocab_size=self.args.vocab_size)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def loss(self, model, inputs, targets):
        with self.autocast():
            logits = model(inputs.to(self.device))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.to(self.device).flatten())

    def inner_step(self, model, opt, batches, step):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, self.cfg)
        loss = self.loss(model, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        loss.backward()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, model, batches):
        model.eval()
        total = sum(float(self.loss(model, x, y)) for x, y in batches)
        model.train()
        return total / len(batches)


def setup(config_args: list, nodes: int, threads: int, eval_batches: int):
    """(config, device, Setup, the held-out batches) from the config's command-line fields (--config, --a.b)."""
    path, overrides, _ = parse_cli(config_args)
    cfg = load_config(path, overrides).validate()
    torch.set_num_threads(threads)
    dev = cfg.train.device
    device = torch.device("cuda" if dev == "cuda" or (dev == "auto" and torch.cuda.is_available()) else "cpu")
    s = Setup(cfg, nodes, device)
    ev = ShardedLoader(s.eval_src, cfg.data.seq_len, cfg.train.micro_batch_size, shard=0, num_shards=1, seed=12345,
                       vocab_size=s.args.vocab_size)
    return cfg, device, s, [ev.next_batch() for _ in range(eval_batches)]


def run_dp(s: Setup, eval_batches):
    model, loaders = s.model(), [s.loader(r) for r in range(s.nodes)]
    opt = s.optimizer(model)
    curve = []
    for step in range(1, s.cfg.train.steps + 1):
        curve.append(s.inner_step(model, opt, [ld.next_batch() for ld in loaders], step))
    return s.evaluate(model, eval_batches), curve, {}


def time_phases(s: Setup, dl, model, opt, ld, r: int, slowdowns: list, curve: dict) -> int:
    """Node r's inner steps in time phases on a virtual clock (the Trainer's rule, prime/trainer.py): a step that
    would end past the next outer step's time is not started, at most one outer step passes before the next inner
    step while the node's steps keep up (PhaseClock.keeps_up), and a synchronous outer step restarts the clock
    (the virtual clock has no compiling first step to meet after).
    Fills curve {nominal step: [losses]}; returns the inner steps trained."""
    from prime.phases import PhaseClock

    steps, H = s.cfg.train.steps, s.cfg.diloco.inner_steps
    tau = len(slowdowns) / sum(1.0 / x for x in slowdowns)
    now = [0.0]
    clock = PhaseClock(H, H * tau, clock=lambda: now[0], warmup=False)
    clock.start(0)
    nominal, trained = 0, 0

    def stops(res) -> bool:
        """After an outer step, if one ran: whether nominal steps stop passing there (the Trainer's _stops_at)."""
        if not res.did_sync:
            return False
        clock.outer()
        if not res.overlapped:  # every node leaves it together: the clock restarts
            clock.start(nominal)
            return True
        return clock.keeps_up(dl.steps_to_sync)  # an inner step before the next outer step

    def advance(k: int) -> None:
        nonlocal nominal
        for _ in range(max(0, min(k, steps - nominal))):
            nominal += 1
            if stops(dl.advance()):
                return

    while nominal < steps:
        if not clock.fits_before(nominal + dl.steps_to_sync):
            advance(dl.steps_to_sync)
            continue
        loss = s.inner_step(model, opt, [ld.next_batch()], nominal + 1)
        trained += 1
        now[0] += slowdowns[r]
        clock.stepped(slowdowns[r])
        k = 1 if clock.reached() > nominal else 0
        nominal += k
        curve.setdefault(max(1, nominal), []).append(loss)
        if not stops(dl.step(k)):
            advance(clock.reached() - nominal)
    return trained


def run_diloco(s: Setup, eval_batches, opts: dict, tag: str, slowdowns=None):
    from prime.comm import Ring, host_store

    cfg, n = s.cfg, s.nodes
    master = host_store("127.0.0.1", 0, timeout=timedelta(seconds=60))  # loopback only: the ring then needs no secret
    port = master.port
    models = [s.model() for _ in range(n)]  # here, not in the threads: torch's global RNG seeds the init
    curves = [[] for _ in range(n)]
    finals, errors, extra = [None] * n, [None] * n, [dict() for _ in range(n)]

    def node(r):
        try:
            store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
            ring = Ring(store, r, n, timeout=timedelta(seconds=120), job_id=f"fidelity-{tag}")
            model = models[r]
            opt = s.optimizer(model)
            ld = s.loader(r)
            d = cfg.diloco
            outer = dict(outer_lr=d.outer_lr, outer_momentum=d.outer_momentum, nesterov=d.nesterov,
                         block_size=d.block_size)
            outer.update(opts)  # a method may set its own outer update
            errs = []
            if slowdowns is not None:  # time phases: explicit step() / advance() on a virtual clock
                dl = DiLoCo(model, opt, ring, inner_steps=d.inner_steps, weights="tokens", **outer)
                by_nominal: dict = {}
                trained = time_phases(s, dl, model, opt, ld, r, slowdowns, by_nominal)
                last = float("nan")
                for step in range(1, cfg.train.steps + 1):  # a nominal step without an inner step: the last loss
                    last = sum(by_nominal[step]) / len(by_nominal[step]) if step in by_nominal else last
                    curves[r].append(last)
            else:
                dl = DiLoCo(model, opt, ring, inner_steps=d.inner_steps, **outer)
                trained = cfg.train.steps
                for step in range(1, cfg.train.steps + 1):
                    curves[r].append(s.inner_step(model, opt, [ld.next_batch()], step))
                    res = dl.step()
                    if res.did_sync and res.compression_error is not None:
                        errs.append(res.compression_error)
            dl.finish()
            outer = dl.outer_weights().clone()
            extra[r] = {"outer_steps": dl.outer_step, "since_sync": dl.since_sync,
                        "mean_int8_error": sum(errs) / len(errs) if errs else None,
                        "error_feedback": dl.error_feedback, "trained_steps": trained}
            finals[r] = (outer, [p.detach().clone() for p in model.parameters()])
            dl.close()
            ring.close()
        except BaseException as e:  # reported by the main thread
            errors[r] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    identical = all(torch.equal(finals[0][0], f[0]) for f in finals)
    model = s.model()
    with torch.no_grad():  # the final outer weights (every node holds the same)
        for p, w in zip(model.parameters(), finals[0][1]):
            p.copy_(w)
    curve = [sum(c[i] for c in curves) / n for i in range(cfg.train.steps)]
    info = dict(extra[0], outer_weights_identical=identical, trained_steps=[e["trained_steps"] for e in extra])
    return s.evaluate(model, eval_batches), curve, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--methods", default="dp,diloco-exact,diloco-int8,overlap-int8-eager,overlap-int8-eager@1/4",
                    help=f"comma list of {', '.join(METHODS)}; an overlap method may end in @F (overlap_steps = F x H)")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--slowdowns", default=None,
                    help="METHOD:t: each node's inner-step time, comma separated (e.g. 1,2: node 1 twice as slow)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default="benchmarks/results/fidelity")
    ap.add_argument("--replot", action="store_true", help="only redraw <out>.png from <out>.json")
    ap.add_argument("--merge-alpha", type=float, default=None,
                    help="eager-merge: the share of the start's offset kept (prime.fragments.MERGE_ALPHA, 0.5); a study "
                         "knob of this benchmark only")
    ap.add_argument("--stand-in-others", type=float, default=None,
                    help="eager-merge with overlap_steps < inner_steps: the weight of the local pseudo-gradient as a "
                         "stand-in for the other nodes' part of the average (prime.fragments.STAND_IN_OTHERS, 0.5; 1 "
                         "gives the whole stand-in of the first eager-merge); a study knob of this benchmark only")
    a, rest = ap.parse_known_args()
    if a.replot:
        with open(a.out + ".json") as f:
            saved = json.load(f)
        plot(saved["results"], saved["meta"], a.out)
        return 0
    for name, value in (("MERGE_ALPHA", a.merge_alpha), ("STAND_IN_OTHERS", a.stand_in_others)):
        if value is not None:
            setattr(prime.fragments, name, value)
    cfg, device, s, eval_batches = setup(rest, a.nodes, a.threads, a.eval_batches)
    methods = [m for m in a.methods.split(",") if m]
    slowdowns = [float(x) for x in a.slowdowns.split(",")] if a.slowdowns else None
    if slowdowns is not None and len(slowdowns) != a.nodes:
        raise SystemExit(f"--slowdowns gives {len(slowdowns)} nodes' speeds for --nodes {a.nodes}")

    def options(m):
        m, timed = (m[:-2], True) if m.endswith(":t") else (m, False)
        if timed and slowdowns is None:
            raise SystemExit(f"{m}:t needs --slowdowns")
        m, _, frags = m.partition(":f")
        base, _, frac = m.partition("@")
        known = method_options(base)
        if base == "dp" and not (frac or frags or timed):
            return None  # data parallel: no DiLoCo options
        if known is None or (frac and not known.get("overlap")) or (frags and not frags.isdigit()):
            raise SystemExit(f"unknown method {m!r}; choose from {list(METHODS)} (overlap ones may end in @F, "
                             "DiLoCo ones in :fP)")
        extra = {"fragments": int(frags)} if frags else {}
        if timed:
            extra["time_phases"] = True
        if not frac:
            return dict(known, **extra) if extra else known
        h = cfg.diloco.inner_steps
        num, _, den = frac.partition("/")
        steps = max(1, min(h, round(h * int(num) / int(den)))) if den else int(num)
        return dict(known, overlap_steps=steps, **extra)

    opts = {m: options(m) for m in methods}
    tokens = a.nodes * cfg.train.steps * cfg.train.micro_batch_size * cfg.data.seq_len
    machine = _machine(device)
    print(f"fidelity: model {cfg.model.name} ({sum(p.numel() for p in s.model().parameters()) / 1e6:.1f}M), "
          f"{a.nodes} nodes x {cfg.train.steps} steps x {cfg.train.micro_batch_size} x {cfg.data.seq_len} = "
          f"{tokens / 1e6:.2f}M tokens per method, H = {cfg.diloco.inner_steps}, on {device} ({machine})")
    epochs = tokens / max(1, s.train_src.num_tokens)
    print(f"data: {s.train_src.description}; the run reads {epochs:.2f} epochs of it (a run of several epochs "
          f"rewards memorizing)")
    results = {}
    for m in methods:
        t0 = time.perf_counter()
        if opts[m] is None:
            loss, curve, info = run_dp(s, eval_batches)
        else:
            o = dict(opts[m])
            timed = o.pop("time_phases", False)
            loss, curve, info = run_diloco(s, eval_batches, o, m.replace("/", "-").replace("@", "-").replace(":", "-"),
                                           slowdowns if timed else None)
            if "overlap_steps" in opts[m]:
                info["overlap_steps"] = opts[m]["overlap_steps"]
        results[m] = {"eval_loss": loss, "train_loss_last10": sum(curve[-10:]) / len(curve[-10:]),
                      "curve": curve, "wall_s": time.perf_counter() - t0, **info}
        print(f"  {m:22s} eval loss {loss:.4f}   train loss (last 10) {results[m]['train_loss_last10']:.4f}   "
              f"{results[m]['wall_s']:.0f} s" + ("" if "outer_weights_identical" not in info else
                                                  f"   outer weights identical: {info['outer_weights_identical']}"))
    ref = results.get("diloco-exact", {}).get("eval_loss")
    dp = results.get("dp", {}).get("eval_loss")
    print(f"\n| method | final eval loss | vs DiLoCo exact | vs data parallel |\n|---|---|---|---|")
    for m, r in results.items():
        rel = f"{100 * (r['eval_loss'] / ref - 1):+.2f}%" if ref else "n/a"
        rdp = f"{100 * (r['eval_loss'] / dp - 1):+.2f}%" if dp else "n/a"
        print(f"| {m} | {r['eval_loss']:.4f} | {rel} | {rdp} |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
    meta = {"model": cfg.model.name, "nodes": a.nodes, "steps": cfg.train.steps, "inner_steps": cfg.diloco.inner_steps,
            "batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len, "tokens_per_method": tokens,
            "device": str(device), "machine": machine, "argv": sys.argv[1:], "merge_alpha": prime.fragments.MERGE_ALPHA,
            "stand_in_others": prime.fragments.STAND_IN_OTHERS, "slowdowns": slowdowns,
            "data": s.train_src.description, "epochs": epochs}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + list(results))
        for i in range(cfg.train.steps):
            w.writerow([i + 1] + [f"{results[m]['curve'][i]:.5f}" for m in results])
    plot(results, meta, a.out)
    return 0


def plot(results: dict, meta: dict, out: str) -> None:
    """<out>.png: the training-loss curves and the final held-out losses (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot; the curves are in {out}.csv")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    k = max(1, meta["inner_steps"])
    for m, r in results.items():
        c = r["curve"]
        smooth = [sum(c[max(0, i - k + 1) : i + 1]) / len(c[max(0, i - k + 1) : i + 1]) for i in range(len(c))]
        ax1.plot(range(1, len(c) + 1), smooth, label=m)
    ax1.set_xlabel("inner step")
    ax1.set_ylabel(f"training loss (moving mean of {k})")
    ax1.legend()
    names = list(results)
    ax2.bar(range(len(names)), [results[m]["eval_loss"] for m in names])
    ax2.set_xticks(range(len(names)), names, rotation=30, ha="right")
    lo = min(results[m]["eval_loss"] for m in names)
    ax2.set_ylim(lo * 0.97, max(results[m]["eval_loss"] for m in names) * 1.01)
    ax2.set_ylabel("final held-out loss")
    fig.suptitle(f"{meta['model']}, {meta['nodes']} nodes, H = {meta['inner_steps']}, "
                 f"{meta['tokens_per_method'] / 1e6:.2f}M tokens per method ({meta['machine']})")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    print(f"plot: {out}.png")


def _machine(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        return f"{name}, {os.cpu_count()} cores"
    except (OSError, StopIteration):
        return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
