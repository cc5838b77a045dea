"""The scheduler side (``LeaderCore``): lookups, load plans, save plans, finish plans.

``core`` is the facade the adapter calls; ``requests`` holds the per-request state; ``context``
what the geometry fixes; ``lookup``, ``loads``, ``saves`` and ``finish`` one decision each;
``stats`` the counters.
"""

from .core import LeaderCore
from .stats import LeaderStats

__all__ = ["LeaderCore", "LeaderStats"]
