"""The resident executor subsystem: a persistent GPU block fed through a ring in host-mapped memory.

- ``ring``: the ring protocol over any memoryview (pure Python, no torch or CUDA) and its C host fast paths
  (``_ringfast.c``, optional, built by ``pip install``);
- ``resident``: the executor images and the three ways of running built-in device work (resident block,
  armed full-width launches, plain launches), rendered from ``resident.cuh``; it talks to the driver only
  through ``concordia_ft.cuda``;
- ``guard``: the hazard guard that gets resident work out of the way of calls that would block on it.

The recovery log does not need any of this: checkpoints launch their handlers on the application's stream
(DESIGN.md beside this file says why). Importing this package touches no GPU.
"""
