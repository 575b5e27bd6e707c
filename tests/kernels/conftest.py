import os
import sys

# kernel_checks lives beside the tests (and runs as a script under Triton's interpreter); make it importable.
sys.path.insert(0, os.path.dirname(__file__))
