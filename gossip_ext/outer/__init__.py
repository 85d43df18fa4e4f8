"""The outer step, every few optimizer steps: its schedule and the one place a rule meets an
averaging (``outer_steps``), the rules (``rules``: a plain average, SlowMo's heavy ball, DiLoCo's
outer optimizer), and Streaming DiLoCo's fragments (``streaming``). How the mean over workers is
formed lives one layer down, in ``gossip_ext.averagings``."""
