"""``python -m gossip_ext.info``: prints what this gossip_ext is and what it can run here."""

from gossip_ext.info import main

main()
