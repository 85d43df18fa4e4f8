"""The gossip between steps: the compiled engine's rounds (``inner``), when they start and are
absorbed (``schedule``), the consensus estimate (``consensus``), which transport carries them
(``transport``), and several processes per machine (``hierarchy``)."""
