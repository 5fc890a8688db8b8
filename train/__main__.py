"""`python -m draftsmith.train --recipe RECIPE [key.sub=value ...]`, the entry `accelerate launch` runs."""

import sys

from draftsmith.cli import main
from draftsmith.logs import inherited_flags

if __name__ == "__main__":  # at the level of the `draftsmith` command that launched it, if one did
    sys.exit(main([*inherited_flags(), "train", *sys.argv[1:]]))
