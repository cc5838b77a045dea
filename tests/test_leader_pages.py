"""Requests the engine freed with no connector call (s3kv/engine/leader/pages.py).

A recorded page of a live request -- its own prompt pages past its device match (full-attention
groups), or a page its parked load writes -- among another request's new pages means the engine
freed it. Nothing else may count: pages shared by block reuse, sliding pages a moving window
freed, pages past the prompt (speculative decoding gives back rejected drafts' pages), a replay's
earlier pages, a request that ended normally. A false alarm drops a live request's saves (or stops
its load); a missed one lets a parked load overwrite another request's KV.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

from test_leader_plan import FULL, SLIDING, TPB, geometry

from s3kv.core.plan import LoadOp, ObjectRef
from s3kv.engine.leader.pages import PageOwners
from s3kv.engine.leader.requests import RequestState
from s3kv.engine.leader.stats import LeaderStats


def _state(rid: int, prompt_blocks: int = 64, device_blocks: int = 0) -> RequestState:
    st = RequestState(rid, b"r" * 16, None, [], prompt_blocks * TPB)
    st.load.device_tokens = device_blocks * TPB
    return st


def _report(rid: int, full: list[int], sliding: list[int] | None = None, computed: int = 0) -> SimpleNamespace:
    lists: list[list[int]] = [[], []]
    lists[FULL], lists[SLIDING] = full, sliding or []
    return SimpleNamespace(request_id=rid, new_block_ids_by_layer_group=lists, computed_position=computed)


def _seen(pages: PageOwners, live: dict[int, RequestState], *reports: tuple[SimpleNamespace, bool]) -> set[int]:
    """What build_connector_meta does: fold each report into its state (a first report replaces
    the lists and starts a new epoch), then check the pages."""
    for rd, first in reports:
        st = live.get(rd.request_id)
        if st is None:
            continue
        lists = rd.new_block_ids_by_layer_group
        if first:
            st.slots, st.lists_epoch = [list(x) for x in lists], st.lists_epoch + 1
        else:
            for have, new in zip(st.slots, lists, strict=True):
                have.extend(new)
    gone: dict = {}
    pages.reported(geometry(), live, list(reports), gone)
    return set(gone)


def test_a_prompt_page_given_to_another_request_means_its_holder_is_gone() -> None:
    pages, x, y = PageOwners(), _state(1), _state(2)
    live = {1: x, 2: y}
    assert _seen(pages, live, (_report(1, [10, 11, 12, 13]), True)) == set()
    assert _seen(pages, live, (_report(2, [13, 30]), True)) == {1}


def test_pages_shared_by_block_reuse_say_nothing() -> None:
    """Y's device match (two blocks) is X's prefix: those pages are shared, X lives -- also when
    the first report understates it (a position measured from what was offered, not honoured):
    the device match the lookup was asked about counts."""
    pages, x = PageOwners(), _state(1)
    live = {1: x, 2: _state(2, device_blocks=2), 3: _state(3, device_blocks=2)}
    _seen(pages, live, (_report(1, [10, 11, 12, 13]), True))
    assert _seen(pages, live, (_report(2, [10, 11, 20, 21], computed=2 * TPB), True)) == set()
    assert _seen(pages, live, (_report(3, [10, 11, 22, 23], computed=0), True)) == set()
    # A device match ending mid-block: its last, partly matched page is no evidence either.
    live[4] = _state(4)
    assert _seen(pages, live, (_report(4, [10, 11, 12, 24], computed=2 * TPB + 1), True)) == set()


def test_a_requests_device_match_is_not_recorded_as_its_own() -> None:
    pages, x, y = PageOwners(), _state(1, device_blocks=2), _state(2)
    live = {1: x, 2: y}
    _seen(pages, live, (_report(1, [10, 11, 12, 13]), True))
    assert _seen(pages, live, (_report(2, [10, 11]), True)) == set()  # X's shared prefix: not X's alone


def test_sliding_pages_and_pages_past_the_prompt_say_nothing() -> None:
    """The window frees a live request's sliding pages; speculative decoding gives back the page of
    rejected drafts (past the prompt) -- both while the request lives."""
    pages, x, y = PageOwners(), _state(1, prompt_blocks=2), _state(2)
    live = {1: x, 2: y}
    _seen(pages, live, (_report(1, [10, 11], sliding=[50, 51]), True))
    _seen(pages, live, (_report(1, [12]), False))  # a decode step's new page (drafts in it)
    assert _seen(pages, live, (_report(2, [12, 20], sliding=[50]), True)) == set()
    assert _seen(pages, live, (_report(2, [11]), False)) == {1}  # a prompt page: X was freed


def test_a_parked_loads_pages_are_its_own_in_every_group() -> None:
    """A parked request's window does not move: a sliding page its load writes, given to
    another request, means it was freed."""
    pages, z, y = PageOwners(), _state(7), _state(2)
    live = {7: z, 2: y}
    pages.loading(z, [LoadOp(7, ObjectRef(SLIDING, b"d" * 16, ((0, 2),)), (0, 1), (60, 61))], live)
    assert pages.gone == {}
    assert _seen(pages, live, (_report(2, [20], sliding=[61]), True)) == {7}


def test_a_replay_or_a_finished_request_is_no_holder() -> None:
    pages, x, y = PageOwners(), _state(1), _state(2)
    live = {1: x, 2: y}
    _seen(pages, live, (_report(1, [10, 11]), True))
    # X replayed: its lists come again (a new epoch), with other pages; its old ones go to Y.
    assert _seen(pages, live, (_report(1, [40, 41]), True), (_report(2, [10]), True)) == set()
    # X ends normally (its state is gone): its pages are anyone's.
    del live[1]
    assert _seen(pages, live, (_report(2, [40, 41]), False)) == set()
    # A request the leader keeps nothing of still tells.
    live[3] = _state(3)
    _seen(pages, live, (_report(3, [70]), True))
    assert _seen(pages, live, (_report(99, [70]), True)) == {3}


def test_records_keep_no_ended_request_alive() -> None:
    """A record names its holder weakly: an ended request's state (its whole token list) is not
    kept by pages nobody has been given fresh since."""
    pages, x = PageOwners(), _state(1)
    live = {1: x}
    _seen(pages, live, (_report(1, list(range(10, 74))), True))
    del live[1]
    ref = __import__("weakref").ref(x)
    del x
    gc.collect()
    assert ref() is None


def test_settle_drops_the_gone_and_names_the_parked() -> None:
    import weakref

    pages, stats, discards = PageOwners(), LeaderStats(), set()
    parked, running, forgotten = _state(1), _state(2), _state(4)
    parked.load.parked = True
    live = {1: parked, 2: running, 3: _state(3)}
    pages.gone = {1: (weakref.ref(parked), 0), 2: (weakref.ref(running), 0), 4: (weakref.ref(forgotten), 0)}
    pages.settle(live, stats, discards)
    assert pages.take_abandoned() == frozenset({1}) and pages.take_abandoned() == frozenset()
    assert set(live) == {3} and discards == {1, 2} and pages.gone == {}
    assert stats.loads_abandoned == 1 and stats.requests_freed_silently == 1


def test_a_request_replayed_before_the_metadata_is_not_the_one_dropped() -> None:
    """Found gone while scheduling (a page of it in another request's parked load), then looked up
    again under the same id before the metadata (V2 pauses generating requests for recompute, with
    no connector call): the replay's state is live and its load must run. Dropped by id, it was
    stopped and never returned -- the engine waited for it for ever."""
    pages, stats, discards = PageOwners(), LeaderStats(), set()
    old, other = _state(2), _state(0)
    live = {2: old, 0: other}
    _seen(pages, live, (_report(2, [447, 448]), True))
    pages.loading(other, [LoadOp(0, ObjectRef(FULL, b"d" * 16, ((0, 1),)), (0,), (447,))], live)
    assert set(pages.gone) == {2}
    replay = _state(2)
    replay.load.parked = True
    live[2] = replay  # get_num_new_matched_tokens: a new lookup, a new state
    pages.settle(live, stats, discards)
    assert pages.take_abandoned() == frozenset()
    assert live[2] is replay and discards == set() and stats.loads_abandoned == 0
