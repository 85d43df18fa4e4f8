"""The outer step, every few optimizer steps: its interfaces (``interface``: the outer steps, the
rule and the state a rule keeps), the lockstep steps and the one place a rule meets an averaging
(``outer_steps``), the rules (``rules``: a plain average, DiLoCo's outer optimizer;
``slow_momentum``: SlowMo's heavy ball), Streaming DiLoCo's fragments (``streaming``) and
AsyncDiLoCo's outer steps (``asynchronous``). How the mean over workers is formed lives one layer
down, in ``gossip_ext.averagings``."""
