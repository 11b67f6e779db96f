"""The tier's cost policy: use Redis only for items that are cheaper to fetch than to make.

A tier hit is not free: a ``redis.asyncio`` GET of 16 MiB on localhost took 44 ms here, more
than a typical 20 ms preprocessing. A look-up is two steps: a *probe* (one round trip: is there
a value, how large; or claim the hash) and, if a value is there and worth it, its *fetch* (GET,
signature check and decoding of ``n`` bytes). The policy learns, from what the tier observes:

* ``make(n) = a_m + b_m * n`` — from every ``make`` this host ran, and from the make time a
  value carries (the host that wrote it measured it);
* ``probe`` — the round trip of every probe;
* ``fetch(n) = a_f + b_f * n`` — from every fetch of a value, timed from the probe's answer.

Each is an exponentially weighted least-squares fit (recent samples count more: ``decay`` per
sample), so the policy follows a machine that gets busier or a network that gets slower.

Decisions (pure functions of what was learned):

* :meth:`TierPolicy.fetch_budget` — the largest value worth fetching: the largest ``n`` with
  ``fetch(n) <= margin * make(n)``, capped at ``max_bytes``; 0 means no value is worth
  fetching, or a probe alone (one round trip) costs more than ``margin`` times the make of a
  typical item (one of the mean size made), so the tier is skipped altogether. A look-up
  never transfers a value larger than the budget (the probe reports the size first), nor one
  whose size :meth:`TierPolicy.worth_fetching` turns down.
* **Items of one size** teach nothing about how a cost grows with size: each fit then goes
  through the one point seen (:class:`LinearCost`), and every decision about items of that
  size is exact. (Before, two clusters a few hundred bytes apart — an item's array bytes
  made here, its value's bytes fetched — made a line of any slope; a make fit with intercept
  0 then read as "a round trip costs more than a make", and the budget was 0 while makes
  took 90 ms and fetches 2.3 ms.)
* :meth:`TierPolicy.worth_storing` — write an item only if fetching it would beat making it
  (``fetch(n) <= margin * max(its measured make, make(n))``): no host would fetch it otherwise.
* **The probe is a sunk cost** in both: when the probe has reported a value's size, its round
  trip is paid whether the value is fetched or made, and a host that looks an item up pays it
  whether the item was stored or not. Only what a fetch adds is weighed against the make.
  (Before, the probe was part of ``fetch(n)``: on a loaded machine, where a round trip took
  20 ms of a 250 ms make, it shrank every budget and kept items out of the tier that fetching
  would still have served faster than a make.)
* Until a make has been seen, the make cost is unknown and the budget is ``max_bytes``
  (optimistic: the first look-ups teach the fetch cost). Until ``min_samples`` probes (for the
  probe) and fetches of a value (for the fetch) have been seen, the costs are priors
  (``prior_fixed_s``, and ``prior_fixed_s + n * prior_per_byte_s``), and the first ``warmup``
  samples are not learned from at all: a process's first look-ups also open its connections
  (a pool opens one per concurrent request), and such outliers must not decide what the fleet
  stores.
* ``learn=False`` keeps the priors and an unknown make cost for good: every value is looked
  up, and an item is stored when the prior fetch cost beats the make it took (deterministic:
  for tests and for operators who measured their costs).
* :meth:`TierPolicy.lookup_deadline` — how long a look-up may take: ``deadline_fraction`` (1)
  of a typical make, never less than the tier's ``lookup_timeout_s`` (``first_deadline_s``
  until a make is seen). At worst a look-up that gets no answer in time doubles a miss.
* **Exploration.** An item the budget excludes is never fetched, so the fetch cost of large
  items would never be re-learned after a slow spell: one look-up in ``explore_every`` gets the
  full ``max_bytes`` budget.
"""

from __future__ import annotations

from ._types import PolicyView

__all__ = ["LinearCost", "PolicyView", "TierPolicy"]


class LinearCost:
    """An exponentially weighted least-squares fit of ``seconds = a + b * nbytes``.

    A slope is fitted only when the sizes seen spread (their weighted standard deviation is at
    least ``SPREAD`` of their mean). Sizes that are all equal, or nearly so (items of one size:
    an image made here is counted by its array bytes, the same image fetched from the tier by
    its value's bytes, a few hundred more), say nothing about how the cost grows with size: a
    line through two such clusters is noise (its slope, and with it the intercept, took any
    value, a negative intercept included). Such a fit is through the one point seen:
    proportional (``a = 0``) if ``proportional`` (a fetch: its cost grows with the bytes), else
    flat (``b = 0``: a make of unknown size dependence). Either predicts the mean cost at the
    size seen, which is all a decision about items of that size needs.
    """

    #: the relative spread of sizes below which they count as one size
    SPREAD = 0.05

    def __init__(self, *, decay: float = 0.95, proportional: bool = False) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self._decay = decay
        self._proportional = proportional
        self._w = self._sx = self._sxx = self._sy = self._sxy = 0.0
        self.samples = 0

    def add(self, nbytes: float, seconds: float) -> None:
        """One observation (negative or non-finite values are ignored)."""
        if not (0 <= nbytes < float("inf") and 0 <= seconds < float("inf")):
            return
        d = self._decay
        x = nbytes / 1e6  # MB: keeps the sums well scaled
        self._w = self._w * d + 1.0
        self._sx = self._sx * d + x
        self._sxx = self._sxx * d + x * x
        self._sy = self._sy * d + seconds
        self._sxy = self._sxy * d + x * seconds
        self.samples += 1

    def mean_size(self) -> float:
        """The weighted mean of the sizes seen (bytes); 0 before any sample."""
        return self._sx / self._w * 1e6 if self._w else 0.0

    def coefficients(self) -> tuple[float, float]:
        """``(a seconds, b seconds per byte)``, both >= 0; ``(0, 0)`` before any sample."""
        if self._w == 0:
            return 0.0, 0.0
        w, sx, sxx, sy, sxy = self._w, self._sx, self._sxx, self._sy, self._sxy
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > (self.SPREAD * mx) ** 2:
            b = (sxy / w - mx * my) / var
            a = my - b * mx
            if b < 0:  # costs do not shrink with size: a flat fit
                a, b = my, 0.0
            elif a < 0:  # nor are they negative at size 0: a proportional fit
                a, b = 0.0, sxy / sxx
        elif self._proportional and mx > 0:
            a, b = 0.0, my / mx
        else:
            a, b = my, 0.0
        return a, b / 1e6

    def predict(self, nbytes: float) -> float:
        """Seconds for ``nbytes``."""
        a, b = self.coefficients()
        return a + b * nbytes


class TierPolicy:
    """Learns make and fetch costs; decides what to look up and what to store (see module)."""

    def __init__(
        self,
        *,
        margin: float = 0.8,
        decay: float = 0.95,
        prior_fixed_s: float = 0.0005,
        prior_per_byte_s: float = 2.5e-9,
        explore_every: int = 50,
        learn: bool = True,
        min_samples: int = 5,
        warmup: int = 16,
        deadline_fraction: float = 1.0,
        first_deadline_s: float = 0.5,
    ) -> None:
        if not 0 < margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {margin!r}")
        if prior_fixed_s < 0 or prior_per_byte_s < 0:
            raise ValueError("the priors must be >= 0")
        if type(warmup) is not int or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if type(min_samples) is not int or min_samples < 1:
            raise ValueError(f"min_samples must be an int >= 1, got {min_samples!r}")
        if not isinstance(deadline_fraction, (int, float)) or not 0 < deadline_fraction <= 10:
            raise ValueError(f"deadline_fraction must be in (0, 10], got {deadline_fraction!r}")
        if not isinstance(first_deadline_s, (int, float)) or not 0 <= first_deadline_s < 3600:
            raise ValueError(f"first_deadline_s must be in [0, 3600), got {first_deadline_s!r}")
        if type(explore_every) is not int or explore_every < 0:
            raise ValueError(f"explore_every must be an int >= 0 (0: never), got {explore_every!r}")
        self.margin = margin
        self._make = LinearCost(decay=decay)
        self._probe = LinearCost(decay=decay)  # at size 0: a flat fit, the mean
        self._fetch = LinearCost(decay=decay, proportional=True)
        self._prior = (prior_fixed_s, prior_per_byte_s)
        self._explore_every = explore_every
        self._learn = learn
        self._min = min_samples
        self._warmup = warmup  # fetch samples still to ignore
        self._lookups = 0
        self._deadline_fraction = float(deadline_fraction)
        self._first_deadline = float(first_deadline_s)

    # --- learning ---------------------------------------------------------------------------

    def observe_make(self, seconds: float, nbytes: int) -> None:
        """A ``make`` produced a value of ``nbytes`` in ``seconds`` (here or on another host)."""
        if self._learn:
            self._make.add(nbytes, seconds)

    def observe_probe(self, seconds: float) -> None:
        """A probe (one round trip: a value's size, a claim, a lease) took ``seconds``."""
        if self._learning():
            self._probe.add(0, seconds)

    def observe_fetch(self, seconds: float, nbytes: int) -> None:
        """The fetch of a value of ``nbytes`` took ``seconds`` from the probe's answer."""
        if self._learning():
            self._fetch.add(nbytes, seconds)

    def _learning(self) -> bool:
        if not self._learn:
            return False
        if self._warmup > 0:
            self._warmup -= 1
            return False
        return True

    # --- estimates --------------------------------------------------------------------------

    def make_cost(self, nbytes: int) -> float | None:
        """Predicted seconds of a ``make`` of ``nbytes``; None before any was seen."""
        return self._make.predict(nbytes) if self._make.samples else None

    def make_coefficients(self) -> tuple[float, float]:
        """``(fixed seconds, seconds per byte)`` of a ``make`` as learned (``(0, 0)`` before any
        was seen): the line ``make_cost`` predicts on, beside ``fetch_coefficients``."""
        return self._make.coefficients()

    def probe_cost(self) -> float:
        """Predicted seconds of a probe (the prior until learned)."""
        if self._probe.samples < self._min:
            return self._prior[0]
        return self._probe.coefficients()[0]

    def fetch_coefficients(self) -> tuple[float, float]:
        """``(fixed seconds, seconds per byte)`` of a fetch after its probe (the priors until
        learned)."""
        if self._fetch.samples < self._min:
            return self._prior
        return self._fetch.coefficients()

    def fetch_cost(self, nbytes: int) -> float:
        """Predicted seconds of fetching a value of ``nbytes`` once the probe has answered."""
        a, b = self.fetch_coefficients()
        return a + b * nbytes

    # --- decisions --------------------------------------------------------------------------

    def fetch_budget(self, max_bytes: int) -> int:
        """The largest value worth fetching (<= ``max_bytes``); 0: skip the tier."""
        if self._make.samples == 0:
            return max_bytes
        m = self.margin
        # a round trip alone loses to the make of a typical item (of the mean size made): not
        # to the make's intercept, which is 0 for a make that grows with its size
        if self.probe_cost() > m * self._make.predict(self._make.mean_size()):
            return 0
        am, bm = self._make.coefficients()
        af, bf = self.fetch_coefficients()
        # fetch(n) <= m * make(n)  <=>  n * (bf - m*bm) <= m*am - af
        room, slope = m * am - af, bf - m * bm
        if slope <= 0:
            if room >= 0:
                return max_bytes
            # only large values win (rare: a make that grows faster than a fetch); a look-up
            # cannot ask for "at least n" bytes, so take the tier if the largest one wins
            # (:meth:`worth_fetching` then turns down the small ones by their reported size)
            return max_bytes if room - slope * max_bytes >= 0 else 0
        if room < 0:
            return 0
        return int(min(room / slope, max_bytes))

    def lookup_deadline(self, floor_s: float) -> float:
        """How long a look-up's round trip may take: ``deadline_fraction`` of the make of a
        typical item (what a hit saves), at least ``floor_s``.

        A fixed deadline is eaten by the host's own loop lag when it is busy (the answer is
        there, the loop reads it late), and the tier then makes what it could have fetched
        exactly when sharing matters most; one sized from the make is as long as the look-up
        is worth waiting for, whatever the load. Until a make is seen, ``first_deadline_s``
        (the first look-ups of a process also open its connections, each a few round trips).
        """
        if self._make.samples == 0:
            return max(floor_s, self._first_deadline)
        return max(floor_s, self._deadline_fraction * self._make.predict(self._make.mean_size()))

    def worth_fetching(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` (its size reported by the probe) beats its make."""
        make = self.make_cost(nbytes)
        return make is None or self.fetch_cost(nbytes) <= self.margin * make

    def lookup_budget(self, max_bytes: int) -> int:
        """:meth:`fetch_budget` for the next look-up, with one in ``explore_every`` at full size."""
        return self.next_lookup(max_bytes)[0]

    def next_lookup(self, max_bytes: int) -> tuple[int, bool]:
        """``(budget, exploring)`` of the next look-up: an exploring one fetches any value up
        to ``max_bytes`` (its cost is then learned again), the others only what is worth it."""
        self._lookups += 1
        if self._explore_every and self._lookups % self._explore_every == 0:
            return max_bytes, True
        return self.fetch_budget(max_bytes), False

    def worth_storing(self, nbytes: int, make_seconds: float) -> bool:
        """Whether fetching ``nbytes`` would beat making it: the ``make_seconds`` this item
        took, or what a make of that size costs (as learned), whichever is longer.

        Why both: the hosts that look the item up decide by the learned cost; judged by its one
        make alone, an item made in a quiet moment would be refused (and every host would make
        it for ``skip_ttl_s``) although each of them would fetch it.
        """
        learned = self.make_cost(nbytes)
        make = make_seconds if learned is None else max(make_seconds, learned)
        return self.fetch_cost(nbytes) <= self.margin * make

    def view(self, max_bytes: int) -> PolicyView:
        """A snapshot of the learned costs."""
        am, bm = self._make.coefficients()
        af, bf = self.fetch_coefficients()
        return PolicyView(
            make_fixed_s=am,
            make_per_byte_s=bm,
            probe_s=self.probe_cost(),
            fetch_fixed_s=af,
            fetch_per_byte_s=bf,
            makes_seen=self._make.samples,
            probes_seen=self._probe.samples,
            fetches_seen=self._fetch.samples,
            budget_bytes=self.fetch_budget(max_bytes),
        )
