import os
import sys

# The Hugging Face checkpoint fixtures live in tests/models; make them importable whatever directory pytest starts in.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))
