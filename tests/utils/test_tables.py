"""Folding the repeated layers of a per-node table (``primepar_fx.utils.tables``)."""

from __future__ import annotations

from primepar_fx.utils.tables import fold_repeats, repeated_block


def _layers(head: int, block: list[str], copies: int, tail: int) -> list[list[str]]:
    """Rows ``[name, op]``: ``head`` distinct rows, ``copies`` copies of ``block``, ``tail`` distinct rows."""
    ops = [f"head{i}" for i in range(head)] + block * copies + [f"tail{i}" for i in range(tail)]
    return [[f"n{i}", op] for i, op in enumerate(ops)]


def test_the_longest_repeated_block_is_found_with_its_period_and_copies() -> None:
    rows = _layers(3, ["norm", "linear", "add"], 10, 2)
    assert repeated_block([r[1] for r in rows]) == (3, 3, 9)
    assert repeated_block(["a", "b", "c", "d"]) is None
    assert repeated_block(["a", "b", "a", "b"]) is None  # one copy after the first block: not enough
    assert repeated_block(["x", "a", "a", "a", "a"]) == (1, 1, 3)


def test_folding_keeps_the_first_block_and_names_what_it_leaves_out() -> None:
    rows = _layers(3, ["norm", "linear", "add"], 50, 2)
    folded, note = fold_repeats(rows)
    assert [r[1] for r in folded] == [
        "head0", "head1", "head2", "norm", "linear", "add", "x49 the 3 rows above", "tail0", "tail1"
    ]  # fmt: skip
    assert folded[6][0] == "..."
    assert note == (
        "...: the 3 rows from n3 to n5 repeat 49 more times, from n6 to n152 "
        "(147 rows left out, the same but for the node names)"
    )


def test_short_or_unrepeated_tables_print_whole_and_keys_decide_equality() -> None:
    rows = _layers(3, ["norm", "linear", "add"], 10, 2)  # 35 rows
    assert fold_repeats(rows) == (rows, None)
    assert fold_repeats(rows, min_rows=10)[1] is not None
    distinct = [[f"n{i}", f"op{i}"] for i in range(200)]
    assert fold_repeats(distinct) == (distinct, None)
    # a key that ignores the op folds everything after the first row
    folded, note = fold_repeats(distinct, key=lambda r: 0)
    assert len(folded) == 2 and "199 more times" in note
