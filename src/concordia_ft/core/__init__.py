"""Pure-Python core: regions, page geometry, the recovery log, compaction, ring protocol.

Nothing here imports torch or a CUDA binding (ruff TID251 and tests/test_layering.py enforce it), so the
whole format and protocol layer is testable on any machine.
"""
