"""How much of one pseudo-gradient a sparse and a low-rank code keep at the same bytes.

Trains a model (configs' presets, byte tokens of the embedded corpus or a text directory) for --warm steps, then
takes one pseudo-gradient of H more inner steps and, for every 2-D weight, keeps either topk's selection (the
largest --k magnitudes of every chunk of 4096 values of the flattened matrix, exact values: the 2-bit
quantization left out, in topk's favour) or the truncated SVD of the rank whose int8 factors (one byte a value,
scales left out) fit the selection's bytes (--bytes-per-value, topk's 0.0222 by default). Prints the relative L2
error of each over all those weights (and per shape), one run, no error feedback: the first round's share of the
signal each keeps.

    python3 benchmarks/bench_pg_rank.py --model 150M --warm 20 --h 5 --batch 4 --seq 128
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from prime.data import ShardedLoader, load_source
from prime.model import Transformer, preset


def topk_kept(m: torch.Tensor, k: int, chunk: int = 4096) -> torch.Tensor:
    flat = m.flatten()
    n = flat.numel()
    pad = (-n) % chunk
    x = torch.cat([flat, flat.new_zeros(pad)]).view(-1, chunk)
    idx = x.abs().topk(min(k, chunk), dim=1).indices
    out = torch.zeros_like(x).scatter_(1, idx, x.gather(1, idx))
    return out.flatten()[:n].view_as(m)


def low_rank(m: torch.Tensor, r: int) -> torch.Tensor:
    if r <= 0:
        return torch.zeros_like(m)
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return ((u[:, :r] * s[:r]) @ vh[:r]).to(m.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="150M")
    ap.add_argument("--warm", type=int, default=20, help="inner steps before the measured pseudo-gradient")
    ap.add_argument("--h", type=int, default=5, help="inner steps of the measured pseudo-gradient")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--k", type=int, default=48, help="values kept per chunk of 4096 (topk's density)")
    ap.add_argument("--bytes-per-value", type=float, default=0.0222, help="the byte budget of the low-rank code")
    ap.add_argument("--data", default="", help="a directory of text files (default: the embedded corpus)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the result as JSON here")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    src = load_source("text" if a.data else "embedded", a.data)
    args = preset(a.model)
    model = Transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    loader = ShardedLoader(src, a.seq, a.batch, shard=0, num_shards=1, seed=a.seed, vocab_size=args.vocab_size)
    t0 = time.perf_counter()

    def steps(n):
        for _ in range(n):
            x, y = loader.next_batch()
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss = steps(a.warm)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2}
    loss = steps(a.h)
    rows, tot = {}, {"pg": 0.0, "topk": 0.0, "lowrank": 0.0}
    for n, p in model.named_parameters():
        if n not in before:
            continue
        g = (before[n] - p.detach()).float()
        m_, n_ = g.shape
        r = int(a.bytes_per_value * m_ * n_ // (m_ + n_))
        e_top = float((g - topk_kept(g, a.k)).pow(2).sum())
        e_low = float((g - low_rank(g, r)).pow(2).sum())
        sq = float(g.pow(2).sum())
        key = f"{m_}x{n_}"
        row = rows.setdefault(key, {"rank": r, "pg": 0.0, "topk": 0.0, "lowrank": 0.0, "count": 0})
        row["pg"] += sq
        row["topk"] += e_top
        row["lowrank"] += e_low
        row["count"] += 1
        tot["pg"] += sq
        tot["topk"] += e_top
        tot["lowrank"] += e_low
    print(f"{a.model}: {a.warm} steps, then a pseudo-gradient of {a.h} (loss {loss:.3f}), batch {a.batch} x {a.seq}, "
          f"{time.perf_counter() - t0:.0f} s; topk {a.k} of 4096 against int8 factors of {a.bytes_per_value} bytes a "
          f"value; relative L2 error (1: nothing kept)")
    for key, row in sorted(rows.items()):
        print(f"  {row['count']:3d} x {key:>11s}: topk {math.sqrt(row['topk'] / row['pg']):.3f}, rank {row['rank']:3d} "
              f"{math.sqrt(row['lowrank'] / row['pg']):.3f}")
    print(f"  all 2-D weights: topk {math.sqrt(tot['topk'] / tot['pg']):.3f}, low rank "
          f"{math.sqrt(tot['lowrank'] / tot['pg']):.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "argv": sys.argv[1:], "shapes": rows, "total": tot}, f, indent=1)


if __name__ == "__main__":
    main()
