import os
import sys

# Shared helpers (torchrun_helpers) live in tests/; make them importable whatever directory pytest starts in.
sys.path.insert(0, os.path.dirname(__file__))
