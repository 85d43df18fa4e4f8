"""gossip_ext under PyTorch Lightning: ``Trainer(strategy=GossipStrategy(...))``, or
``Trainer(strategy="gossip")`` once this module is imported (``pip install gossip_ext[lightning]``).
docs/lightning.md says what it does with validation, checkpoints and Lightning's options."""

from pytorch_lightning.strategies import StrategyRegistry

from .strategy import GossipStrategy

GossipStrategy.register_strategies(StrategyRegistry)

__all__ = ["GossipStrategy"]
