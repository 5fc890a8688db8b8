"""`python -m draftsmith.train RECIPE [key.sub=value ...]`, the entry `accelerate launch` runs."""

import sys

from draftsmith.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
