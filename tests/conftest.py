import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: threading overhead would dominate, and the machine is shared.
torch.set_num_threads(1)
