import os
import sys

# The tests import their helpers (launch, reference) and the worker scripts' shared tables
# (workers/common.py, workers/scenarios.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
