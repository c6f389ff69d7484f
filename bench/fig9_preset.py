"""Derive the ``v100-fig9`` cluster preset from the kernel and collective times of the paper's Fig. 9 (right).

Fig. 9 (right) is a timeline of one OPT-175B MLP block (fc1, ReLU, fc2) at batch 8 on 8 GPUs (2 nodes x 4 V100),
once under Megatron-LM (fc1 = {B,K,K}, fc2 = {B,N,N}: data-parallel 2 across the nodes, model-parallel 4 inside
a node) and once under PrimePar (fc1 = {K,P2x2}, fc2 = {N,P2x2}: K or N split across the nodes, P(S x S) inside
a node). It labels each kernel and each collective with its time in ms and says which tensor each collective
reduces. This script reads those numbers (typed in below, nothing else), turns each into a coefficient of our
cost model (:mod:`primepar_fx.cost.cluster`), and writes ``primepar_fx/cost/presets/v100-fig9.json``. Fig. 7 and 8
are not used: they are the held-out check (``bench/paper_fig7.py``).

    python bench/fig9_preset.py [--check]      # --check: compare with the shipped preset, write nothing

Two things the figure does not state are read off its own numbers (the steps below print the arithmetic):

* **Element size 4 bytes (fp32).** Each fc1/fc2 phase does 2.47e12 FLOP per GPU; at the figure's 162-169 ms that
  is 14.9 TFLOP/s: 95% of the V100's fp32 peak (15.7), or 12% of its fp16 tensor-core peak (125). cuBLAS SGEMM
  reaches the former; nothing reaches only the latter on GEMMs this large.
* **Sequence length 2048** (OPT's context). Megatron's inter-node all-reduces reduce a weight (no S in its size)
  and PrimePar's reduce an activation (linear in S); at S = 2048 the two give the same per-byte time (1.6 and
  1.3-1.6 GB/s per GPU), at S = 1024 they would differ by 2x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from primepar_fx.cost.cluster import (
    DEFAULT_BYTES_EFFICIENCY,
    DEFAULT_FLOPS_EFFICIENCY,
    DEFAULT_LINK_EFFICIENCY,
    LinkLevel,
    load_cluster,
)
from primepar_fx.cost.latency import ComputeModel, LinearLatency, ring_factors

OUT = Path(__file__).resolve().parents[1] / "primepar_fx" / "cost" / "presets" / "v100-fig9.json"

# ---- OPT-175B's MLP at Fig. 9's batch, and the two readings above
H, FFN, BATCH, SEQ, ITEM = 12288, 4 * 12288, 8, 2048, 4
ACT = BATCH * SEQ * H  # elements of fc1's input I and of fc2's output O
WEIGHT = H * FFN  # elements of fc1's or fc2's weight W

# ---- Fig. 9 (right), every number it prints, in ms
MEGATRON_KERNELS = {"fc1.F": 167, "fc2.F": 168, "fc2.B": 165, "fc2.G": 166, "fc1.B": 162, "fc1.G": 164}
PRIMEPAR_KERNELS = {  # two ring steps per phase (P2x2 inside a node)
    "fc1.F": (81, 81),
    "fc2.F": (82, 82),
    "fc2.B": (80, 88),
    "fc2.G": (81, 88),
    "fc1.B": (85, 82),
    "fc1.G": (86, 82),
}
# (label, group size, elements one GPU reduces, ms): Megatron's (1)-(4), then PrimePar's (1)-(2)
INTRA_NODE = [
    ("Megatron (1): fc2 {B,N,N} reduces size(O)/2 over its 4 model-parallel GPUs", 4, ACT // 2, 24),
    ("Megatron (3): fc1 {B,K,K} reduces size(I)/2 over its 4 model-parallel GPUs", 4, ACT // 2, 41),
]
INTER_NODE = [
    ("Megatron (2): fc2 {B,N,N} reduces size(W)/4 over the 2 data-parallel nodes", 2, WEIGHT // 4, 364),
    ("Megatron (4): fc1 {B,K,K} reduces size(W)/4 over the 2 data-parallel nodes", 2, WEIGHT // 4, 377),
    ("PrimePar (1): fc2 {N,P2x2} reduces size(O)/4 over the 2 nodes", 2, ACT // 4, 157),
    ("PrimePar (2): fc1 {K,P2x2} reduces size(I)/4 over the 2 nodes", 2, ACT // 4, 128),
]


def gemm_phase() -> tuple[float, float]:
    """FLOPs and bytes (read A, read B, write C) of one fc1/fc2 phase on one of the 8 GPUs, as our model counts
    them (``cost.model.node_cost``: the phase's tensors' blocks). Every phase (F, B, G) of both linears has the
    same: two B*S*H/2 x ... products with one H x 4H/4 block (Megatron) or the same volume in two ring steps."""
    flops = 2 * BATCH * SEQ * H * FFN / 8
    elements = 2 * (ACT // 2) + WEIGHT // 4  # Megatron's blocks: I/2 (or dO/2), W/4, O/2 (or dI/2, dW/4)
    return flops, elements * ITEM


def derive(paper_path: str = "v100-paper") -> tuple[dict, list[str]]:
    """The preset (as a dict) and the reading, step by step."""
    paper = load_cluster(paper_path)
    steps: list[str] = []
    say = steps.append

    # --- compute: the kernels
    flops, nbytes = gemm_phase()
    phases = list(MEGATRON_KERNELS.values()) + [sum(p) for p in PRIMEPAR_KERNELS.values()]
    t_gemm = sum(phases) / len(phases) / 1e3
    bytes_coeff = 1.0 / (paper.device.memory_bandwidth * DEFAULT_BYTES_EFFICIENCY)
    fixed = paper.device.op_overhead
    flops_coeff = (t_gemm - bytes_coeff * nbytes - fixed) / flops
    rate = 1.0 / flops_coeff
    say(
        f"compute: each phase of fc1 or fc2 does {flops:.4g} FLOP and moves {nbytes / 1e9:.3f} GB on one GPU; "
        f"the 12 phases of the figure (Megatron's 6 kernels, PrimePar's 6 pairs of ring steps) take "
        f"{min(phases)}-{max(phases)} ms, mean {1e3 * t_gemm:.2f} ms. Less the memory term v100-paper keeps "
        f"({1e3 * bytes_coeff * nbytes:.2f} ms at 80% of 900 GB/s) and the 5 us launch: {rate / 1e12:.2f} TFLOP/s "
        f"= {rate / paper.device.peak('fp32'):.0%} of the fp32 peak, so matmul:fp32 flops_coeff = {flops_coeff:.4e} s"
    )
    att_rate = rate * DEFAULT_FLOPS_EFFICIENCY["attention"] / DEFAULT_FLOPS_EFFICIENCY["matmul"]
    say(
        f"attention is not in the figure: its rate is the matmul rate times v100-paper's attention/matmul efficiency "
        f"ratio (0.5/0.6), {att_rate / 1e12:.2f} TFLOP/s"
    )
    compute = {
        "matmul:fp32": ComputeModel(flops_coeff, bytes_coeff, fixed),
        "attention:fp32": ComputeModel(1.0 / att_rate, bytes_coeff, fixed),
    }

    # --- the two link levels: seconds per bus byte (ring bus traffic, cost.cluster.ring_factors)
    def per_bus_byte(samples: list[tuple[str, int, int, float]], level: str) -> float:
        xs, ys = [], []
        for label, group, elements, ms in samples:
            bus = ring_factors("all-reduce", group)[0] * elements * ITEM
            xs.append(bus)
            ys.append(ms / 1e3)
            mb = elements * ITEM / 1e6
            say(
                f"{level}: {label}: {mb:.1f} MB per GPU, {bus / 1e6:.1f} MB of ring traffic in {ms} ms "
                f"= {bus / ms / 1e6:.2f} GB/s"
            )
        coeff = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)  # least squares through 0
        say(
            f"{level}: all-reduce bytes_coeff = {coeff:.4e} s per bus byte ({1 / coeff / 1e9:.2f} GB/s per GPU), "
            "least squares through the origin (the messages are 200-600 MB: a per-step latency of microseconds is "
            "invisible in them, so v100-paper's is kept)"
        )
        return coeff

    per_node = paper.devices_per_node
    intra = per_bus_byte(INTRA_NODE, "intra-node")
    inter = per_bus_byte(INTER_NODE, "inter-node")
    say(
        f"inter-node: the {per_node} GPUs of a node reduce at once, {per_node / inter / 1e9:.1f} GB/s per node: "
        f"{per_node / inter / 12.5e9:.0%} of EDR InfiniBand's 12.5 GB/s (v100-edr), "
        f"{per_node / inter / 100e9:.1%} of the 100 GB/s v100-paper reads in the text"
    )
    say(
        "other collectives are not in the figure: all-gather and reduce-scatter move ring bus bytes on the same "
        "links, so they get the all-reduce's coefficient; all-to-all and p2p keep v100-paper's efficiency relative "
        "to it (0.6 and 0.9 against 0.8). The ring shifts of PrimePar's P(S x S) hide under its 80-88 ms ring steps "
        "(the thin bars), which bounds them but does not give a rate; a message to one NVLink peer keeps "
        f"v100-paper's share of the links ({paper.levels[0].peer_bandwidth / paper.levels[0].bandwidth:.3g} of "
        "them, intra-node peer_bandwidth)"
    )
    levels = []
    for old, coeff in zip(paper.levels, (intra, inter)):
        eff = DEFAULT_LINK_EFFICIENCY
        colls = {
            kind: LinearLatency(float(f"{coeff * eff['all-reduce'] / eff[kind]:.6g}"), old.collectives[kind].fixed)
            for kind in old.collectives
        }
        bandwidth = float(f"{eff['all-reduce'] / coeff:.6g}")
        peer = None if old.peer_bandwidth is None else float(f"{bandwidth / old.peer_factor:.6g}")
        levels.append(LinkLevel(old.name, bandwidth, colls, peer))
    device = dataclasses.replace(paper.device, compute=compute)
    description = (
        "The PrimePar paper's cluster (ASPLOS'24 §6: 8 nodes x 4 V100-SXM2 32 GB) with the coefficients read off "
        "the kernel and collective times of its Fig. 9 (right: one OPT-175B MLP block, batch 8, 8 GPUs, Megatron "
        "and PrimePar), as bench/fig9_preset.py derives them; Fig. 7 and 8 are not used (held out). "
        + " ".join(s.rstrip(".") + "." for s in steps)
        + " Not read from the figure, so v100-paper's: the device's peaks and memory, the other op families' "
        "models, and every per-step latency (fixed)."
    )
    spec = dataclasses.replace(
        paper,
        name="v100-fig9",
        description=description,
        source="read off the paper's Fig. 9 (its kernel and collective times, in ms); see description",
        calibrated=False,
        device=device,
        levels=tuple(levels),
    )
    return spec.to_dict(), steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the shipped preset; write nothing")
    args = p.parse_args()
    spec, steps = derive()
    for i, s in enumerate(steps, 1):
        print(f"{i:2d}. {s}")
    text = json.dumps(spec, indent=2, ensure_ascii=False) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT.name}: {'up to date' if same else 'differs from this derivation'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    assert math.isclose(ACT * 2, 2 * 8 * 2048 * 12288)
    sys.exit(main())
