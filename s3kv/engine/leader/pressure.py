"""Offers a smaller honour cannot break: V2's one fallback point, and when to stay clear of it.

KVCacheManagerV2 with chunked prefill honours less than offered in one case only (its
``_reserve_connector_prefix``; docs/failures.md, "Smaller honours"): the offer reaches the
end of the request's first chunk ``C = d + chunk``, so the allocation must grow to the offer plus
a chunk, and that grow fails -- no free page, memory pressure. It then honours the largest whole
block that still leaves a chunk to compute, ``(C - 1) // tpb * tpb`` (nothing when that is not
past ``d``). An offer is therefore **exposed** only when it needs that grow and its fallback point
is past ``d`` and not servable (no stored sliding tail ends there): a failed grow breaks the
promise -- the request parks on a line without the failed-load path, and is recomputed whole on
one with it.

Why not store a tail at every fallback point: the chunk is the scheduler's choice each pass, so
the point is any block boundary, and tails that tile every sliding block cost about what storing
everything costs (+128% bytes on the trace). Why not cut every exposed offer to a point inside the
first chunk (V2 always honours that in full): on an engine with free pages that throws away every
token past the first chunk of every long hit. So an exposed offer is cut only while the engine
*shows* pressure: a smaller honour (of any request) turns it on; an offer that needed a grow and
was honoured in full -- the engine grew -- or the hold (``PRESSURE_HOLD_S``) without a smaller
honour turns it off. The first exposed offer of an episode can still be broken; the ones after it
are not; a request the engine looks up again after it ran (preempted for want of pages) shows
pressure before any grow fails. Offers that need a grow but are safe (their fallback is servable,
or not past ``d``) are made in full all along, and they are what shows when the pressure ends. Where few such offers
come (with the Gemma-3-27B geometry checkpoints fall every 4608 tokens, so a first chunk of 8192
is exposed), the hold is what ends an episode; pressure seen again within a hold of its expiry
doubles the hold (up to ``PRESSURE_HOLD_MAX_S``), so sustained pressure risks one broken promise
per doubling, not one a minute. A grow seen to succeed resets it.

Flapping (issue 37, attacked). A client can make the engine short of pages and let go again at
will: a burst of long prompts that miss (so nothing it sends is an offer) breaks the first
exposed offer of the episode -- another client's -- and one safe grow-needing offer honoured in
full once the burst is over (a stored prefix of its own) ended the episode at once. Each burst
then broke one more promise (4 bursts: 4 victims parked; a burst every 30 s: 120 an hour). So an
episode a grow ends counts as ending when its hold would have run out, and pressure back within a
hold of the last episode's end is flapping: the hold doubles as above, and that episode ends only
when its hold runs out -- a grow no longer ends it early. A flapping engine then risks one broken
promise per doubling, as sustained pressure does (4 bursts: 2; a burst every 30 s or 2 min: 0.5
an hour, with exposed offers cut meanwhile); an episode after a quiet spell is a new one, ended
by the first grow as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds after the last smaller honour the engine counts as under memory pressure, unless a
#: grow is seen to succeed first. A minute: pressure comes from the batch the engine is running,
#: which turns over in seconds to a minute; a longer hold only cuts offers a grown engine could take.
PRESSURE_HOLD_S = 60.0
#: The longest the hold grows to under pressure that keeps coming back (four doublings): past
#: this, one broken promise per 16 minutes is the price of not cutting for nothing all day.
PRESSURE_HOLD_MAX_S = 960.0


def fallback_blocks(d_blocks: int, offer_blocks: int, first_chunk_tokens: int, tpb: int) -> int | None:
    """The history (blocks) V2 honours if growing the allocation for this offer fails, or None
    when the offer ends inside the first chunk (no grow: always honoured in full)."""
    end = d_blocks * tpb + first_chunk_tokens
    if (d_blocks + offer_blocks) * tpb < end:
        return None
    return max(d_blocks, (end - 1) // tpb)


class PressureGauge:
    """Whether the engine shows KV memory pressure, from what it honoured."""

    def __init__(self, hold_s: float = PRESSURE_HOLD_S, max_hold_s: float = PRESSURE_HOLD_MAX_S,
                 clock: Callable[[], float] = time.monotonic):
        self.base_hold_s = self.hold_s = hold_s
        self.max_hold_s = max(hold_s, max_hold_s)
        self.clock = clock
        self._since: float | None = None
        #: When the last episode ended (its hold ran out, or a grow ended it); None: none did.
        self._expired_at: float | None = None
        #: This episode came back within a hold of the last one's end: only its hold ends it.
        self._flapping = False
        #: Times pressure was seen to begin (a smaller honour while none was held).
        self.episodes = 0

    def on(self) -> bool:
        if self._since is not None and self.clock() - self._since > self.hold_s:
            self._expired_at = self._since + self.hold_s
            self._since = None
        return self._since is not None

    def replayed(self, *, ran: bool) -> None:
        """The engine looked a request up again. Once it ``ran`` (was scheduled), that is the engine
        taking its pages back to run it anew -- V2 preempts when pages run short: pressure, before
        any grow has failed. A request asked again before it ever ran may have been dropped from a
        pass for another reason (the token budget), so it shows nothing."""
        if ran:
            self.honoured(needed_grow=False, less=True)

    def honoured(self, *, needed_grow: bool, less: bool) -> None:
        """What the engine honoured of an offer (``needed_grow``: the offer reached the first
        chunk's end). Smaller: a grow failed, pressure (re)starts. In full after a needed grow:
        the engine had the pages, pressure is over."""
        now = self.clock()
        if less:
            if not self.on():
                self.episodes += 1
                back_soon = self._expired_at is not None and now - self._expired_at <= self.hold_s
                self.hold_s = min(2 * self.hold_s, self.max_hold_s) if back_soon else self.base_hold_s
                self._flapping = back_soon
            self._since = now
        elif needed_grow and self.on() and not self._flapping:
            # The engine grew: over -- unless it is flapping (module docstring), then the hold ends
            # it. Pressure back within a hold of when this hold would have run out is flapping.
            assert self._since is not None
            self._expired_at = self._since + self.hold_s
            self._since = None
            self.hold_s = self.base_hold_s
