"""One rank's worker (``WorkerCore``): executes each iteration's plan, loads and saves pages.

``core`` is the facade the adapter calls; ``rank`` what ``register_layout`` fixes; ``saves``
the save jobs; ``loads`` the load jobs and their failure rungs; ``stats`` the counters.
"""

from .core import LoadTimeout, WorkerCore, WorkerStats

__all__ = ["LoadTimeout", "WorkerCore", "WorkerStats"]
