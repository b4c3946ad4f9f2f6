import os
import sys

# Run from the source tree without installing (the README's test command does the same).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
