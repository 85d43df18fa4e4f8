"""The gossip between steps: the compiled engine's rounds (``inner``), when they start and are
absorbed (``schedule``), the consensus estimate (``consensus``), which transport carries them
(``transport``), the engine over copies of a sharded module's local shards (``mirrored``), and
several processes per machine (``hierarchy``)."""
