"""ddpkit: real distributed PyTorch training, taught from a notebook.

The package behind the notebooks: a launcher that starts real ranks from a notebook kernel
(:func:`launch`), and a small production-shaped DDP trainer, one module per plane.
"""

from ddpkit.failures import LaunchError, RankFailure
from ddpkit.launch import launch
from ddpkit.runtime import RankContext

__all__ = ["LaunchError", "RankContext", "RankFailure", "launch"]
__version__ = "0.1.0"
