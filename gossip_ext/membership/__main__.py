"""``python -m gossip_ext.membership``: the elastic job's membership service."""

import sys

from gossip_ext.membership.service import main

if __name__ == "__main__":
    sys.exit(main())
