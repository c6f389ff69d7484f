"""The collector's pause around planning: it freezes what was alive only in the outermost block, and restores."""

import gc
import sys
import weakref

import pytest

from primepar_fx.utils.gcpause import collect, gc_paused, paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    gc.unfreeze()
    yield
    gc.unfreeze()
    if not was:
        gc.disable()


_YOUNG = 10_000


def _young() -> list[list[int]]:
    """``_YOUNG`` tracked objects, alive (while the caller holds them) outside the permanent generation."""
    return [[i] for i in range(_YOUNG)]


def _still_frozen_as(count: int) -> bool:
    """The permanent generation holds what it held at ``count``, give or take the few frozen objects reference
    counting frees meanwhile (a test runner's threads may do so at any time). Neither a second freeze (which would
    take in the caller's ``_young()`` objects, and more) nor an unfreeze (0) passes."""
    now = gc.get_freeze_count()
    return count - _YOUNG // 10 < now <= count


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_outermost_block_freezes_what_was_alive_and_collect_frees_only_what_it_made(collector_on):
    old = _Cycle()
    old_alive = weakref.ref(old)
    with paused():
        assert not gc.isenabled()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        del old  # garbage from before the block: frozen, so not walked by collect()
        new = _Cycle()
        new_alive = weakref.ref(new)
        del new
        assert collect() >= 1
        assert new_alive() is None and old_alive() is not None
        young = _young()
        with paused():  # nested: nothing frozen again, nothing handed back early
            assert _still_frozen_as(frozen)
        assert _still_frozen_as(frozen)
        del young
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    gc.collect()  # the old cycle, handed back to the collector, is freed now
    assert old_alive() is None


def test_a_freeze_the_caller_made_is_left_as_it_was(collector_on):
    gc.freeze()
    before = gc.get_freeze_count()
    young = _young()
    with paused():
        assert _still_frozen_as(before)
    assert _still_frozen_as(before)
    del young


def test_a_disabled_collector_stays_disabled_and_unfrozen():
    was = gc.isenabled()
    gc.disable()
    try:
        gc_paused(lambda: None)()
        assert not gc.isenabled()
        assert gc.get_freeze_count() == 0
    finally:
        if was:
            gc.enable()


def test_an_error_inside_still_restores(collector_on):
    with pytest.raises(RuntimeError), paused():
        raise RuntimeError("boom")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_collect_frees_what_was_made_since_the_last_and_leaves_the_survivors_to_the_end(collector_on):
    with paused():
        kept = _Cycle()
        kept_alive = weakref.ref(kept)
        collect()  # kept survives: it is old now, and the next calls do not walk it
        if sys.version_info < (3, 14):  # 3.14's incremental collector numbers its generations otherwise
            assert any(o is kept for o in gc.get_objects(generation=2))
        new = _Cycle()
        new_alive = weakref.ref(new)
        del new, kept
        assert collect() >= 1
        assert new_alive() is None and kept_alive() is not None  # old garbage waits for the full collection
    gc.collect()
    assert kept_alive() is None
