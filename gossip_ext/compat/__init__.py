"""Compatibility layers: the public names and signatures of other decentralized-training
libraries, mapped onto gossip_ext's one engine, so that their users' scripts run with only the
import line changed.

One module per library, imported on its own (this package imports none of them), e.g.
:mod:`gossip_ext.compat.sgp` for the ``gossip`` package of Stochastic Gradient Push. Each maps
names and arguments only: the gossip itself is always :class:`gossip_ext.GossipDataParallel`'s.
"""
