"""The user's training script: ``python train.py 3`` (or under ``python -m skipinject``)."""

import sys

from toy_lib import ToyTrainer

if __name__ == "__main__":
    ToyTrainer().fit(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
