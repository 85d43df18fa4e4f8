"""When gossip rounds start and when they are absorbed: the wrapper's three schedules.

The engine runs one round at a time (``start_round``, then ``finish_round`` or
``try_finish_round``). Synchronous SGP absorbs a round at the next forward, ``overlap=True`` at
the next ``transfer_params()``, and bounded asynchrony (``synch_freq > 0``) at the first forward
that finds it finished. Which call absorbs and which starts is this module's one concern, so that
the wrapper's forward, ``transfer_params()`` and ``sync_comms()`` each make a single call.

Bounded asynchrony: a round is owed for every ``transfer_params()`` call, on every rank alike, so
all ranks run the same rounds and nobody waits for a round its peer skipped; only when a round
starts and when it is absorbed depend on timing. A start that finds the previous round unfinished
is deferred to the first forward that finds it done.
"""

from __future__ import annotations

from gossip_ext.gossip.engine import Engine


class RoundSchedule:
    """Starts and absorbs the rounds of ``engine`` (any :class:`~gossip_ext.gossip.engine.Engine`)
    for the schedule given by ``overlap`` and ``synch_freq``.

    ``engine`` is None on processes that do not gossip; every call is then a no-op.
    """

    def __init__(self, engine: Engine | None, *, overlap: bool, synch_freq: int) -> None:
        self._engine = engine
        self._overlap = overlap
        self._synch_freq = synch_freq
        self._unfinished_forwards = 0  # bounded asynchrony: forwards that found a round running
        self._start_deferred = False  # bounded asynchrony: a round owed by transfer_params()

    def raise_if_failed(self) -> None:
        """Raises the failure of a round, if one failed (the engine keeps it)."""
        if self._engine is not None:
            self._engine.raise_if_failed()

    def before_forward(self, training: bool) -> None:
        """Absorbs what the schedule says the forward about to run must see."""
        # A failure stays raised on every call that would see its parameters, also where this
        # schedule does not absorb before the forward (overlap).
        self.raise_if_failed()
        if self._engine is None:
            return
        if not training:
            # Evaluation sees every message sent so far (the reference forgets to absorb).
            self._engine.finish_round()
        elif self._synch_freq > 0:
            self._absorb_bounded()
        elif not self._overlap:
            self._engine.finish_round()

    def start(self) -> None:
        """Starts the round of the optimizer step just taken (or owes it, under bounded
        asynchrony), after absorbing the previous one where the schedule says so."""
        if self._engine is None:
            return
        if self._synch_freq > 0:
            self._transfer_bounded()
        else:
            self._engine.finish_round()
            self._engine.start_round()

    def drain(self) -> None:
        """Waits for the round in flight, and any round still owed, and absorbs them; then waits
        on the host until the last absorbed round has really completed (a GPU's absorb is only
        stream-ordered behind it), raising if it failed."""
        self.raise_if_failed()
        if self._engine is None:
            return
        self._engine.finish_round()
        if self._start_deferred:
            self._start_deferred = False
            self._engine.start_round()
            self._engine.finish_round()
        self._engine.synchronize()

    def run_round(self) -> None:
        """Absorbs what is in flight, then runs one round from start to absorb, blocking: the
        round of an outer step averaged by gossip, which the outer step needs at once."""
        self.drain()
        if self._engine is None:
            return
        self._engine.start_round()
        self._engine.finish_round()
        self._engine.synchronize()

    def restart(self) -> None:
        """Drains, and starts the count of forwards that found a round running afresh: after an
        exact average nothing is pending."""
        self.drain()
        self._unfinished_forwards = 0

    def _absorb_bounded(self) -> None:
        engine = self._engine
        assert engine is not None  # only called with an engine
        if engine.in_flight:
            if engine.try_finish_round():
                self._unfinished_forwards = 0
            else:
                self._unfinished_forwards += 1
                if self._unfinished_forwards > self._synch_freq:
                    engine.finish_round()
                    self._unfinished_forwards = 0
        if self._start_deferred and not engine.in_flight:
            self._start_deferred = False
            engine.start_round()

    def _transfer_bounded(self) -> None:
        engine = self._engine
        assert engine is not None  # only called with an engine
        if self._start_deferred:  # a round is already owed: wait, and start it now
            engine.finish_round()
            engine.start_round()
        self._start_deferred = not engine.try_finish_round()
        if not self._start_deferred:
            engine.start_round()
