import os
import sys

# The fixture helpers live beside the tests; make them importable whatever directory pytest starts in.
sys.path.insert(0, os.path.dirname(__file__))
