"""Control: which prompts each step trains on and how many rollouts each gets.

- `UniformSampler`: the seeded epoch-by-epoch prompt stream.
- `PosteriorBook`: a Beta posterior of each prompt's success rate with two-scale decay.
- `Allocator` protocol and `ALLOCATORS` (uniform, dynamic, thompson, pilot_commit, dars, vcrl,
  gdro; aero, xrpo, hive in control/adaptive.py), driven round by round by a `Controller`.
  See docs/allocation.md.

May import: types, registry.
"""

from rollwise.control import adaptive  # noqa: F401  (registers aero, xrpo, hive)
from rollwise.control.allocators import ALLOCATORS, make_allocator
from rollwise.control.controller import Allocator, Controller, Request, merge_groups
from rollwise.control.posterior import PosteriorBook
from rollwise.control.sampler import UniformSampler

__all__ = ["ALLOCATORS", "Allocator", "Controller", "PosteriorBook", "Request", "UniformSampler",
           "make_allocator", "merge_groups"]
