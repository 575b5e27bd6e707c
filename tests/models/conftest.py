import os
import sys

# The fixture helpers live beside the tests, and the programs' shared checks in programs/; make them importable
# whatever directory pytest starts in.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "programs"))
