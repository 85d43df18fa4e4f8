"""The gossip between steps: the engines' interface (``engine``), the compiled engine's rounds and
the engine over a sharded module's shards (``inner``), when they start and are absorbed
(``schedule``), the consensus estimate (``consensus``), which transport carries them
(``transport``), asynchronous push-sum and the compiled channels its messages move on
(``asynchronous``, ``mailbox``, ``messages``), and several processes per machine
(``hierarchy``)."""
