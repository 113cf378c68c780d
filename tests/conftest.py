import sys
from pathlib import Path

# Make tests/tiny.py importable as `tiny` from every test module.
sys.path.insert(0, str(Path(__file__).parent))
