"""Side-by-side comparison of gossip_ext with the systems a user would pick instead, on the real
task of :mod:`harness.tasks`: :mod:`.systems` (each system's training step), :mod:`.worker`
(one worker's run and its held-out quality against time) and :mod:`.runner` (N local processes)."""
