"""``skiff-loadtest``: closed- and open-loop load against skiff workers.

The package speaks to workers only through ``protocol`` (never worker
internals), so it measures what a real client sees. ``run_load`` returns the
summary dict that the CLI prints, and that tests and benchmarks use in-process.
"""

from .prompts import builtin_prompts, load_prompts, make_text
from .runner import LoadConfig, run_load, run_load_async
from .stats import RequestRecord, distribution, percentile, poisson_arrivals, summarize

__all__ = [
    "LoadConfig",
    "RequestRecord",
    "builtin_prompts",
    "distribution",
    "load_prompts",
    "make_text",
    "percentile",
    "poisson_arrivals",
    "run_load",
    "run_load_async",
    "summarize",
]
