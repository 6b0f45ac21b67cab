"""The outer step's own passes (no all-reduce), outer state on the GPU against pinned CPU memory (streamed).

    python3 benchmarks/bench_outer.py --model 1B --repeats 3 --out results/outer.json     # on a GPU machine
    python3 benchmarks/bench_outer.py --model tiny --device cpu                            # smoke test, CPU only

For the model's parameters (fp32, on the GPU when there is one) it times, per outer-state device:
  prepare    pseudo-gradient and its squared norm (one pass per piece; a CPU state of a GPU model is
             streamed through the GPU: its pieces copied in on a side stream while the previous one is computed)
  int8_pass  the separate quantize/dequantize error pass (only needed while the ring does not report its
             own error, prime.sync.QUANT_ERROR_FIELDS)
  update     Nesterov update and the copy into the model (CPU state: pieces copied in and back out on side
             streams, both directions of PCIe at once)
  lookahead  the eager overlap's extra pass (next start point, copied into the model)
  lookahead_share  the same with eager-merge's shrunk stand-in (overlap_steps < inner_steps, two nodes:
             the pseudo-gradient times prime.diloco.stand_in_share(2) first)
and checks that the CPU and GPU states give the same bits (pseudo-gradient, outer weights, momentum, lookahead).
Medians over --repeats; JSON with every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prime.diloco import stand_in_share  # noqa: E402
from prime.model import Transformer, preset  # noqa: E402
from prime.outer import OuterState  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1B")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--devices", default="gpu,cpu", help="outer-state devices to time (comma list)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="the model's device")
    ap.add_argument("--threads", type=int, default=16, help="torch CPU threads (the CPU state's passes)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    args = preset(a.model)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=a.device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device(a.device))
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    devices = [d for d in a.devices.split(",") if d and (d != "gpu" or a.device == "cuda")]
    print(f"model {a.model}: {numel / 1e6:.1f}M parameters on {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else "") + f", outer state on {devices}")
    gen = torch.Generator().manual_seed(1)
    states, rows = {}, {}
    for dev in devices:
        t0 = time.perf_counter()
        st = OuterState(params, device=dev)  # the default block (int8's, 64)
        st.take()
        states[dev] = st
        print(f"  state on {dev} ({st.device}): allocated and taken in {time.perf_counter() - t0:.2f} s")
    # the same momentum everywhere, so that the bit comparison covers it
    mom = torch.empty(states[devices[0]].numel).normal_(generator=gen).mul_(1e-3)
    for st in states.values():
        st.momentum.copy_(mom)
    del mom
    perturb = [(1e-3 * torch.randn(p.shape, generator=gen)).to(a.device) for p in params[:4]]
    bufs = {dev: (st.new_buffer(), st.new_buffer()) for dev, st in states.items()}
    for dev, st in states.items():
        rows[dev] = {"prepare": [], "int8_pass": [], "update": [], "lookahead": [], "lookahead_share": []}
    bits, plain_look = {}, {}
    share = stand_in_share(2)
    for rep in range(a.repeats):
        with torch.no_grad():  # the inner steps: move a few parameters
            for p, d in zip(params, perturb):
                p.sub_(d)
        avg = None
        for dev, st in states.items():
            g, look = bufs[dev]
            rows[dev]["prepare"].append(_timed(lambda: st.pseudo_gradient(g)))
            rows[dev]["int8_pass"].append(_timed(lambda: st.int8_error_sq(g)))
            if avg is None:
                avg = g.detach().cpu() if dev != "cpu" else g.clone()  # stand-in for the average: the same everywhere
            g.copy_(avg)
            rows[dev]["lookahead"].append(_timed(lambda: st.lookahead(g, look, load=True)))
            if rep == 0:
                plain_look[dev] = look.cpu().clone()
            rows[dev]["lookahead_share"].append(_timed(lambda: st.lookahead(g, look, load=True, scale=share)))
            rows[dev]["update"].append(_timed(lambda: st.update(g, load=True)))
        if len(states) == 2 and rep == 0:
            c, gp = states["cpu"], states["gpu"]
            bits = {"outer": torch.equal(c.outer, gp.outer.cpu()),
                    "momentum": torch.equal(c.momentum, gp.momentum.cpu()),
                    "lookahead": torch.equal(plain_look["cpu"], plain_look["gpu"]),
                    "lookahead_share": torch.equal(bufs["cpu"][1], bufs["gpu"][1].cpu())}
            # both loaded their update into the same model; the GPU one ran last
            print(f"  CPU and GPU state identical after one outer step: {bits}")
    summary = {}
    print(f"\n  {'state':6} {'prepare':>9} {'int8_pass':>10} {'update':>9} {'lookahead':>10} {'la_share':>9} "
          f"{'outer step*':>12}   (median s)")
    for dev, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        med["outer_step"] = med["prepare"] + med["update"]
        summary[dev] = med
        print(f"  {dev:6} {med['prepare']:9.3f} {med['int8_pass']:10.3f} {med['update']:9.3f} "
              f"{med['lookahead']:10.3f} {med['lookahead_share']:9.3f} {med['outer_step']:12.3f}")
    print("  * prepare + update: the outer step beyond the all-reduce, without overlap and with the ring "
          "reporting its own int8 error")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "numel": numel, "device": a.device,
                       "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
                       "threads": a.threads, "samples": rows, "median": summary, "bits_identical": bits}, f, indent=1)
    return 0 if all(bits.values()) or not bits else 1


if __name__ == "__main__":
    sys.exit(main())
