import os
import sys

# The torchrun helper lives beside the tests; make it importable whatever directory pytest starts in.
sys.path.insert(0, os.path.dirname(__file__))
