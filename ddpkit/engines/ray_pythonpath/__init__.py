"""A folder that :mod:`ddpkit.engines.ray_launch` puts first on ``PYTHONPATH`` for the processes of the
local Ray it starts. It holds one module, ``rfc3987_syntax``, whose import fails (see its docstring)."""
