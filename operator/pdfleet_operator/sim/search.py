"""Bisection for the equal-SLO search (pure): which of a policy's variants, ordered from least to most headroom, to run
next; `sim.cli` asks `Bisection.next` after each run.

A fleet file's `equalSlo.search` lists, per policy, variants ordered so that SLO attainment does not
fall along the list (more replicas, a lower target utilization, a higher floor, ...) and cost does not
either. The cheapest variant that reaches the target's attainment is then the first that does, and
bisection finds it in about log2(n) runs instead of n: the last variant first (if even the most
headroom misses, none reaches and one run says so), then halves of what is left. What was run is
reported with its numbers; a run that contradicts the ordering (a variant that reaches the target
before one after it that does not) is reported too (`monotone` False), and the answer is still the
cheapest run that reached the target, of those run.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Bisection:
    """The search over `n` ordered variants for the first whose attainment is >= `goal`."""

    n: int
    goal: float | None = None
    attained: dict[int, float | None] = field(default_factory=dict)  # variant index -> its SLO attainment

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"a search needs at least one variant, got {self.n}")

    def reaches(self, i: int) -> bool:
        got = self.attained[i]
        return got is not None and self.goal is not None and got >= self.goal

    def next(self) -> int | None:
        """The variant to run next, or None when the search is over (or waits for `goal`)."""
        if self.goal is None:
            return None
        last = self.n - 1
        if last not in self.attained:
            return last
        lo, hi = self.bounds()
        if hi is None or lo >= hi:
            return None
        mid = (lo + hi) // 2
        assert mid not in self.attained, f"bisection probed variant {mid} twice ({lo}..{hi})"
        return mid

    def bounds(self) -> tuple[int, int | None]:
        """(the lowest index that may still be the first to reach the goal, the lowest run that reached it)."""
        reached = [i for i in self.attained if self.reaches(i)]
        hi = min(reached) if reached else None
        missed = [i for i in self.attained if not self.reaches(i) and (hi is None or i < hi)]
        lo = max(missed) + 1 if missed else 0
        return lo, hi

    def found(self) -> int | None:
        """The first variant that reaches the goal, once `next` is None (None: none of them does)."""
        return self.bounds()[1]

    def monotone(self) -> bool:
        """Whether the runs agree with the ordering: no variant misses the goal after one that reached it."""
        reached = [i for i in self.attained if self.reaches(i)]
        return not reached or all(self.reaches(i) for i in self.attained if i > min(reached))
