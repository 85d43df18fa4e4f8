"""The benchmark harness: what measures gossip_ext, never part of it, and never installed.

- :mod:`harness.demo`: the README's main job, gossip_ext beside DDP, PowerSGD, decent-dp and
  torchft on a small byte-level language model (``python3 -m harness.demo``).
- :mod:`harness.demo_mlp`: the older, quicker demo on a small MLP.
- :mod:`harness.compare`: each compared system's training step, one worker's run and the runner.
- :mod:`harness.tasks`: the real task they train on (the standard library's sources, a byte-level
  transformer).
- :mod:`harness.netns`: an emulated cluster on one Linux machine, every worker behind its own
  rate-capped NIC (network namespaces, veth, tc).

It imports gossip_ext, torchft and decent-dp; gossip_ext imports nothing from here. Run it from
the repository root (``python3 -m harness.demo``); benchmarks/ put the root on ``sys.path``
themselves, and pytest does through tests/conftest.py.
"""
