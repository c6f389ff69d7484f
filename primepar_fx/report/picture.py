"""Which block of I, W and O every device holds at every step of a matrix product, drawn from the DSIs.

The picture of P(S x S) in ``docs/concepts.md`` is generated here, so it cannot drift from the code: every block
comes from :meth:`OpPartition.tensor_slice` (the DSIs of :mod:`primepar_fx.partition.dsi`) for the paper's
linear operator ``O[M,K] = I[M,N] . W[N,K]``, and the tensors of each phase from :func:`phase_tensors`::

    python -m primepar_fx.report.picture                  # Markdown tables (the block in docs/concepts.md)
    python -m primepar_fx.report.picture --svg > docs/img/prime_2x2.svg
    python -m primepar_fx.report.picture --seq K,P2x2 --digits 2,2,2

``tests/report/test_picture.py`` checks that the committed picture equals what this module draws now.
"""

from __future__ import annotations

import argparse
from html import escape

import sympy

from primepar_fx.partition.comm import phase_tensors
from primepar_fx.partition.dsi import PHASES, OpPartition, Phase, TensorSlice
from primepar_fx.partition.mesh import DeviceMesh
from primepar_fx.partition.seq import PartitionSeq
from primepar_fx.rules.spec import OpDims, TensorMap

#: per phase: its name, the formula it computes, and the tensors drawn (two operands, then the result)
FORMULAS: dict[Phase, tuple[str, str, tuple[str, str, str]]] = {
    Phase.FORWARD: ("Forward", "O = I · W", ("in0", "in1", "out0")),
    Phase.BACKWARD: ("Backward", "dI = dO · Wᵀ", ("d_out0", "in1", "d_in0")),
    Phase.GRADIENT: ("Gradient", "dW = Iᵀ · dO", ("in0", "d_out0", "d_in1")),
}
#: what the paper calls the tensors ``phase_tensors`` names ``in0``, ``in1`` and ``out0``
LETTERS = {"in0": "I", "in1": "W", "out0": "O"}
#: one fill colour per device (cycled past eight); a block held by several devices is grey
COLOURS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5")
SHARED = "#d9d9d9"


def linear_op(size: int = 4) -> OpDims:
    """The paper's linear ``O[M,K] = I[M,N] . W[N,K]`` (W a parameter) with every dim of ``size``."""
    n = sympy.Integer(size)
    return OpDims(
        "matmul",
        ("M", "N", "K"),
        (n, n, n),
        inputs=((("M",), ("N",)), (("N",), ("K",))),
        outputs=((("M",), ("K",)),),
        matmul=("M", "N", "K"),
        matmul_operands=(0, 1),
        flops=2 * n**3,
        weights=frozenset({1}),
    )


def label(name: str) -> str:
    """``in0`` -> ``I``, ``d_in1`` -> ``dW``."""
    return "d" + LETTERS[name[2:]] if name.startswith("d_") else LETTERS[name]


def block_index(piece: TensorSlice) -> tuple[int, ...]:
    """The block a tensor slice is, one index per tensor dim (a merged dim's indices read as one number)."""
    out = []
    for group in piece:
        v = 0
        for index, parts in group:
            v = v * parts + index
        out.append(v)
    return tuple(out)


def tensor_map(op: OpDims, name: str) -> TensorMap:
    """The tensor map of ``in0``, ``d_out0``, ... as :func:`phase_tensors` states it."""
    return next(pt.tmap for tensors in phase_tensors(op).values() for pt in tensors if pt.name == name)


def block_grid(part: OpPartition, name: str) -> tuple[int, ...]:
    """How many blocks the tensor ``name`` is cut into along each of its dims."""
    out = []
    for group in tensor_map(part.op, name):
        n = 1
        for d in group:
            n *= part.parts[d]
        out.append(n)
    return tuple(out)


def holdings(part: OpPartition) -> dict[tuple[Phase, int, int], dict[str, tuple[int, ...]]]:
    """``(phase, step, rank) -> {tensor label: block index}`` for the tensors of :data:`FORMULAS`."""
    out: dict[tuple[Phase, int, int], dict[str, tuple[int, ...]]] = {}
    for phase in PHASES:
        tmaps = {pt.name: pt.tmap for pt in phase_tensors(part.op)[phase]}
        for t in range(part.steps):
            for rank, coords in enumerate(part.mesh.devices()):
                out[phase, t, rank] = {
                    label(name): block_index(part.tensor_slice(phase, tmaps[name], coords, t))
                    for name in FORMULAS[phase][2]
                }
    return out


def bind(seq: str = "P2x2", digits: tuple[int, ...] = (2, 2)) -> OpPartition:
    """``seq`` bound to :func:`linear_op` on a mesh of ``digits``."""
    mesh = DeviceMesh(tuple(digits))
    return OpPartition(linear_op(max(4, mesh.size)), PartitionSeq.parse(seq), mesh)


def _where(part: OpPartition, rank: int) -> str:
    coords = part.mesh.coords(rank)
    if part.prime_digits:
        r, c = part.row_col(coords)
        return f"(r={r}, c={c})"
    return "D=" + "".join(str(d) for d in coords)


def _cell(blocks: dict[str, tuple[int, ...]], names: tuple[str, str, str]) -> str:
    a, b, res = (label(n) for n in names)

    def show(x: str) -> str:
        return f"{x}[{','.join(str(i) for i in blocks[x])}]"

    return f"{show(a)} · {show(b)} → {show(res)}"


def render_markdown(part: OpPartition) -> str:
    """One table per phase: a row per device, a column per step, each cell ``I[m,n] · W[n,k] → O[m,k]``."""
    held = holdings(part)
    lines = [
        f"`{part.seq}` of `O[M,K] = I[M,N] · W[N,K]` on devices {part.mesh.digits}, from "
        "`OpPartition.tensor_slice`; `X[i,j]` is block `i` of X's first dim and `j` of its second.",
    ]
    for phase in PHASES:
        name, formula, names = FORMULAS[phase]
        lines += ["", f"**{name}: {formula}**", ""]
        lines.append("| device | " + " | ".join(f"t = {t}" for t in range(part.steps)) + " |")
        lines.append("|---" * (part.steps + 1) + "|")
        for rank in range(part.mesh.size):
            cells = [_cell(held[phase, t, rank], names) for t in range(part.steps)]
            lines.append(f"| {rank} {_where(part, rank)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------ SVG
CELL, GAP, OP_W, PAD, TITLE_H, NAME_H, CHAR_W = 26, 28, 22, 16, 22, 18, 7


def _matrix_svg(
    x: float, y: float, name: str, grid: tuple[int, ...], owners: dict[tuple[int, ...], list[int]]
) -> list[str]:
    """One tensor as a grid of blocks, each filled and labelled with the device(s) holding it, named below."""
    rows, cols = (grid + (1, 1))[:2]
    out = []
    for i in range(rows):
        for j in range(cols):
            who = owners.get((i, j)[: len(grid)], [])
            fill = COLOURS[who[0] % len(COLOURS)] if len(who) == 1 else SHARED if who else "white"
            cx, cy = x + j * CELL, y + i * CELL
            out.append(f'<rect x="{cx}" y="{cy}" width="{CELL}" height="{CELL}" fill="{fill}" stroke="#333"/>')
            text = ",".join(str(k) for k in who)
            out.append(f'<text x="{cx + CELL / 2}" y="{cy + CELL / 2 + 4}" text-anchor="middle">{text}</text>')
    out.append(
        f'<text x="{x + cols * CELL / 2}" y="{y + rows * CELL + 14}" text-anchor="middle" '
        f'font-style="italic">{escape(name)}</text>'
    )
    return out


def render_svg(part: OpPartition) -> str:
    """The same holdings as a picture: per phase and step, the blocks of each tensor, filled with the colour and
    labelled with the rank of the device that holds them."""
    held = holdings(part)
    names = {phase: FORMULAS[phase][2] for phase in PHASES}
    grids = {n: block_grid(part, n) for ns in names.values() for n in ns}
    width_of = {n: (grids[n] + (1, 1))[1] * CELL for n in grids}
    height = max((grids[n] + (1, 1))[0] for n in grids) * CELL
    panel_w = max(sum(width_of[n] for n in ns) + 2 * OP_W for ns in names.values()) + GAP
    panel_h = TITLE_H + height + NAME_H + PAD
    left = 90
    legend = [f"device {rank} {_where(part, rank)}" for rank in range(part.mesh.size)]
    title = f"{part.seq} on devices {part.mesh.digits}: the block of each tensor every device holds at each step"
    total_w = max(left + part.steps * panel_w, sum(30 + CHAR_W * len(t) for t in legend), CHAR_W * len(title)) + PAD
    legend_y = PAD + TITLE_H + len(PHASES) * panel_h
    total_h = legend_y + 2 * TITLE_H
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
        f'viewBox="0 0 {total_w} {total_h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{total_w}" height="{total_h}" fill="white"/>',
        f'<text x="{PAD}" y="{PAD + 4}" font-weight="bold">{escape(title)}</text>',
    ]
    for p, phase in enumerate(PHASES):
        title, formula, ns = FORMULAS[phase]
        y0 = PAD + TITLE_H + p * panel_h
        out.append(f'<text x="{PAD}" y="{y0 + TITLE_H + height / 2}" font-weight="bold">{title}</text>')
        for t in range(part.steps):
            x = left + t * panel_w
            out.append(f'<text x="{x}" y="{y0 + 14}">t = {t}: {escape(formula)}</text>')
            for k, n in enumerate(ns):
                owners: dict[tuple[int, ...], list[int]] = {}
                for rank in range(part.mesh.size):
                    owners.setdefault(held[phase, t, rank][label(n)], []).append(rank)
                dims = ",".join("".join(group) for group in tensor_map(part.op, n))
                out += _matrix_svg(x, y0 + TITLE_H, f"{label(n)}[{dims}]", grids[n], owners)
                x += width_of[n]
                if k < 2:
                    sym, mid = "·" if k == 0 else "→", y0 + TITLE_H + height / 2 + 4
                    out.append(f'<text x="{x + OP_W / 2}" y="{mid}" text-anchor="middle">{sym}</text>')
                    x += OP_W
    x = PAD
    for rank, text in enumerate(legend):
        fill = COLOURS[rank % len(COLOURS)]
        out.append(f'<rect x="{x}" y="{legend_y}" width="14" height="14" fill="{fill}" stroke="#333"/>')
        out.append(f'<text x="{x + 18}" y="{legend_y + 11}">{escape(text)}</text>')
        x += 30 + CHAR_W * len(text)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m primepar_fx.report.picture", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="P2x2", help="partition sequence of the linear (default P2x2)")
    p.add_argument("--digits", default="2,2", help="device-ID digit radices (default 2,2)")
    p.add_argument("--svg", action="store_true", help="print the SVG picture instead of Markdown tables")
    args = p.parse_args(argv)
    part = bind(args.seq, tuple(int(d) for d in args.digits.split(",")))
    print(render_svg(part) if args.svg else render_markdown(part), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
