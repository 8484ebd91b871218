"""ddpkit: real distributed PyTorch training, taught from a notebook.

The package behind the notebooks: a launcher that starts real ranks from a notebook kernel
(:func:`launch`), and a small production-shaped trainer, one module per plane, with parallelism
strategies behind one interface (``ddpkit.parallel``).
"""

from ddpkit.errors import UserError
from ddpkit.failures import LaunchError, RankFailure
from ddpkit.launch import launch
from ddpkit.parallel.dims import ParallelDims
from ddpkit.runtime import RankContext

__all__ = ["LaunchError", "ParallelDims", "RankContext", "RankFailure", "UserError", "launch"]
__version__ = "0.2.0"
