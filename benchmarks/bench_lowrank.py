"""A low-rank outer step against int8 and topk, in training: final loss at equal tokens, one process, no ring.

    nice python3 benchmarks/bench_lowrank.py --config configs/demo.toml --train.steps 800 --diloco.inner_steps 5 \
        --methods int8,topk,lowrank --out benchmarks/results/lowrank/tiny_s1

A study harness, not the product's path: the N nodes (threads of this process) train as bench_fidelity's do (its
Setup: the same model, shards, learning-rate schedule and held-out batches), and every H inner steps their
pseudo-gradients (outer - local) are averaged here, in plain torch, by one of:

  none          no outer step at all: each node trains alone on its shard, and node 0's model is evaluated (what
                the nodes reach without communicating: the floor every codec is measured against)
  int8          each contribution through the int8 codec (blocks of 64) and averaged; outer lr 1, no momentum
                (bench_fidelity's diloco-int8-plain up to the ring's order of additions)
  topk          prime.sparse.owner_average, the topk collective's arithmetic bit for bit, with topk's defaults
                (48 / 96 of every 4096 values, error feedback decayed by 0.8, outer lr 3, no momentum) over the
                parameters as one flat vector (bench_fidelity's diloco-topk-defaults up to the fragment layout);
                -efDD (0.DD; -ef1.0: 1) and -lrX set the decay and the outer lr; topk-keep: after the outer
                step each node's weights are the outer weights minus its decayed residual (what it did not send
                stays in its weights, not undone until it returns through the residual), and the
                pseudo-gradient, outer - local, holds it.
                topk-...-taper: the outer lr goes linearly from its value to 1 over the inner lr's decay;
                topk-...-endW: a dense end, the last W outer steps as int8 does them (lr 1), the first of them
                with each node's decayed residual added, so that nothing is left unsent; topk-...-soloW: the
                last W - 1 outer steps skipped (each node trains on from its own weights, as none does) and the
                last one as the dense end's first; -endW-drop (or -soloW-drop): the residuals left out, not sent
                with the dense end's first outer step (what flushing them at once costs);
                topk-kK-aA keeps K / A of every 4096 (48 / 96); topk-exact sends the selections' values exact
                (fp32) where the codec has 2 bits and a scale per half-chunk: what the value coding costs.
                A topk run also reports eval_loss_flushed: the loss after one more outer step that would send the
                decayed residuals whole (exact), at int8's bytes once (with keep: the mean of the nodes' weights)
  randk         random blocks: every outer step the same 1 / D of the pseudo-gradient's blocks of 64 on every node
                (drawn from the seed and the outer step, so no positions go on the wire), each node's blocks
                through a dense block codec (fp4 or int8) and averaged, error feedback on the rest (residual =
                what the node did not send, and its selection's coding error); randk-dD-CODEC[-keep][-efDD][-lrX]
                (default: D 16, fp4, decay 1, outer lr 1): 1/16 of the blocks at fp4's 33 bytes per 64 values
                is 0.032 bytes a value, 1/31 of int8's; -keep as topk's (the unsent part stays in the weights)
  lowrank       PowerSGD's shape for every 2-D weight (Vogels et al., 2019): with Q (n x r) shared by all nodes,
                P = mean_i(M_i Q), orthonormalized, Q = mean_i(M_i^T P), the average taken as P Q^T, each mean
                through the int8 codec column by column; M_i = pseudo-gradient + decay x residual and
                residual = M_i - P Q_i^T (each node's own error); Q starts random (the same seed everywhere)
                and each round starts from the last one's. The rank r of an m x n weight is the largest whose
                int8 factors, (m + n) r values at 65 bytes per 64, fit --bytes-per-value (topk's 0.0222 by
                default) of its m n values; a weight where even rank 1 does not fit, and every 1-D parameter,
                is averaged as int8. lowrank-bB.BBB sets the bytes a value, -efDD the decay 0.DD (unset: 1.0),
                -lrX the outer lr of the low-rank weights (default 1; the int8 ones always take 1)

Prints and writes <out>.json in bench_fidelity's layout (meta, results with eval_loss, train_loss_last10, curve),
plus, for lowrank, the ranks and the bytes a value it sent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_fidelity import Setup, _machine, setup  # noqa: E402
from bench_pg_rank import topk_kept  # noqa: E402
from prime import feedback, sparse  # noqa: E402

INT8_BYTES = 65 / 64
TOPK = dict(chunk=4096, k=48, k_average=96, decay=0.8, lr=3.0)
TOPK_SPEC = re.compile(r"topk(?:-k(\d+)-a(\d+))?(-exact)?(-keep)?(?:-ef([\d.]+))?(?:-lr([\d.]+))?(-taper)?"
                       r"(?:-(end|solo)(\d+)(-drop)?)?$")
RANDK_SPEC = re.compile(r"randk(?:-d(\d+))?(?:-(fp4|int8))?(-keep)?(?:-ef([\d.]+))?(?:-lr([\d.]+))?$")
CODEC_BYTES = {"int8": 65 / 64, "fp4": 33 / 64}
LOWRANK_SPEC = re.compile(r"lowrank(?:-b([\d.]+))?(?:-ef([\d.]+))?(?:-lr([\d.]+))?(?:-it(\d+))?(-svd)?$")


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    return feedback.round_trip(x.contiguous(), "int8", 64)


def int8_mean(xs: list) -> torch.Tensor:
    return sum(int8_round_trip(x) for x in xs) / len(xs)


def factor_mean(xs: list) -> torch.Tensor:
    """int8_mean of m x r factors, quantized column by column (blocks of 64 of one column: the columns' norms are the
    singular values', far apart, and a block across a row would quantize the small ones with the large one's scale)."""
    return int8_mean([x.t().contiguous() for x in xs]).t()


def rank_for(shape: tuple, bytes_per_value: float) -> int:
    """The largest r whose int8 factors ((m + n) r values) fit bytes_per_value of the m n values; 0 for none."""
    m, n = shape
    return int(bytes_per_value * m * n // (INT8_BYTES * (m + n)))


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p.double(), mode="reduced").Q.to(p.dtype)


class LowRank:
    """PowerSGD's round over N nodes' m x n matrices, one Q carried from round to round."""

    def __init__(self, shape: tuple, r: int, nodes: int, decay: float, seed: int, device=None, iterations: int = 1,
                 svd: bool = False):
        self.iterations, self.svd = iterations, svd
        g = torch.Generator().manual_seed(seed)
        self.q = orthonormal(torch.randn(shape[1], r, generator=g)).to(device)
        self.residual = [torch.zeros(shape, device=device) for _ in range(nodes)]
        self.decay = decay

    def average(self, deltas: list) -> torch.Tensor:
        ms = [d + self.decay * e for d, e in zip(deltas, self.residual)]
        if self.svd:  # the bound: the truncated SVD of the exact mean (no wire could carry it at these bytes)
            u, _, _ = torch.linalg.svd((sum(ms) / len(ms)).double(), full_matrices=False)
            p = u[:, : self.q.shape[1]].to(ms[0].dtype)
            qs = [m.t() @ p for m in ms]
            self.q = sum(qs) / len(qs)
        for _ in range(0 if self.svd else self.iterations):
            p = orthonormal(factor_mean([m @ self.q for m in ms]))
            qs = [m.t() @ p for m in ms]
            self.q = factor_mean(qs)
        for i, (m, qi) in enumerate(zip(ms, qs)):
            self.residual[i] = m - p @ qi.t()
        return p @ self.q.t()

    def bytes(self) -> int:
        """The int8 factors' bytes one round puts in each all-reduce's payload (P and Q)."""
        return round(INT8_BYTES * (self.residual[0].shape[0] + self.residual[0].shape[1]) * self.q.shape[1]
                     * self.iterations)


def exact_coding(x: torch.Tensor, chunk: int, k: int) -> tuple:
    """prime.sparse.owner_average's coding with the selection's values exact (fp32), not at 2 bits: the same
    positions; its bytes counted as the coded payload's."""
    return topk_kept(x, k, chunk), sparse.payload_bytes(x.numel(), chunk, k)


def outer_lr(method: dict, step: int, cfg) -> float:
    """topk's outer lr at the outer step after inner step `step`: the method's, or with -taper going linearly from it
    to 1 over the inner lr's decay (the last optim.decay_steps steps)."""
    lr = method["lr"]
    if not method.get("taper") or cfg.optim.decay_steps <= 0:
        return lr
    start = cfg.train.steps - cfg.optim.decay_steps
    return lr + (1.0 - lr) * min(1.0, max(0.0, (step - start) / cfg.optim.decay_steps))


def _decay(spelled: str) -> float:
    """-efDD: 0.DD (ef8 0.8, ef95 0.95); with a point, the number itself (ef1.0)."""
    return float(spelled) if "." in spelled else int(spelled) / 10 ** len(spelled)


def parse_method(m: str) -> dict:
    if m in ("int8", "none"):
        return {"kind": m}
    got = TOPK_SPEC.match(m)
    if got:
        k, ka, exact, keep, ef, lr, taper, end_kind, end, drop = got.groups()
        if drop and keep:
            raise SystemExit(f"{m}: -drop leaves out the residuals at the dense end, which -keep holds in the weights")
        return {"kind": "topk", "keep": bool(keep), "decay": _decay(ef) if ef else TOPK["decay"],
                "lr": float(lr) if lr else TOPK["lr"], "k": int(k) if k else TOPK["k"],
                "k_average": int(ka) if ka else TOPK["k_average"], "exact": bool(exact), "taper": bool(taper),
                "dense_end": int(end) if end else 0, "solo": end_kind == "solo", "drop": bool(drop)}
    got = RANDK_SPEC.match(m)
    if got:
        d, codec, keep, ef, lr = got.groups()
        return {"kind": "randk", "fraction": int(d) if d else 16, "codec": codec or "fp4", "keep": bool(keep),
                "decay": _decay(ef) if ef else 1.0, "lr": float(lr) if lr else 1.0}
    got = LOWRANK_SPEC.match(m)
    if got is None:
        raise SystemExit(f"unknown method {m!r}: none, int8, "
                         "topk[-kK-aA][-exact][-keep][-efDD][-lrX][-taper][-endW|-soloW][-drop], "
                         "randk[-dD][-fp4|-int8][-keep][-efDD][-lrX] or "
                         "lowrank[-bB][-efDD][-lrX][-itN][-svd]")
    b, ef, lr, it, svd = got.groups()
    return {"kind": "lowrank", "bytes_per_value": float(b) if b else 0.0222,
            "decay": _decay(ef) if ef else 1.0, "lr": float(lr) if lr else 1.0,
            "iterations": int(it) if it else 1, "svd": bool(svd)}


def random_blocks(numel: int, fraction: int, seed: int, outer_step: int) -> torch.Tensor:
    """The indices of the blocks of 64 that every node sends at this outer step: 1 / fraction of them (at least
    one), drawn from the seed and the outer step alone, sorted."""
    blocks = -(-numel // 64)
    g = torch.Generator().manual_seed(seed * 1_000_003 + outer_step)
    return torch.randperm(blocks, generator=g)[: max(1, blocks // fraction)].sort().values


def randk_average(flat: list, residual: list, method: dict, seed: int, outer_step: int) -> tuple:
    """(the average to apply, each node's new residual, the values sent a node): flat[i] is node i's pseudo-
    gradient with its decayed residual added; each node's chosen blocks go through the codec, the rest waits."""
    n, numel = len(flat), flat[0].numel()
    idx = random_blocks(numel, method["fraction"], seed, outer_step).to(flat[0].device)
    pad = -numel % 64
    avg = torch.zeros(numel + pad, device=flat[0].device)
    out = []
    for f in flat:
        blocks = torch.nn.functional.pad(f, (0, pad)).view(-1, 64)
        sent = int8_round_trip(blocks[idx]) if method["codec"] == "int8" else \
            feedback.round_trip(blocks[idx].contiguous(), "fp4", 64)
        avg.view(-1, 64)[idx] += sent / n
        kept = blocks.clone()
        kept[idx] -= sent
        out.append(kept.view(-1)[:numel])
    return avg[:numel], out, idx.numel() * 64


def shaped(flat: torch.Tensor, like: list) -> list:
    """Views of a flat tensor in the shapes of the tensors `like`, in their order."""
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like)]


@torch.no_grad()
def evaluate_seen(s: Setup, model, batches) -> dict:
    """Setup.evaluate's held-out loss ("eval_loss", the same arithmetic), in the same pass the loss over the tokens
    the data can hold (its tokenizer's vocabulary; 256 for bytes) and the probability mass the model puts on the
    other rows of a larger vocabulary (rows no token ever trains)."""
    seen = s.train_src.max_token_bound() or s.args.vocab_size
    full = loss = mass = 0.0
    model.eval()
    for x, y in batches:
        with s.autocast():
            logits = model(x.to(s.device))
        logits, y = logits.flatten(0, 1).float(), y.to(s.device).flatten()
        full += float(torch.nn.functional.cross_entropy(logits, y))
        mass += float(torch.log_softmax(logits, dim=-1)[:, seen:].exp().sum(-1).mean()) if logits.shape[-1] > seen \
            else 0.0
        loss += float(torch.nn.functional.cross_entropy(logits[:, :seen], y))
    model.train()
    return {"eval_loss": full / len(batches), "eval_loss_seen": loss / len(batches),
            "unseen_mass": mass / len(batches)}


def run(s: Setup, eval_batches, method: dict, seed: int):
    cfg, n, h = s.cfg, s.nodes, s.cfg.diloco.inner_steps
    models = [s.model() for _ in range(n)]
    opts = [s.optimizer(m) for m in models]
    loaders = [s.loader(r) for r in range(n)]
    outer = [p.detach().clone().float() for p in models[0].parameters()]  # on the models' device
    curves = [[] for _ in range(n)]
    kind = method["kind"]
    coders, residual, sent = {}, None, 0.0
    if kind == "lowrank":
        for i, p in enumerate(outer):
            r = rank_for(tuple(p.shape), method["bytes_per_value"]) if p.ndim == 2 else 0
            if r > 0:
                coders[i] = LowRank(tuple(p.shape), min(r, *p.shape), n, method["decay"], seed + i, p.device,
                                    method["iterations"], method["svd"])
    if kind in ("topk", "randk"):
        residual = [torch.zeros(sum(p.numel() for p in outer), device=outer[0].device) for _ in range(n)]

    def phase(r, first, last):
        for step in range(first, last + 1):
            curves[r].append(s.inner_step(models[r], opts[r], [loaders[r].next_batch()], step))

    outer_steps = -(-cfg.train.steps // h)
    dense_from = outer_steps - method.get("dense_end", 0)  # outer steps after this one are int8's (topk-...-endW)
    step = j = 0
    while step < cfg.train.steps:
        last = min(cfg.train.steps, step + h)
        threads = [threading.Thread(target=phase, args=(r, step + 1, last)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        step, j = last, j + 1
        if kind == "none" or (method.get("solo") and dense_from < j < outer_steps):
            continue  # no outer step: every node trains on alone on its shard
        with torch.no_grad():
            deltas = [[o - p.detach().float() for o, p in zip(outer, m.parameters())] for m in models]
            dense_end = kind == "topk" and j > dense_from  # int8, lr 1, the residuals sent with the first
            if kind == "topk":
                flat = [torch.cat([d.reshape(-1) for d in ds]) for ds in deltas]
                if not method["keep"] and not (dense_end and method["drop"]):
                    # (with keep the local weights hold the residual: outer - local has it)
                    flat = [f + method["decay"] * e for f, e in zip(flat, residual)]
            if kind == "randk":
                flat = [torch.cat([d.reshape(-1) for d in ds]) for ds in deltas]
                if not method["keep"]:
                    flat = [f + method["decay"] * e for f, e in zip(flat, residual)]
                avg, residual, values = randk_average(flat, residual, method, seed, j)
                sent += 2 * CODEC_BYTES[method["codec"]] * values * (n - 1) / n / flat[0].numel()
                for o, a in zip(outer, shaped(avg, outer)):
                    o.sub_(method["lr"] * a)
            elif dense_end:  # the int8 method's average below, of the contributions with their residuals
                deltas = [shaped(f, outer) for f in flat]
                residual = [torch.zeros_like(e) for e in residual]
            if kind == "topk" and not dense_end:
                coding = dict(coding=exact_coding) if method["exact"] else {}
                avg = sparse.owner_average(flat, TOPK["chunk"], method["k"], "avg", method["k_average"], **coding)
                residual = avg.residuals
                sent += sum(avg.sent) / n / flat[0].numel()
                lr = outer_lr(method, step, cfg)
                for o, a in zip(outer, shaped(avg.average, outer)):
                    o.sub_(lr * a)
            elif kind != "randk":
                total = 0
                for i, o in enumerate(outer):
                    ds = [d[i] for d in deltas]
                    if i in coders:
                        o.sub_(method["lr"] * coders[i].average(ds))
                        total += 2 * coders[i].bytes()
                    else:
                        o.sub_(int8_mean(ds))
                        total += 2 * INT8_BYTES * o.numel()  # the int8 ring: 2 (N - 1) / N of its values
                sent += total * (n - 1) / n / sum(o.numel() for o in outer)  # P's and Q's ring all-reduces
            for r, m in enumerate(models):
                for p, o in zip(m.parameters(), outer):
                    p.copy_(o)
                if kind in ("topk", "randk") and method["keep"]:  # the node keeps what it did not send
                    for p, e in zip(m.parameters(), shaped(residual[r], outer)):
                        p.sub_(method["decay"] * e)
    if kind == "none":
        model = models[0]  # node 0, alone
    else:
        model = s.model()
        with torch.no_grad():
            for p, o in zip(model.parameters(), outer):
                p.copy_(o)
    curve = [sum(c[i] for c in curves) / n for i in range(cfg.train.steps)]
    info = {"outer_steps": outer_steps, "bytes_per_value_per_outer_step": sent / outer_steps}
    if kind == "topk":  # a last outer step that sends the decayed residuals whole (exact): what it would reach
        flushed = s.model()
        with torch.no_grad():
            for p, o, e in zip(flushed.parameters(), outer, shaped(sum(residual), outer)):
                p.copy_(o - method["decay"] * e / n)
        info["eval_loss_flushed"] = s.evaluate(flushed, eval_batches)
    if coders:
        info["ranks"] = {str(tuple(outer[i].shape)): c.q.shape[1] for i, c in coders.items()}
    info.update(evaluate_seen(s, model, eval_batches))
    return info.pop("eval_loss"), curve, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--methods", default="int8,topk,lowrank")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default="benchmarks/results/lowrank/run")
    a, rest = ap.parse_known_args()
    cfg, device, s, eval_batches = setup(rest, a.nodes, a.threads, a.eval_batches)
    methods = {m: parse_method(m) for m in a.methods.split(",") if m}
    tokens = a.nodes * cfg.train.steps * cfg.train.micro_batch_size * cfg.data.seq_len
    print(f"lowrank study: model {cfg.model.name}, {a.nodes} nodes x {cfg.train.steps} steps x "
          f"{cfg.train.micro_batch_size} x {cfg.data.seq_len}, H = {cfg.diloco.inner_steps}, on {device}; "
          f"data: {s.train_src.description}, {tokens / max(1, s.train_src.num_tokens):.2f} epochs", flush=True)
    results = {}
    for name, method in methods.items():
        t0 = time.perf_counter()
        loss, curve, info = run(s, eval_batches, method, cfg.train.seed)
        results[name] = {"eval_loss": loss, "train_loss_last10": sum(curve[-10:]) / len(curve[-10:]), "curve": curve,
                         "wall_s": time.perf_counter() - t0, **info}
        print(f"  {name:24s} eval loss {loss:.4f}   train loss (last 10) {results[name]['train_loss_last10']:.4f}   "
              f"{info['bytes_per_value_per_outer_step']:.4f} bytes a value   over the data's tokens "
              f"{info['eval_loss_seen']:.4f} (unseen rows' mass {info['unseen_mass']:.4f})   "
              f"{results[name]['wall_s']:.0f} s",
              flush=True)
    meta = {"model": cfg.model.name, "nodes": a.nodes, "steps": cfg.train.steps, "inner_steps": cfg.diloco.inner_steps,
            "batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len, "tokens_per_method": tokens,
            "device": str(device), "machine": _machine(device), "argv": sys.argv[1:], "data": s.train_src.description}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
